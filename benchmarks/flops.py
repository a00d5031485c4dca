"""FLOP accounting on unmasked pairs (fwd = 2*B*H*(Dqk + Dv)*pairs, i.e. 4*B*H*D*pairs with equal head
dims; bwd = 2.5x, fwd+bwd = 3.5x).

The pair counter works from the column intervals in O(Sk) and does not use ``masks/format.py``, so
that the tests can check it against ``masks.format.to_dense``.
"""
from __future__ import annotations

from typing import Optional

import torch

# FLOPs of a mode relative to the forward's 2 * B * H * (Dqk + Dv) * pairs.
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


def check_layout(startend: torch.Tensor, causal: bool) -> int:
    """C, the vectors per column, after checking the shape and the layout against ``causal``."""
    if startend.dim() != 4:
        raise ValueError(f"startend_row_indices must be [B, Hm, Sk, C], got shape {tuple(startend.shape)}")
    c = startend.shape[-1]
    allowed = (1, 2) if causal else (2, 4)
    if c not in allowed:
        raise ValueError(f"causal={bool(causal)} needs C in {allowed}, got C={c}")
    return c


def canonical_intervals(startend: torch.Tensor, causal: bool, seqlen_q: int):
    """The two masked row intervals of every key column, ``(lts, lte, uts, ute)`` int64
    ``[B, Hm, Sk]`` clamped to ``[0, Sq]``: rows in ``[lts, lte)`` and in ``[uts, ute)`` are masked
    (absent vectors become neutral: ``lte = Sq``, ``uts = ute = 0``). See docs/format.md."""
    c = check_layout(startend, causal)
    x = startend.long().clamp(0, int(seqlen_q))
    cols = x.unbind(-1)
    zero = torch.zeros_like(cols[0])
    last = torch.full_like(cols[0], int(seqlen_q))
    if causal:
        return cols[0], (cols[1] if c == 2 else last), zero, zero
    if c == 2:
        return cols[0], last, zero, cols[1]
    return cols[0], cols[1], cols[2], cols[3]


def _len(a, b):
    return (b - a).clamp_min(0)


def count_pairs(startend: Optional[torch.Tensor], causal: bool, seqlen_q: Optional[int] = None,
                seqlen_k: Optional[int] = None) -> torch.Tensor:
    """Number of attended (query, key) pairs of every (batch, mask head): int64 ``[B, Hm]``.

    O(Sk): column j has up to three masked row intervals (the causal one ``[0, j - (Sk - Sq))``,
    ``[LTS, LTE)`` and ``[UTS, UTE)``); the size of their union comes by inclusion-exclusion,
    since the intersection of intervals is an interval. ``startend=None``: only ``causal``.
    """
    if startend is None:
        if seqlen_k is None:
            raise ValueError("count_pairs needs seqlen_k when startend is None")
        sk = int(seqlen_k)
        sq = sk if seqlen_q is None else int(seqlen_q)
        device = None
        lts = torch.full((1, 1, sk), sq, dtype=torch.long)
        lte, uts, ute = lts.clone(), torch.zeros_like(lts), torch.zeros_like(lts)
    else:
        sk = startend.shape[2]
        if seqlen_k is not None and int(seqlen_k) != sk:
            raise ValueError(f"seqlen_k={seqlen_k} but startend has Sk={sk}")
        sq = sk if seqlen_q is None else int(seqlen_q)
        device = startend.device
        lts, lte, uts, ute = canonical_intervals(startend, causal, sq)
    j = torch.arange(sk, device=device, dtype=torch.long)
    cs = torch.zeros_like(j)
    # Causal (bottom-right aligned): query i sees key j iff j <= i + Sk - Sq, so rows [0, j - Sk + Sq) are masked.
    ce = (j - (sk - sq)).clamp(0, sq) if causal else torch.zeros_like(j)
    cs, ce = cs.view(1, 1, sk), ce.view(1, 1, sk)
    a = _len(cs, ce)
    l_ = _len(lts, lte)
    u = _len(uts, ute)
    al = _len(torch.maximum(cs, lts), torch.minimum(ce, lte))
    au = _len(torch.maximum(cs, uts), torch.minimum(ce, ute))
    lu = _len(torch.maximum(lts, uts), torch.minimum(lte, ute))
    alu = _len(torch.maximum(torch.maximum(cs, lts), uts), torch.minimum(torch.minimum(ce, lte), ute))
    masked = a + l_ + u - al - au - lu + alu
    return (sq - masked).sum(-1)


def total_pairs(startend: Optional[torch.Tensor], causal: bool, *, batch: int, heads: int, seqlen_q: int,
                seqlen_k: int) -> int:
    """Attended pairs summed over the batch and the query heads (the FLOP count's ``B*H*pairs``)."""
    p = count_pairs(startend, causal, seqlen_q, seqlen_k)  # [Bm, Hm]
    bm, hm = p.shape
    if heads % hm:
        raise ValueError(f"{hm} mask heads do not divide {heads} query heads")
    per_sample = p.sum(1) * (heads // hm)
    if bm == batch:
        return int(per_sample.sum())
    if bm == 1:
        return int(per_sample.sum()) * batch
    raise ValueError(f"mask batch {bm} does not match batch {batch}")


def attn_flops(pairs: int, head_dim: int, mode: str, head_dim_v: Optional[int] = None) -> float:
    """FLOPs on unmasked pairs (already summed over B and H): fwd = 2 * (Dqk + Dv) * pairs (QK^T
    and PV; 4 * D * pairs when ``head_dim_v`` is None or equal), bwd = 2.5 x fwd, fwd+bwd = 3.5 x fwd."""
    dv = head_dim if head_dim_v is None else head_dim_v
    return 2.0 * (head_dim + dv) * pairs * FLOP_FACTOR[mode]


def is_plain(startend: Optional[torch.Tensor], causal: bool, seqlen_q: int) -> bool:
    """True when the mask hides nothing beyond ``causal`` (expressible as SDPA ``is_causal``)."""
    if startend is None:
        return True
    sk = startend.shape[2]
    plain = int(count_pairs(None, causal, seqlen_q, sk).item())
    return bool((count_pairs(startend, causal, seqlen_q) == plain).all())
