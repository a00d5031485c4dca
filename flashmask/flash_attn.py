"""flash-attn's ``flash_attn_func`` and ``flash_attn_varlen_func`` on flashmask, for code written
against flash-attn 2: the same arguments and results, the masks built here.

``flash_attn_varlen_func`` takes packed queries and keys with documents of their own lengths
(``cu_seqlens_q``, ``cu_seqlens_k``), each document's causal triangle and window aligned
bottom-right, as flash-attn does. The mask is built once per ``cu_seqlens`` pair and kept (a few
entries, holding the tensors so that they cannot be freed and their memory reused): the layers of a
step, and their backward, reuse it and the kernels' metadata of it; an in-place change of
``cu_seqlens`` builds it again. Building it reads ``cu_seqlens`` on the host once (a device sync).

Not supported: attention dropout (``dropout_p`` must be 0), ALiBi (``alibi_slopes``) and a paged KV
cache (``block_table``); each raises. ``return_attn_probs=True`` returns ``(out, lse, None)``: the
attention probabilities themselves are never formed. flashmask adds the keyword ``backend``
(:func:`flashmask.flashmask_attention`). This module imports ``torch._dynamo`` (the mask's build
stays out of a ``torch.compile`` graph), so ``import flashmask`` loads it only on first use.

Example::

    >>> import torch
    >>> q = torch.randn(7, 4, 16)  # 7 tokens of 2 documents (4 + 3), 4 heads
    >>> k = v = torch.randn(7, 2, 16)  # GQA: 2 key/value heads
    >>> cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    >>> flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True).shape
    torch.Size([7, 4, 16])
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

import masks
from flashmask._memo import Recent, tensor_key
from flashmask.attention import flashmask_attention
from masks._spec import is_int
from masks.convert import _window

# Masks kept for the most recent cu_seqlens pairs and windows (one per layer type of a model, for a
# step or two).
_masks = Recent(8)


def _unsupported(dropout_p, alibi_slopes, block_table=None) -> None:
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p={dropout_p!r}: flashmask has no attention dropout; pass 0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: flashmask does not add ALiBi biases; pass None")
    if block_table is not None:
        raise NotImplementedError("block_table: flashmask has no paged KV cache; pass None")


def _results(out, lse, return_attn_probs: bool):
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, backend: str = "auto"):
    """flash-attn 2's ``flash_attn_func``: q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hk, D]``, v ``[B, Sk, Hk, Dv]``
    -> out ``[B, Sq, Hq, Dv]``; causal and the window aligned bottom-right when ``Sq != Sk``.

    With ``return_attn_probs``: ``(out, lse [B, Hq, Sq] float32, None)``. Raises for ``dropout_p`` other
    than 0 and for ``alibi_slopes``. ``backend`` as in :func:`flashmask.flashmask_attention`.
    """
    _unsupported(dropout_p, alibi_slopes)
    window = _window(window_size)
    out, lse = flashmask_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   window_size=None if window == (-1, -1) else window, return_lse=True,
                                   deterministic=deterministic, backend=backend, softcap=softcap)
    return _results(out, lse, return_attn_probs)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[torch.Tensor] = None, *,
                           backend: str = "auto"):
    """flash-attn 2's ``flash_attn_varlen_func``: q ``[total_q, Hq, D]``, k ``[total_k, Hk, D]``, v
    ``[total_k, Hk, Dv]`` packed by ``cu_seqlens_q`` / ``cu_seqlens_k`` (int ``[n_docs + 1]``, from 0,
    non-decreasing, ending at ``total_q`` / ``total_k``) -> out ``[total_q, Hq, Dv]``. Document ``i``'s
    queries attend only its keys; causal and the window are aligned bottom-right within each document
    (``masks.from_cu_seqlens_qk``). A query that sees no key gets output 0.

    ``max_seqlen_q`` / ``max_seqlen_k`` must be at least the longest document (flash-attn sizes its
    launch by them; here they are only checked). With ``return_attn_probs``: ``(out, lse [Hq, total_q]
    float32, None)``. Raises for ``dropout_p`` other than 0, ``alibi_slopes`` and ``block_table``.
    ``backend`` as in :func:`flashmask.flashmask_attention`.
    """
    _unsupported(dropout_p, alibi_slopes, block_table)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a tensor [total_tokens, heads, head_dim], got {got}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    window = _window(window_size)
    mask, own_rows, longest = _varlen_mask(cu_seqlens_q, cu_seqlens_k, causal, window, q.shape[0], k.shape[0],
                                           q.device)
    for name, given, need in (("max_seqlen_q", max_seqlen_q, longest[0]), ("max_seqlen_k", max_seqlen_k, longest[1])):
        if not is_int(given) or given < need:
            raise ValueError(f"{name} must be an int >= the longest document ({need} tokens), got {given!r}")
    out, lse = flashmask_attention(q[None], k[None], v[None], mask, causal=causal and not own_rows,
                                   softmax_scale=softmax_scale, return_lse=True, deterministic=deterministic,
                                   backend=backend, softcap=softcap)
    return _results(out[0], lse[0], return_attn_probs)


@torch.compiler.disable  # the build reads cu_seqlens on the host: one graph break, not a trace of it
def _varlen_mask(cu_seqlens_q, cu_seqlens_k, causal: bool, window: tuple, total_q: int, total_k: int, device):
    """(mask, whether it is the non-causal form, (longest query, longest key document)), kept per key."""
    cu_q, cu_k = (torch.as_tensor(c) for c in (cu_seqlens_q, cu_seqlens_k))
    names = tensor_key(cu_q), tensor_key(cu_k)

    def build():
        lq = masks.packed.check_cu_seqlens(cu_q, total_q, "cu_seqlens_q")
        lk = masks.packed.check_cu_seqlens(cu_k, total_k, "cu_seqlens_k")
        longest = (max((b - a for a, b in zip(lq, lq[1:])), default=0),
                   max((b - a for a, b in zip(lk, lk[1:])), default=0))
        # The builders take the values read above (host tensors), not cu_seqlens again (a sync each).
        host_q, host_k = torch.tensor(lq), torch.tensor(lk)
        if total_q == 0 or total_k == 0:  # nothing to mask: no query, or no key for any (output 0)
            mask = None
        elif lq == lk:  # the compact causal form, which the kernels run fastest
            mask = masks.from_cu_seqlens(host_q, causal, device=device)
            if window != (-1, -1):
                mask = masks.merge_window(mask, causal, window, total_q)
        else:
            mask = masks.from_cu_seqlens_qk(host_q, host_k, causal, window, device=device)
        # The tensors themselves, so that their memory is not reused while the key names it.
        return mask, lq != lk, longest, cu_q, cu_k

    if None in names:  # inference tensors: no version counter to tell a change by
        return build()[:3]
    return _masks.get(("varlen", *names, causal, window, total_q, total_k, device), build)[:3]
