"""scripts/tile_efficiency.py: tile counts against a direct count, one tile at a time."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import tile_efficiency  # noqa: E402
from attn_helpers import random_startend  # noqa: E402
from masks.format import to_dense  # noqa: E402
import masks  # noqa: E402


def direct_counts(mask, causal, block_m, block_n):
    dense = to_dense(mask, causal)
    counts = dict(visible=0, computed=0, tiles=0, partial=0)
    s = dense.shape[-1]
    for bh in dense.flatten(0, 1):
        for r in range(0, s, block_m):
            for c in range(0, s, block_n):
                tile = bh[r:r + block_m, c:c + block_n]
                seen = int(tile.sum())
                if seen:
                    counts["visible"] += seen
                    counts["computed"] += tile.numel()
                    counts["tiles"] += 1
                    counts["partial"] += seen < tile.numel()
    return counts


def direct_leading(mask, causal, block_m, block_n, wg_rows):
    """Pairs computed when each warpgroup walks the tile's visited blocks downwards from the last
    block its own rows see."""
    dense = to_dense(mask, causal)
    s = dense.shape[-1]
    computed = 0
    for bh in dense.flatten(0, 1):
        for r in range(0, s, block_m):
            visited = [c for c in range(0, s, block_n) if bh[r:r + block_m, c:c + block_n].any()]
            for w in range(r, min(r + block_m, s), wg_rows):
                rows = bh[w:min(w + wg_rows, r + block_m, s)]
                seen = [c for c in visited if rows[:, c:c + block_n].any()]
                if seen:
                    computed += sum(rows[:, c:c + block_n].numel() for c in visited if c <= max(seen))
    return computed


def test_causal_by_hand():
    # 256 rows in 128 x 128 tiles: two diagonal tiles and one full one below them.
    got = tile_efficiency.tile_counts(masks.causal(256), True, 128, 128)
    assert got == dict(visible=256 * 257 // 2, computed=3 * 128 * 128, tiles=3, partial=2)


@pytest.mark.parametrize("causal,c", [(True, 1), (True, 2), (False, 2), (False, 4)])
@pytest.mark.parametrize("block_m,block_n", [(64, 128), (192, 128), (48, 32)])
def test_random_masks_odd_sizes(causal, c, block_m, block_n):
    torch.manual_seed(block_m * 7 + c)
    mask = random_startend(2, 2, 203, 203, causal, c)
    # Chunks smaller than the sequence, so that several chunks and a short last tile are counted.
    got = tile_efficiency.tile_counts(mask, causal, block_m, block_n, chunk_rows=100)
    assert got == direct_counts(mask, causal, block_m, block_n)
    wg_rows = block_m // 3 if block_m % 3 == 0 else block_m // 2
    got = tile_efficiency.tile_counts(mask, causal, block_m, block_n, chunk_rows=100, warpgroup_rows=wg_rows)
    assert got["computed_leading"] == direct_leading(mask, causal, block_m, block_n, wg_rows)
    assert got["visible"] <= got["computed_leading"] <= got["computed"]


def test_leading_skip_by_hand():
    # Causal, one 256-row tile of two 128-row warpgroups over two key blocks: the top warpgroup
    # (rows 0-127) does not see key block 1, which the walk visits first, so it skips it.
    got = tile_efficiency.tile_counts(masks.causal(256), True, 256, 128, warpgroup_rows=128)
    assert got["computed"] == 2 * 256 * 128
    assert got["computed_leading"] == 3 * 128 * 128


def test_parsers():
    assert tile_efficiency.parse_tiles("192x128,64x32") == [(192, 128), (64, 32)]
    assert tile_efficiency.parse_seqlens("8k,1000") == [8192, 1000]
