"""One rank's attention as explicit forward and backward steps (for the context-parallel autograd).

The all-gather-KV attention needs the forward and the backward of a block of rows as separate
calls, so that the collectives sit between them: the CUDA kernels' ``flashmask::fwd`` /
``flashmask::bwd`` ops, or the reference path (forward under ``no_grad``; backward by
recomputing the block with autograd, which is exact and only used where the kernels cannot run).
The backend is chosen as :func:`flashmask.flashmask_attention` chooses it.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from flashmask import _cuda
from flashmask import attention as _attention
from flashmask.reference import reference_attention


def use_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> Optional[int]:
    """The kernel family to run these inputs on (0 = the default one), or None for the reference
    path: the rule of ``flashmask_attention``."""
    return _attention.kernel_arch(q, k, v, backend, stacklevel=4)  # the caller of allgather_kv_attention


def fwd(q, k, v, mask: Optional[torch.Tensor], scale: float, arch: Optional[int], softcap: float = 0.0,
        sinks: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of a block of rows: ``(out [B, n, Hq, Dv], lse [B, Hq, n])``; ``arch``
    from :func:`use_kernels` (None: the reference path); ``softcap`` and ``sinks`` (``[Hq]`` of these
    query heads) as :func:`flashmask.flashmask_attention`."""
    with torch.no_grad():
        if arch is not None:
            return _cuda.fwd(q, k, v, mask, False, scale, False, 0, arch, softcap, sinks)
        return reference_attention(q, k, v, mask, causal=False, softmax_scale=scale, softcap=softcap, sinks=sinks)


def bwd(dout, q, k, v, out, lse, mask: Optional[torch.Tensor], scale: float, arch: Optional[int],
        deterministic: bool, softcap: float = 0.0, sinks: Optional[torch.Tensor] = None):
    """Gradients ``(dq, dk, dv, dsinks)`` of the block computed by :func:`fwd` (``dsinks`` float32
    ``[Hq]`` of its heads, None without sinks)."""
    if arch is not None:
        with torch.no_grad():
            dq, dk, dv, dsinks = _cuda.bwd(dout.contiguous(), q, k, v, out, lse, None, mask, False, scale,
                                           deterministic, arch, softcap, sinks)
            return dq, dk, dv, None if sinks is None else dsinks
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.enable_grad():
        # In the compute dtype, so that the partial dK/dV of a block are not rounded before the
        # float32 sum over blocks and ranks (the caller casts the results back).
        leaves = [t.detach().to(acc).requires_grad_() for t in (q, k, v)]
        if sinks is not None:
            leaves.append(sinks.detach().to(acc).requires_grad_())
        o, _ = reference_attention(*leaves[:3], mask, causal=False, softmax_scale=scale, softcap=softcap,
                                   sinks=leaves[3] if sinks is not None else None)
        grads = torch.autograd.grad(o, leaves, dout)
        return tuple(grads) if sinks is not None else tuple(grads) + (None,)
