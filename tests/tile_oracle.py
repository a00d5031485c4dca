"""What each tile of the (query rows x key blocks) grid holds, from the dense mask: the oracle the
block-walk tests (tests/cpu/test_dq_turns.py, test_key_block_walk.py) hold the kernels' walks to."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from masks.format import to_dense


@dataclass
class Tiles:
    """[slice, query tile, row group, key block] bools, a slice per (batch, mask head)."""
    seen: torch.Tensor       # some pair attends
    edges: torch.Tensor      # some pair lies past the last key or above the causal bound
    intervals: torch.Tensor  # some pair within both is masked by the column intervals


def tiles_of(mask: torch.Tensor, causal: bool, sq: int, block_m: int, block_n: int, rows: int | None = None) -> Tiles:
    """The tiles of ``mask`` ([B, Hm, Sk, C]) cut into ``block_m`` query rows (in groups of ``rows``,
    default all) by ``block_n`` keys; rows past Sq count in none."""
    b, hm, sk, _ = mask.shape
    rows = rows or block_m
    m_tiles, n_blocks = -(-sq // block_m), -(-sk // block_n)
    r = torch.arange(m_tiles * block_m).view(-1, 1)
    col = torch.arange(n_blocks * block_n).view(1, -1)
    real_row, in_keys = r < sq, col < sk
    causal_ok = (col <= r + sk - sq) if causal else torch.ones_like(in_keys)
    pad = torch.zeros(b * hm, m_tiles * block_m, n_blocks * block_n, dtype=torch.bool)
    pad[:, :sq, :sk] = to_dense(mask, causal, seqlen_q=sq, seqlen_k=sk).reshape(b * hm, sq, sk)

    def by_tile(x):  # [..., rows, cols] -> [..., tile, group, block]: any pair in each
        return x.unflatten(-2, (m_tiles, block_m // rows, rows)).unflatten(-1, (n_blocks, block_n)).any(-1).any(-2)

    edges = by_tile(real_row & ~(in_keys & causal_ok)).expand(b * hm, -1, -1, -1)
    return Tiles(by_tile(pad), edges, by_tile(real_row & in_keys & causal_ok & ~pad))
