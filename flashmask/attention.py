"""``flashmask_attention``: the functional API and the choice of backend."""
from __future__ import annotations

import warnings
from typing import Optional, Tuple, Union

import torch

from flashmask import _checks, _cuda
from flashmask._memo import Recent, tensor_key
from flashmask.reference import reference_attention
from masks.convert import _window, merge_window, window_to_startend

BACKENDS = ("auto", "cuda", "sm80", "sm90", "reference")


def flashmask_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        startend_row_indices: Optional[torch.Tensor] = None, *, causal: bool = False,
                        softmax_scale: Optional[float] = None,
                        window_size: Optional[Tuple[int, int]] = None, return_lse: bool = False,
                        deterministic: bool = False, backend: str = "auto", validate: bool = False,
                        softcap: float = 0.0,
                        sinks: Optional[torch.Tensor] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention under a FlashMask column-interval mask.

    Args:
        q: ``[B, Sq, Hq, Dqk]``. A transposed ``[B, H, S, D]`` tensor viewed as BSHD (``x.transpose(1, 2)``)
            works without a copy: only the last dimension must be contiguous.
        k: ``[B, Sk, Hk, Dqk]`` with ``Hq % Hk == 0`` (GQA / MQA).
        v: ``[B, Sk, Hk, Dv]``: the value head dim may differ from the query/key one (MLA as in
            DeepSeek-V2/V3: ``Dqk = 192``, ``Dv = 128``).
        startend_row_indices: int32 ``[B, Hm, Sk, C]`` with ``Hm`` in ``{1, Hk, Hq}``: for each key
            column the query rows that may not attend it (the contract, with worked examples, is
            docs/format.md; builders in :mod:`masks`). ``None``: no mask beyond ``causal``.
            Values outside ``[0, Sq]`` act as if clamped to it, and an interval whose start is past
            its end is empty.
        causal: a bool: add the causal mask, aligned bottom-right when ``Sq != Sk``. Also selects
            how ``C`` is read: causal ``C`` in {1, 2}, non-causal ``C`` in {2, 4}.
        softmax_scale: a finite float > 0; defaults to ``1 / sqrt(Dqk)``.
        window_size: ``(left, right)`` local window as in flash-attn (``-1`` = unbounded), merged into
            the mask where the result is expressible in the column-interval format. The merged mask
            is kept for the next calls with the same mask tensor (unchanged) and window.
        return_lse: also return the log-sum-exp ``[B, Hq, Sq]`` (float32, float64 for float64 inputs;
            ``+inf`` on rows that no key may attend, whose output is 0; with ``sinks`` it includes the
            sink, and such rows get ``sinks[h]``).
        deterministic: bitwise reproducible gradients (a fixed dQ accumulation order in the kernel;
            the backward takes longer: docs/performance.md).
        backend: ``"auto"`` (the CUDA kernels when built and the inputs qualify, else the reference
            path), ``"cuda"`` (raises if the kernels cannot run), ``"sm80"`` / ``"sm90"`` (the CUDA
            kernels of that architecture family: ``"sm80"`` runs the mma.sync kernels on a Hopper GPU
            too, its backward only in a build with ``FLASHMASK_ARCHS=90`` (else on the SM90
            kernels); the environment variable ``FLASHMASK_ARCH=80|90``, read once per
            process, does the same for ``"cuda"``) or
            ``"reference"``.
        validate: also check every mask value: each must lie in ``[0, Sq]``, with ``LTS <= LTE`` and
            ``UTS <= UTE``; a ``ValueError`` names the first bad (batch, head, column). It reads the
            mask back to the host (one device sync per call), so it is off by default: the builders
            in :mod:`masks` already check what they return. The shapes, dtype and ``C`` are always
            checked.
        softcap: logit soft-capping (Gemma 2): a finite float >= 0; when > 0 each score ``s`` (after
            ``softmax_scale``) becomes ``softcap * tanh(s / softcap)`` before the mask and the softmax.
            0 (the default) is off.
        sinks: attention sinks (GPT-OSS): ``None`` or a floating-point tensor ``[Hq]`` on q's device,
            typically an ``nn.Parameter``: one extra logit per query head in every row's softmax
            denominator, with no value: ``p_j = exp(s_j - m) / (sum_k exp(s_k - m) + exp(sinks[h] - m))``.
            Differentiable (computed in float32, float64 for float64 inputs); the LSE includes it, and a
            row that no key may attend gets output 0 and LSE ``sinks[h]``. Its values are not checked
            (that would cost a device sync): give finite ones.

    Returns:
        ``out`` ``[B, Sq, Hq, Dv]`` in the dtype of ``q``, and ``lse`` if ``return_lse``.

    Example::

        >>> import torch, masks
        >>> q = k = v = torch.randn(1, 10, 2, 16)
        >>> mask = masks.causal_document(10, [4, 3, 3])  # [1, 1, 10, 1]
        >>> flashmask_attention(q, k, v, mask, causal=True).shape
        torch.Size([1, 10, 2, 16])
        >>> v = torch.randn(1, 10, 2, 8)  # a value head dim of its own
        >>> flashmask_attention(q, k, v, mask, causal=True).shape
        torch.Size([1, 10, 2, 8])
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(causal, bool):  # a truthy string such as "no" would silently mean True
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    _checks.check_qkv(q, k, v)
    _checks.check_mask(startend_row_indices, q, k, causal, check_values=validate)
    softcap = _checks.softcap_value(softcap)
    _checks.check_sinks(sinks, q)
    if window_size is not None:
        startend_row_indices = windowed_mask(startend_row_indices, _window(window_size), causal, q, k)
    scale = _checks.softmax_scale_value(softmax_scale, q.shape[-1])

    arch = kernel_arch(q, k, v, backend)
    if q.shape[1] == 0 or k.shape[1] == 0:
        # Nothing to compute (Sq = 0, or no key: every row is empty); the reference path returns
        # that result connected to autograd, with zero gradients.
        arch = None

    if arch is not None:
        group = gqa_fold(q, k, startend_row_indices, causal, sinks)
        if group > 1:
            out, lse = _folded_attention(q, k, v, group, scale, bool(deterministic), arch, softcap)
        else:
            out, lse = _cuda.attention(q, k, v, startend_row_indices, bool(causal), scale, bool(deterministic), 0,
                                       arch, softcap, sinks)
    else:
        extra = {} if not softcap and sinks is None else {"softcap": softcap, "sinks": sinks}
        out, lse = reference_attention(q, k, v, startend_row_indices, causal=causal, softmax_scale=scale, **extra)
    return (out, lse) if return_lse else out


# Windowed masks of the most recent calls: every layer with the same window and mask then passes
# the kernels one tensor, whose metadata they compute once.
_windowed = Recent(8)


def windowed_mask(startend_row_indices: Optional[torch.Tensor], window: tuple, causal: bool, q: torch.Tensor,
                  k: torch.Tensor) -> torch.Tensor:
    """The mask intersected with the flash-attn window (the window alone for no mask), built once per
    mask contents, window and shapes while the result stays among the recent ones."""
    def build():
        if startend_row_indices is None:
            # One row per sample: the kernels index the mask by batch (no broadcasting).
            return window_to_startend(window, q.shape[1], k.shape[1], causal, batch_size=q.shape[0],
                                      device=q.device), None
        # The mask itself is kept too, so that its memory is not reused while the key names it.
        return merge_window(startend_row_indices, causal, window, q.shape[1]), startend_row_indices

    if torch.compiler.is_compiling():  # traced: the graph builds it
        return build()[0]
    name = "none" if startend_row_indices is None else tensor_key(startend_row_indices)
    if name is None:
        return build()[0]
    return _windowed.get((name, window, causal, q.shape[0], q.shape[1], k.shape[1], q.device), build)[0]


# At most this many folded query rows (Sq x the GQA group): one query tile of the kernels.
GQA_FOLD_ROWS = 128


def gqa_fold(q: torch.Tensor, k: torch.Tensor, startend_row_indices: Optional[torch.Tensor], causal: bool,
             sinks: Optional[torch.Tensor]) -> int:
    """How many query heads of a GQA group the kernels take as query rows of one head (1: none).

    The heads of a group read the same keys; with neither a mask, nor a causal bound that differs
    between rows (one query row sees every key), nor a sink per head, a row's result does not depend
    on which head or row it is. Short queries (decoding: one row a head) then fill one query tile
    per group that reads the group's K and V once, instead of a tile per head, each with a few rows.
    """
    sq, group = q.shape[1], q.shape[2] // k.shape[2]
    if group == 1 or startend_row_indices is not None or sinks is not None or (causal and sq != 1):
        return 1
    return group if sq * group <= GQA_FOLD_ROWS else 1


def _folded_attention(q, k, v, group, scale, deterministic, arch, softcap):
    """The kernels on q's heads folded into rows: q [B, Sq, Hk * g, D] as [B, Sq * g, Hk, D] (row
    s * g + j is head hk * g + j's row s), unfolded again in the output and the LSE."""
    b, sq, hq, d = q.shape
    hk = k.shape[2]
    folded = q.reshape(b, sq, hk, group, d).transpose(2, 3).reshape(b, sq * group, hk, d)
    out, lse = _cuda.attention(folded, k, v, None, False, scale, deterministic, 0, arch, softcap, None)
    out = out.reshape(b, sq, group, hk, -1).transpose(2, 3).reshape(b, sq, hq, -1)
    lse = lse.reshape(b, hk, sq, group).transpose(2, 3).reshape(b, hq, sq)
    return out, lse


_warned = set()


def kernel_arch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, stacklevel: int = 3) -> Optional[int]:
    """The kernel family ``backend`` runs these inputs on (the ops' ``arch``, 0 = the default one), or
    None for the reference path. A kernel backend that cannot run them raises; ``"auto"`` on CUDA
    tensors warns once per reason (the reference path is O(Sq * Sk) per chunk), ``stacklevel`` frames
    up."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return None
    reason = _checks.kernel_unsupported_reason(q, k, v)
    if reason is None and not _cuda.available():
        reason = _cuda.unavailable_reason()
    if reason is None:
        reason = _cuda.build_unsupported_reason(q, v.shape[-1])
    if reason is None:
        return _cuda.ARCHS.get(backend, 0)
    if backend in _cuda.ARCHS:
        raise RuntimeError(f"backend={backend!r} cannot run: {reason}")
    if q.is_cuda and reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flashmask: using the reference path (slow, O(Sq*Sk) memory) because {reason}",
                      stacklevel=stacklevel)
    return None
