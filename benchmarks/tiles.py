"""Tile accounting by the kernels' rules: their tile shapes (csrc/sm80/tile_config.h), the bytes of
the per-key-block bounds (csrc/mask/bounds.h) and which (query tile, key block) pairs are skipped,
partial or full (csrc/mask/intervals.h)."""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from benchmarks.flops import canonical_intervals


def fwd_tile(head_dim: int) -> Tuple[int, int]:
    """(BlockM, BlockN) of the forward kernel; mirrors ``fwd_tile`` in csrc/sm80/tile_config.h."""
    if head_dim <= 64:
        return 128, 128
    return 128, 64


def bwd_tile(head_dim: int) -> Tuple[int, int]:
    """(BlockM, BlockN) of the backward kernel; mirrors ``bwd_tile`` in csrc/sm80/tile_config.h."""
    return (64, 128) if head_dim <= 128 else (64, 64)


def bounds_bytes(startend: torch.Tensor, block_n: int) -> int:
    """Bytes of the per-key-block mask bounds (8 int32 per block of ``block_n`` columns, csrc/mask/bounds.h)."""
    b, hm, sk, _ = startend.shape
    return b * hm * math.ceil(sk / block_n) * 8 * 4


def _block_min_max(x: torch.Tensor, block: int):
    """Min and max of ``x [..., S]`` over blocks of ``block`` columns (the last block may be short)."""
    s = x.shape[-1]
    nb = math.ceil(s / block)
    pad = nb * block - s
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)  # repeating the last column is neutral
    x = x.reshape(*x.shape[:-1], nb, block)
    return x.amin(-1), x.amax(-1)


def tile_stats(startend: Optional[torch.Tensor], causal: bool, seqlen_q: int, block_m: int, block_n: int,
               seqlen_k: Optional[int] = None, return_maps: bool = False) -> Dict[str, object]:
    """Classify every (query tile, key block) pair by the kernels' rules (csrc/mask/intervals.h).

    A tile is skipped when the causal triangle or one interval hides it whole (from the per-block
    min/max); it is partial when the causal diagonal or an interval may touch it. Returns counts
    ``tiles``, ``live`` (not skipped), ``partial`` and ``live_fraction``, summed over (b, mask head);
    ``return_maps`` adds the bool maps ``live_map`` and ``partial_map`` ``[B, Hm, n_query_tiles, n_key_blocks]``,
    and ``cut_map``: the tiles the column intervals alone may touch (the causal diagonal left out).
    """
    if startend is None:  # nothing masked beyond causal: LTS = Sq (and UTE = 0 when non-causal)
        sk = int(seqlen_k)
        startend = torch.zeros(1, 1, sk, 1 if causal else 2, dtype=torch.int32)
        startend[..., 0] = int(seqlen_q)
    sk = startend.shape[2]
    sq = int(seqlen_q)
    lts, lte, uts, ute = canonical_intervals(startend, causal, sq)
    nm, nn = math.ceil(sq / block_m), math.ceil(sk / block_n)
    r0 = (torch.arange(nm, device=startend.device) * block_m).view(nm, 1)
    r1 = torch.clamp(r0 + block_m, max=sq)
    c0 = (torch.arange(nn, device=startend.device) * block_n).view(1, nn)
    c1 = torch.clamp(c0 + block_n, max=sk)
    off = sk - sq

    def mm(t):
        lo, hi = _block_min_max(t, block_n)  # [B, Hm, nn]
        return lo.unsqueeze(-2), hi.unsqueeze(-2)  # [B, Hm, 1, nn]

    (lts_lo, lts_hi), (lte_lo, lte_hi) = mm(lts), mm(lte)
    (uts_lo, uts_hi), (ute_lo, ute_hi) = mm(uts), mm(ute)
    full = ((r0 >= lts_hi) & (r1 <= lte_lo)) | ((r0 >= uts_hi) & (r1 <= ute_lo))
    cut = ((r1 > lts_lo) & (r0 < lte_hi)) | ((r1 > uts_lo) & (r0 < ute_hi))
    part = cut
    if causal:  # key j visible from row j - off on: the block is hidden if its first key is past the last row
        full = full | (c0 > (r1 - 1 + off))
        part = part | ((c1 - 1) > (r0 + off))
    live = ~full
    part = live & part
    tiles = live.numel()
    n_live = int(live.sum())
    out = {"tiles": tiles, "live": n_live, "partial": int(part.sum()), "live_fraction": n_live / max(tiles, 1)}
    if return_maps:
        out["live_map"], out["partial_map"], out["cut_map"] = live, part, cut
    return out
