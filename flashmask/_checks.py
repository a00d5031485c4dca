"""Input checks shared by every backend: each raises before any work with a message that names
the offending argument and what was expected."""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from masks.format import validate

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_MAX_HEAD_DIM = 256


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions [B, S, H, D], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same shape [B, Sk, Hk] in their first three dimensions (v's head "
                         f"dim Dv may differ from k's), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has batch {q.shape[0]} but k and v have batch {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share the head dim Dqk: q has head dim {q.shape[3]} but k has head dim "
                         f"{k.shape[3]} (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if q.shape[3] < 1:
        raise ValueError(f"the head dim D of q, k and v must be >= 1, got D={q.shape[3]} (q {tuple(q.shape)})")
    if v.shape[3] < 1:
        raise ValueError(f"the head dim Dv of v must be >= 1, got Dv={v.shape[3]} (v {tuple(v.shape)})")
    hq, hk = q.shape[2], k.shape[2]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number of key/value heads ({hk})")


def _real_scalar(value, expected: str) -> float:
    """``value`` (a real number or a one-element real tensor, not a bool) as a float, else TypeError."""
    is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    is_scalar_tensor = (isinstance(value, torch.Tensor) and value.numel() == 1
                        and value.dtype != torch.bool and not value.is_complex())
    if not (is_real or is_scalar_tensor):
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}")
    return float(value)


def softmax_scale_value(softmax_scale, head_dim: int) -> float:
    """The softmax scale to use: ``1 / sqrt(D)`` for ``None``, else ``softmax_scale`` as a finite float > 0."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    expected = "softmax_scale must be a finite float > 0 (or None for 1 / sqrt(head dim))"
    value = _real_scalar(softmax_scale, expected)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{expected}, got {value!r}")
    return value


def softcap_value(softcap) -> float:
    """``softcap`` as a float: 0 (off) or a finite value > 0 (each score s becomes ``softcap * tanh(s / softcap)``)."""
    expected = "softcap must be a finite float >= 0 (0 turns soft-capping off)"
    value = _real_scalar(softcap, expected)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{expected}, got {value!r}")
    return value


def check_sinks(sinks: Optional[torch.Tensor], q: torch.Tensor) -> None:
    """``sinks``: None, or a floating-point tensor ``[Hq]`` on q's device (its values are not read:
    that would cost a device sync per call)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor [Hq] (one logit per query head) or None, got "
                        f"{type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if tuple(sinks.shape) != (q.shape[2],):
        raise ValueError(f"sinks must have shape [Hq] = [{q.shape[2]}] (one logit per query head of q "
                         f"{tuple(q.shape)}), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")


def check_mask(startend_row_indices: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, causal: bool,
               check_values: bool) -> None:
    if startend_row_indices is None:
        return
    validate(startend_row_indices, causal, seqlen_q=q.shape[1], batch_size=q.shape[0],
             num_heads_q=q.shape[2], num_heads_k=k.shape[2], seqlen_k=k.shape[1],
             check_values=check_values)
    if startend_row_indices.device != q.device:
        raise ValueError(f"startend_row_indices is on {startend_row_indices.device} but q is on {q.device}")


def kernel_unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why the CUDA kernels cannot take these (already checked) inputs, or None if they can."""
    if q.device.type != "cuda":
        return f"the kernels run on CUDA tensors, got {q.device}"
    if q.dtype not in KERNEL_DTYPES:
        return f"the kernels take float16 or bfloat16, got {q.dtype}"
    d, dv = q.shape[-1], v.shape[-1]
    if d > KERNEL_MAX_HEAD_DIM or d % 8 != 0:
        return f"the kernels take head dims that are multiples of 8 up to {KERNEL_MAX_HEAD_DIM}, got {d}"
    if dv > KERNEL_MAX_HEAD_DIM or dv % 8 != 0:
        return (f"the kernels take value head dims that are multiples of 8 up to {KERNEL_MAX_HEAD_DIM}, got Dv={dv} "
                f"(q and k head dim {d})")
    # (FakeTensors under torch.compile have no address; the binding checks it again at run time.)
    check_address = not torch.compiler.is_compiling()
    for name, t in (("q", q), ("k", k), ("v", v)):  # 4-D, by check_qkv; unrolled: this runs on every call
        st, n = t.stride(), t.shape
        if st[3] != 1:
            return f"the kernels need the last dimension of {name} contiguous (stride 1), got stride {st[3]}"
        if check_address and t.data_ptr() % 16:
            return f"the kernels need {name} to start at a 16-byte aligned address"
        if (n[0] > 1 and st[0] % 8) or (n[1] > 1 and st[1] % 8) or (n[2] > 1 and st[2] % 8):
            return f"the kernels need the strides of {name} to be multiples of 8 elements (16-byte rows), got {st}"
    return None
