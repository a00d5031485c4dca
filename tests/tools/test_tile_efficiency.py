"""tools/tile_efficiency.py: tile counts against a direct count, one tile at a time."""
import pytest
import torch

import masks
from masks.format import to_dense, unpack
from tests.attn_helpers import random_startend
from tools import tile_efficiency


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


def direct_skip(mask, causal, block_m, block_n, wg_rows, cut_only):
    """Pairs computed when each warpgroup skips the visited blocks its own rows do not see (with
    cut_only: only those whose tile the column intervals cut partly, by the kernels' bounds test)."""
    dense = to_dense(mask, causal)
    iv = unpack(mask, causal)
    s = dense.shape[-1]
    computed = 0
    for i, bh in enumerate(dense.flatten(0, 1)):
        b, h = divmod(i, mask.shape[1])
        lts = iv.lts[b, h].tolist()
        lte = iv.lte[b, h].tolist() if iv.lte is not None else [s] * s
        uts = iv.uts[b, h].tolist() if iv.uts is not None else [0] * s
        ute = iv.ute[b, h].tolist() if iv.ute is not None else [0] * s
        for r in range(0, s, block_m):
            r1 = min(r + block_m, s)
            for c in range(0, s, block_n):
                if not bh[r:r1, c:c + block_n].any():
                    continue
                cols = range(c, min(c + block_n, s))
                cut = ((r1 > min(lts[j] for j in cols) and r < max(lte[j] for j in cols))
                       or (r1 > min(uts[j] for j in cols) and r < max(ute[j] for j in cols)))
                for w in range(r, r1, wg_rows):
                    rows = bh[w:min(w + wg_rows, r1), c:c + block_n]
                    if rows.any() or (cut_only and not cut):
                        computed += rows.numel()
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
    assert got["computed_skip"] == direct_skip(mask, causal, block_m, block_n, wg_rows, cut_only=False)
    assert got["computed_skip_cut"] == direct_skip(mask, causal, block_m, block_n, wg_rows, cut_only=True)
    assert got["visible"] <= got["computed_skip"] <= got["computed_skip_cut"] <= got["computed"]


def test_leading_skip_by_hand():
    # Causal, one 256-row tile of two 128-row warpgroups over two key blocks: the top warpgroup
    # (rows 0-127) does not see key block 1, which the walk visits first, so it skips it.
    got = tile_efficiency.tile_counts(masks.causal(256), True, 256, 128, warpgroup_rows=128)
    assert got["computed"] == 2 * 256 * 128
    assert got["computed_leading"] == 3 * 128 * 128


def test_skip_by_hand():
    # Causal, one 256-row tile of two 128-row warpgroups over two key blocks: the top warpgroup does
    # not see key block 1. Every warpgroup skips it; only the diagonal crosses it, which the
    # intervals-only skip leaves to be computed.
    got = tile_efficiency.tile_counts(masks.causal(256), True, 256, 128, warpgroup_rows=128)
    assert got["computed_skip"] == 3 * 128 * 128
    assert got["computed_skip_cut"] == 4 * 128 * 128
    # A 128-key window over 512 rows: row i sees keys (i - 128, i]. Tile 0 visits key blocks 0-1,
    # tile 1 blocks 1-3 (10 warpgroup x block pieces). The diagonal hides block 1 from warpgroup 0
    # and block 3 from warpgroup 2; the window's lower edge, which cuts tile 1's block 1 (LTS from
    # 256), hides it from warpgroup 3: both skips drop that piece, only the first all three.
    window = masks.sliding_window(512, 128)
    got = tile_efficiency.tile_counts(window, True, 256, 128, warpgroup_rows=128)
    piece = 128 * 128
    assert (got["computed"], got["computed_skip"], got["computed_skip_cut"]) == (10 * piece, 7 * piece, 9 * piece)


def test_parsers():
    assert tile_efficiency.parse_tiles("192x128,64x32") == [(192, 128), (64, 32)]
    assert tile_efficiency.parse_seqlens("8k,1000") == [8192, 1000]
