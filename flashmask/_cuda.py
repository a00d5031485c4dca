"""The CUDA kernels as torch custom ops (``flashmask::fwd``, ``flashmask::bwd``).

Custom ops with fake implementations let ``torch.compile(fullgraph=True)`` trace through
:func:`flashmask.flashmask_attention` without a graph break; ``register_autograd`` ties the two
together. Plain eager calls take :func:`attention`'s shorter path to the same kernels.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

# import_module rather than `from flashmask import _C`: when the extension is absent, the latter
# fails with "cannot import name '_C' from partially initialized module", which reads like a
# circular-import bug. unavailable_reason() says what actually happened.
try:
    _C = importlib.import_module("flashmask._C")  # built by setup.py when CUDA is available
    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as e:  # pure-Python install, or a build that no longer loads
    _C = None
    _IMPORT_ERROR = e

BUILD_COMMAND = ("pip install nvidia-cutlass==4.2.0.0 ninja && "
                 "FLASHMASK_BUILD_CUDA=1 pip install --no-build-isolation -e .")


def available() -> bool:
    """True when the extension is built and a CUDA device is visible."""
    return _C is not None and torch.cuda.is_available()


def unavailable_reason() -> str:
    """Why the kernels cannot run here, in words a user can act on (why, and how to build them)."""
    if _C is None:
        return _not_built_reason()
    return "no CUDA device is available (torch.cuda.is_available() is False)"


@functools.lru_cache(maxsize=None)
def _not_built_reason() -> str:
    how = f"build them from the flashmask checkout with: {BUILD_COMMAND} (README, 'GPU install')"
    if importlib.util.find_spec("flashmask._C") is not None:  # a file exists but does not load
        return (f"the CUDA kernels (flashmask._C) were built but do not load ({_IMPORT_ERROR}); this usually "
                f"means torch changed since they were built: {how}")
    if torch.version.cuda is None:
        why = (f"the installed torch {torch.__version__} is a CPU-only build (torch.version.cuda is None); "
               "install a CUDA build of torch first, then")
    else:
        try:
            from torch.utils.cpp_extension import CUDA_HOME
        except Exception:  # noqa: BLE001 - only a diagnosis
            CUDA_HOME = None
        if CUDA_HOME is None:
            why = "no CUDA toolkit was found (no nvcc on PATH, CUDA_HOME unset); install one, then"
        else:
            why = ("the install skipped them (FLASHMASK_BUILD_CUDA=0, or pip's build isolation hid the "
                   "installed torch: build with --no-build-isolation);")
    return f"the CUDA kernels (flashmask._C) were not built: {why} {how}"


# Read once: torch.compile(fullgraph=True) traces flashmask_attention, and Dynamo cannot call
# into the pybind11 functions themselves.
_HEAD_DIMS: Tuple[int, ...] = tuple(_C.head_dims()) if _C is not None else ()
_DTYPES: Tuple[torch.dtype, ...] = tuple(getattr(torch, n) for n in _C.dtypes()) if _C is not None else ()
_HEAD_DIM_PAIRS: Tuple[Tuple[int, int], ...] = (
    tuple((int(d), int(dv)) for d, dv in _C.head_dim_pairs()) if _C is not None else ())
_CUDA_TARGETS: Tuple[str, ...] = tuple(_C.cuda_targets()) if _C is not None else ()


def compiled_head_dims() -> Tuple[int, ...]:
    """The head dims the extension was built for with equal q/k and v head dims (inputs are rounded
    up to the next one)."""
    return _HEAD_DIMS


def compiled_head_dim_pairs() -> Tuple[Tuple[int, int], ...]:
    """Every ``(head_dim, head_dim_v)`` pair the extension was built for, the equal ones included. A
    call with q/k head dim ``Dqk`` and v head dim ``Dv`` runs on the smallest pair that holds both
    (``Dqk <= head_dim`` and ``Dv <= head_dim_v``)."""
    return _HEAD_DIM_PAIRS


def compiled_dtypes() -> Tuple[torch.dtype, ...]:
    return _DTYPES


# Kernel architecture families: 80 = mma.sync kernels (any GPU from sm_80), 90 = wgmma/TMA kernels
# (sm_90a). ``backend="sm80"`` / ``"sm90"`` or the environment variable FLASHMASK_ARCH=80|90 (read once per
# process, at the first kernel selection) force one.
ARCHS = {"cuda": 0, "sm80": 80, "sm90": 90}


def compiled_archs(head_dim: int, dtype: torch.dtype, head_dim_v: Optional[int] = None) -> Tuple[int, ...]:
    """The architecture families this build compiled for (head dim, dtype, v head dim; None: equal)."""
    if _C is None:
        return ()
    dv = head_dim if head_dim_v is None else head_dim_v
    return tuple(_C.archs(head_dim, str(dtype).replace("torch.", ""), dv))


def device_archs(head_dim: int, dtype: torch.dtype, cc: int, head_dim_v: Optional[int] = None) -> Tuple[int, ...]:
    """Those of :func:`compiled_archs` whose kernels (forward and backward) run on a device of
    compute capability ``cc`` (major * 10 + minor). A build for sm_80 and sm_90 compiles the SM80
    kernels for sm_80 only, the SM90 kernels serving every head dim on sm_90 (``FLASHMASK_ARCHS=90``
    keeps them there); a call forced onto a family without them runs on the newest family that has
    them. Exact pairs only: (160, 128) has no kernel of its own and gives ()."""
    if _C is None:
        return ()
    dv = head_dim if head_dim_v is None else head_dim_v
    return tuple(_C.device_archs(head_dim, str(dtype).replace("torch.", ""), cc, dv))


def selected_arch(q: torch.Tensor, arch: int = 0, slot: str = "fwd", head_dim_v: Optional[int] = None) -> int:
    """The architecture family a call with q (and v of head dim ``head_dim_v``, default q's) would run
    on (raises like the call would).

    slot: "fwd", "bwd" or "bwd_deterministic". A slot a family lacks runs on an older one.
    """
    if slot not in ("fwd", "bwd", "bwd_deterministic"):
        raise ValueError(f"slot must be 'fwd', 'bwd' or 'bwd_deterministic', got {slot!r}")
    major, minor = torch.cuda.get_device_capability(q.device)
    dv = q.shape[-1] if head_dim_v is None else head_dim_v
    return _C.selected_arch(q.shape[-1], str(q.dtype).replace("torch.", ""), major * 10 + minor, arch, slot, dv)


def cuda_targets() -> Tuple[str, ...]:
    """The device code the extension carries, e.g. ``("sm_80", "sm_90a")`` (FLASHMASK_ARCHS)."""
    return _CUDA_TARGETS


def device_code_reason(cc: int, name: str = "") -> Optional[str]:
    """Why the build cannot run on a GPU of compute capability ``cc`` (major * 10 + minor), or None:
    sm_XY code runs on X.Y and the later minors of major X, sm_XYa code on X.Y alone."""
    if _C is None or _C.has_code_for(cc):
        return None
    gpu = f"compute capability {cc // 10}.{cc % 10}" + (f" ({name})" if name else "")
    hint = (f"rebuild with FLASHMASK_ARCHS including {cc}" if 80 <= cc < 100
            else "flashmask's kernels run on compute capability 8.x and 9.0")
    return f"this build has no device code for {gpu}: it carries {', '.join(_CUDA_TARGETS)}; {hint}"


_device_reasons: Dict[int, Optional[str]] = {}  # device index -> device_code_reason of that GPU


def build_unsupported_reason(q: torch.Tensor, head_dim_v: Optional[int] = None) -> Optional[str]:
    """Why this build of the extension has no kernel for q's head dim, v's (``head_dim_v``, default
    q's), the dtype or q's GPU (:func:`device_code_reason`), or None.

    Builds may compile a subset (``FLASHMASK_HEAD_DIMS``, ``FLASHMASK_DTYPES``); a pair of head dims
    is served by the smallest compiled pair that holds it (:func:`compiled_head_dim_pairs`).
    """
    d = q.shape[-1]
    dv = d if head_dim_v is None else head_dim_v
    dims = compiled_head_dims()
    pairs = compiled_head_dim_pairs()
    if not any(d <= b and dv <= bv for b, bv in pairs):  # the equal head dims are pairs too
        if dv == d:
            return (f"this build compiled head dims {dims}, none of which holds {d} "
                    f"(rebuild with FLASHMASK_HEAD_DIMS including a larger one)")
        return (f"this build compiled the (head_dim, head_dim_v) pairs {pairs}, none of which holds q and k head "
                f"dim {d} with v head dim {dv} (rebuild with FLASHMASK_HEAD_DIMS including one that holds it)")
    if q.dtype not in compiled_dtypes():
        return f"this build compiled {compiled_dtypes()}, not {q.dtype} (rebuild with FLASHMASK_DTYPES)"
    # Eager calls only: under torch.compile the binding's own check raises the same reason.
    if _C is not None and q.is_cuda and not torch.compiler.is_compiling():
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        if index not in _device_reasons:
            major, minor = torch.cuda.get_device_capability(index)
            _device_reasons[index] = device_code_reason(major * 10 + minor, torch.cuda.get_device_name(index))
        return _device_reasons[index]
    return None


# The binding caches each mask's metadata (per-key-block bounds, the forward's tile order) keyed
# on the mask tensor and its version counter, so that the layers of a step and their backward
# reuse it (csrc/api/mask_cache.h). Environment variable FLASHMASK_MASK_CACHE=0 turns it off (read once
# per process, at the first call with a mask).
# Call these outside torch.compile-traced code: Dynamo cannot trace into the pybind11 functions (no
# torch.compiler.disable decorator here: it would import torch._dynamo along with flashmask).
def mask_cache_stats() -> Tuple[int, int]:
    """(hits, misses) of the mask metadata cache since the last :func:`clear_mask_cache`; calls that
    skip it (no mask, FLASHMASK_MASK_CACHE=0, CUDA graph capture, inference tensors) count as neither."""
    if _C is None or not hasattr(_C, "mask_cache_stats"):
        return (0, 0)
    hits, misses = _C.mask_cache_stats()
    return int(hits), int(misses)


def clear_mask_cache() -> None:
    """Drop every cached mask's metadata (its GPU memory returns to the caching allocator) and zero
    the counts of :func:`mask_cache_stats`."""
    if _C is not None and hasattr(_C, "mask_cache_clear"):
        _C.mask_cache_clear()


@contextlib.contextmanager
def _overrides(head_group: Optional[int] = None, decode_warp: Optional[int] = None,
               mask_cache: Optional[int] = None) -> Iterator[None]:
    """Tests only: pin choices the kernels' binding otherwise makes itself, for the calls inside the
    block; None leaves a choice as it is, 0 (head_group) or -1 (the others) gives it back to the
    library. head_group: heads interleaved per launch (rounded down to a divisor of Hq);
    decode_warp: 0 / 1 runs the SM90 forward without / with its decode warp where that build
    exists; mask_cache: 0 / 1 turns the mask metadata cache off / on. Process-wide, not per
    thread; the previous values come back on exit."""
    if _C is None:
        raise RuntimeError(unavailable_reason())
    previous = _C._set_overrides()  # every choice the library's for a moment; returns those pinned
    try:
        wanted = (head_group, decode_warp, mask_cache)
        _C._set_overrides(*(p if w is None else w for p, w in zip(previous, wanted)))
        yield
    finally:
        _C._set_overrides(*previous)


@torch.library.custom_op("flashmask::fwd", mutates_args=(), device_types="cuda")
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, startend_row_indices: Optional[torch.Tensor],
        causal: bool, softmax_scale: float, deterministic: bool, num_splits: int = 0,
        arch: int = 0, softcap: float = 0.0,
        sinks: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    # `deterministic` only matters to the backward; it is an argument so that autograd saves it.
    # num_splits: split-KV CTAs per query tile (0: chosen from the shapes, 1: off).
    # arch: the kernel family (0: the newest the device runs, or FLASHMASK_ARCH; 80; 90).
    # softcap and sinks ([Hq], float32 in the kernel): flashmask_attention's.
    out, lse = _C.fwd(q, k, v, startend_row_indices, causal, softmax_scale, num_splits, arch, softcap, sinks)
    return out, lse


@fwd.register_fake
def _fwd_fake(q, k, v, startend_row_indices, causal, softmax_scale, deterministic, num_splits=0, arch=0,
              softcap=0.0, sinks=None):
    b, sq, hq, _ = q.shape
    return q.new_empty(b, sq, hq, v.shape[-1]), q.new_empty(b, hq, sq, dtype=torch.float32)


@torch.library.custom_op("flashmask::bwd", mutates_args=(), device_types="cuda")
def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, dlse: Optional[torch.Tensor], startend_row_indices: Optional[torch.Tensor],
        causal: bool, softmax_scale: float, deterministic: bool,
        arch: int = 0, softcap: float = 0.0,
        sinks: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsinks)``; dsinks is float32 ``[Hq]``, or empty ``[0]`` without sinks (a custom op
    cannot return None)."""
    # The LSE holds the sinks: the kernels' P needs nothing more of them.
    dq, dk, dv, dsum = _C.bwd(dout, q, k, v, out, lse, dlse, startend_row_indices, causal, softmax_scale,
                              deterministic, arch, softcap)
    return dq, dk, dv, sink_grad(lse, dsum, sinks)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, dlse, startend_row_indices, causal, softmax_scale, deterministic, arch=0,
              softcap=0.0, sinks=None):
    dsinks = q.new_empty(0 if sinks is None else q.shape[2], dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def sink_grad(lse: torch.Tensor, dsum: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """The gradient of the sink logits, float32 ``[Hq]`` (empty ``[0]`` without sinks), from the
    forward's LSE and the backward's row term ``dsum = rowsum(dO * O) - dlse`` (``[B, Hq, Sq]``, which
    the kernels compute anyway): each row gives its sink the weight ``p_sink = exp(sink_h - lse)``, so
    ``dsinks[h] = -sum over batch and rows of p_sink * dsum``."""
    if sinks is None:
        return lse.new_empty(0, dtype=torch.float32)
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse.float())  # [B, Hq, Sq]
    return -(p_sink * dsum.float()).sum((0, 2))


def _setup_context(ctx, inputs, output):
    q, k, v, startend_row_indices, causal, softmax_scale, deterministic, _, arch, softcap, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, startend_row_indices, sinks)
    ctx.causal, ctx.softmax_scale, ctx.deterministic, ctx.arch = causal, softmax_scale, deterministic, arch
    ctx.softcap = softcap
    # An unused LSE (return_lse=False, the common case) then reaches the backward as None rather
    # than as a zeroed [B, Hq, Sq] tensor allocated, filled and read on every step.
    ctx.set_materialize_grads(False)


def _grads(ctx, dout, dlse, bwd_op):
    q, k, v, out, lse, startend_row_indices, sinks = ctx.saved_tensors
    if dout is None:  # only the LSE reached the loss
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = bwd_op(dout.contiguous(), q, k, v, out, lse, dlse, startend_row_indices, ctx.causal,
                                ctx.softmax_scale, ctx.deterministic, ctx.arch, ctx.softcap, sinks)
    dsinks = None if sinks is None else dsinks.to(sinks.dtype)
    return dq, dk, dv, None, None, None, None, None, None, None, dsinks


def _eager_bwd(dout, q, k, v, out, lse, dlse, startend_row_indices, causal, softmax_scale, deterministic, arch,
               softcap, sinks):
    dq, dk, dv, dsum = _C.bwd(dout, q, k, v, out, lse, dlse, startend_row_indices, causal, softmax_scale,
                              deterministic, arch, softcap)
    return dq, dk, dv, sink_grad(lse, dsum, sinks)


fwd.register_autograd(functools.partial(_grads, bwd_op=bwd), setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom ops' autograd without their dispatch: the same kernels, context and gradients."""

    # forward takes ctx itself: with a separate setup_context, Function.apply binds the arguments
    # to forward's signature through inspect on every call (about 20 us of host time on the H100
    # machine, more than the extension call's 16 us).
    @staticmethod
    def forward(ctx, q, k, v, startend_row_indices, causal, softmax_scale, deterministic, num_splits, arch, softcap,
                sinks):
        out, lse = _C.fwd(q, k, v, startend_row_indices, causal, softmax_scale, num_splits, arch, softcap, sinks)
        _setup_context(ctx, (q, k, v, startend_row_indices, causal, softmax_scale, deterministic, num_splits, arch,
                             softcap, sinks), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        grads = _grads(ctx, dout, dlse, _eager_bwd)
        return _without_double_backward(grads) if torch.is_grad_enabled() else grads


def _without_double_backward(grads):
    # create_graph=True: gradients whose own backward raises. Left as they are they would enter the
    # next derivative as constants, and a gradient penalty would silently miss the attention.
    tensors = [g for g in grads if g is not None]
    delayed = torch._C._functions.DelayedError(
        b"flashmask: the attention kernels have no double backward (create_graph=True); "
        b"use backend='reference' for higher derivatives", len(tensors))
    wrapped = iter(delayed(*[t.detach().requires_grad_() for t in tensors]))
    return tuple(None if g is None else next(wrapped) for g in grads)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # a sinks parameter is a plain tensor to the kernels


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, startend_row_indices: Optional[torch.Tensor],
              causal: bool, softmax_scale: float, deterministic: bool, num_splits: int = 0,
              arch: int = 0, softcap: float = 0.0,
              sinks: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the kernels, differentiable; the arguments are those of the ``fwd`` op.

    Plain eager calls skip the custom ops' dispatch and autograd wrapper, whose host time can exceed
    a short kernel's; calls with nothing to differentiate skip the autograd.Function too. Under
    torch.compile, a dispatch mode (FakeTensorMode, ...) or tensor subclasses the custom ops run, so
    that tracing sees them.
    """
    args = (q, k, v, startend_row_indices, causal, softmax_scale, deterministic, num_splits, arch, softcap, sinks)
    if (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or any(type(t) not in _PLAIN_TENSORS for t in (q, k, v, startend_row_indices, sinks) if t is not None)):
        return fwd(*args)
    needs_grad = q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    if not (torch.is_grad_enabled() and needs_grad):
        # Nothing to differentiate: Function.apply would only add host time to a short call.
        return _C.fwd(q, k, v, startend_row_indices, causal, softmax_scale, num_splits, arch, softcap, sinks)
    return _EagerAttention.apply(*args)
