"""The CUDA kernels as torch custom ops (``flashmask::fwd``, ``flashmask::bwd``).

Custom ops with fake implementations let ``torch.compile(fullgraph=True)`` trace through
:func:`flashmask.flashmask_attention` without a graph break; ``register_autograd`` ties the two
together.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

try:
    from flashmask import _C  # built by setup.py when CUDA is available
    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as e:  # pure-Python install
    _C = None
    _IMPORT_ERROR = e


def available() -> bool:
    """True when the extension is built and a CUDA device is visible."""
    return _C is not None and torch.cuda.is_available()


def unavailable_reason() -> str:
    if _C is None:
        return f"the CUDA extension flashmask._C is not built ({_IMPORT_ERROR})"
    return "no CUDA device is available"


def has_backward() -> bool:
    return _C is not None and hasattr(_C, "bwd")


# Read once: torch.compile(fullgraph=True) traces flashmask_attention, and Dynamo cannot call
# into the pybind11 functions themselves.
_HEAD_DIMS: Tuple[int, ...] = tuple(_C.head_dims()) if _C is not None else ()
_DTYPES: Tuple[torch.dtype, ...] = tuple(getattr(torch, n) for n in _C.dtypes()) if _C is not None else ()


def compiled_head_dims() -> Tuple[int, ...]:
    """The head dims the extension was built for (inputs are rounded up to the next one)."""
    return _HEAD_DIMS


def compiled_dtypes() -> Tuple[torch.dtype, ...]:
    return _DTYPES


def build_unsupported_reason(q: torch.Tensor) -> Optional[str]:
    """Why this build of the extension has no kernel for q's head dim or dtype, or None.

    Builds may compile a subset (``FLASHMASK_HEAD_DIMS``, ``FLASHMASK_DTYPES``); a head dim is
    served by the smallest compiled one that holds it.
    """
    dims = compiled_head_dims()
    if not dims or q.shape[-1] > max(dims):
        return (f"this build compiled head dims {dims}, none of which holds {q.shape[-1]} "
                f"(rebuild with FLASHMASK_HEAD_DIMS including a larger one)")
    if q.dtype not in compiled_dtypes():
        return f"this build compiled {compiled_dtypes()}, not {q.dtype} (rebuild with FLASHMASK_DTYPES)"
    return None


@torch.library.custom_op("flashmask::fwd", mutates_args=(), device_types="cuda")
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, startend_row_indices: Optional[torch.Tensor],
        causal: bool, softmax_scale: float, deterministic: bool, num_splits: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    # `deterministic` only matters to the backward; it is an argument so that autograd saves it.
    # num_splits: split-KV CTAs per query tile (0: chosen from the shapes, 1: off).
    out, lse = _C.fwd(q, k, v, startend_row_indices, causal, softmax_scale, num_splits)
    return out, lse


@fwd.register_fake
def _fwd_fake(q, k, v, startend_row_indices, causal, softmax_scale, deterministic, num_splits=0):
    b, sq, hq, _ = q.shape
    return q.new_empty(b, sq, hq, v.shape[-1]), q.new_empty(b, hq, sq, dtype=torch.float32)


@torch.library.custom_op("flashmask::bwd", mutates_args=(), device_types="cuda")
def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, dlse: Optional[torch.Tensor], startend_row_indices: Optional[torch.Tensor],
        causal: bool, softmax_scale: float, deterministic: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _C.bwd(dout, q, k, v, out, lse, dlse, startend_row_indices, causal, softmax_scale, deterministic)
    return dq, dk, dv


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, dlse, startend_row_indices, causal, softmax_scale, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, startend_row_indices, causal, softmax_scale, deterministic, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, startend_row_indices)
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, startend_row_indices = ctx.saved_tensors
    dq, dk, dv = bwd(dout.contiguous(), q, k, v, out, lse, dlse, startend_row_indices, ctx.causal,
                     ctx.softmax_scale, ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)
