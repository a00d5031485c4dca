"""Dense masks for SDPA, bool or additive, and whether one (with an eager attention's weights) fits
in the free memory."""
from __future__ import annotations

from typing import Tuple

import torch

from benchmarks import cuda_memory


def dense_mask_bytes(batch: int, mask_heads: int, seqlen_q: int, seqlen_k: int) -> int:
    return batch * mask_heads * seqlen_q * seqlen_k


def dense_fit(batch: int, mask_heads: int, seqlen_q: int, seqlen_k: int, dtype: torch.dtype,
              device: torch.device, fraction: float = 0.5, additive: bool = False) -> Tuple[bool, str]:
    """Whether a dense mask fits in ``fraction`` of the free memory. Returns ``(fits, note)``.

    ``additive=False``: a bool mask plus the additive mask in ``dtype`` that SDPA makes of it on each
    call. ``additive=True``: one additive mask in ``dtype`` (given to SDPA as is).
    """
    n = dense_mask_bytes(batch, mask_heads, seqlen_q, seqlen_k)
    size = torch.empty((), dtype=dtype).element_size()
    if additive:
        need = n * size
        note = f"S^2 mask = {need / 1e9:.1f} GB additive {str(dtype).replace('torch.', '')}"
    else:
        need = n * (1 + size)
        note = f"S^2 mask = {n / 1e9:.1f} GB bool + {need / 1e9 - n / 1e9:.1f} GB additive mask per call"
    free = cuda_memory.free_memory_bytes(device)
    note += "" if free is None else f", {free / 1e9:.1f} GB free"
    if free is not None and need > fraction * free:
        return False, f"does not fit ({note})"
    return True, note


def eager_fit(batch: int, heads: int, masks: int, seqlen_q: int, seqlen_k: int, dtype: torch.dtype,
              device: torch.device, fraction: float = 0.5) -> Tuple[bool, str]:
    """Whether an eager attention (the scores materialised) fits in ``fraction`` of the free memory:
    ``masks`` additive ``[B, 1, Sq, Sk]`` masks in ``dtype``, plus the attention weights of one layer
    counted as two ``[B, heads, Sq, Sk]`` tensors in ``dtype`` (the scores and the probabilities): a
    lower bound, since a training step holds more of them. Returns ``(fits, note)``."""
    size = torch.empty((), dtype=dtype).element_size()
    n = dense_mask_bytes(batch, 1, seqlen_q, seqlen_k)
    mask_bytes, weights = masks * n * size, 2 * heads * n * size
    note = (f"{masks} S^2 additive mask(s) = {mask_bytes / 1e9:.1f} GB + one layer's attention weights >= "
            f"{weights / 1e9:.1f} GB")
    free = cuda_memory.free_memory_bytes(device)
    note += "" if free is None else f", {free / 1e9:.1f} GB free"
    if free is not None and mask_bytes + weights > fraction * free:
        return False, f"does not fit ({note})"
    return True, note


def dense_mask(startend: torch.Tensor, causal: bool, seqlen_q: int, chunk_bytes: int = 1 << 27,
               dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """The dense mask ``[B, Hm, Sq, Sk]``, expanded with ``masks.format.to_dense`` a chunk of rows at
    a time on the mask's device. ``dtype=torch.bool``: True = attend; a float dtype: an additive
    mask, 0 where attended and the dtype's lowest value elsewhere (as transformers makes them)."""
    from masks.format import to_dense
    b, hm, sk, _ = startend.shape
    out = torch.empty(b, hm, seqlen_q, sk, dtype=dtype, device=startend.device)
    rows = max(1, chunk_bytes // max(1, b * hm * sk))
    for r0 in range(0, seqlen_q, rows):
        r1 = min(seqlen_q, r0 + rows)
        allowed = to_dense(startend, causal, seqlen_q=seqlen_q, rows=slice(r0, r1))
        if dtype == torch.bool:
            out[:, :, r0:r1] = allowed
        else:
            out[:, :, r0:r1].zero_().masked_fill_(~allowed, torch.finfo(dtype).min)
    return out
