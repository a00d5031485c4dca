"""The deterministic SM90 backward's dQ turns on the CPU: ``QueryBlockWalk`` (csrc/mask/block_walk.h),
compiled with a C++ compiler, its warp-wide searches run by 32 host threads in lockstep.

Each key block adds its dQ tile to every query block its walk visits, in the order its semaphore
hands out: a key block waits for ``previous_visitor(m)``, the key block below it that visits m last.
That order is fixed (the backward bitwise repeatable) only if every visitor waits for exactly the
visitor before it: two visitors waiting for the same turn would race. So, for every family and
random column intervals, each key block's walk upwards (``visible_at_or_above``) and downwards
(``visible_at_or_below``) visit the same query blocks; they cover every tile with a visible pair
(``masks.to_dense``); ``previous_visitor(m)`` is the highest lower key block whose walk visits m;
and each tile with a pair masked by the causal bound, the end of the keys or the intervals has that
compared (``QueryBlockWalk::compare``, what the backward producer's tickets carry).
"""
from __future__ import annotations

import pytest
import torch

import masks
from masks.examples import example
from tests.attn_helpers import random_startend
from tests.cxx import build_with_host_device, driver_lines, run_on_mask
from tests.tile_oracle import tiles_of

# The SM90 backward's head dims; each takes its tile (block_m, block_n) from csrc/sm90/tile_config.h.
HEAD_DIMS = [64, 96, 128, 192, 256]

# stdin: slices sq sk c causal head_dim, then each slice's [Sk, C] values. stdout, per slice and key
# block: "up ; down ; previous visitor of each block in up ; its compare (intervals | edges << 1)".
# And "tiles": each head dim's tile.
DRIVER = r"""
#include "host_device.h"
#include "mask/block_walk.h"
#include "sm90/tile_config.h"

using namespace flashmask;

template <int kBlockM, int kBlockN, bool Is_causal>
void slice(const std::vector<int>& col, int sq, int sk, int c) {
    const int n_blocks = (sk + kBlockN - 1) / kBlockN, m_end = (sq + kBlockM - 1) / kBlockM;
    const std::vector<int> bounds = block_bounds(col, sq, sk, c, Is_causal, kBlockN);
    std::vector<std::vector<int>> up(n_blocks), down(n_blocks), previous(n_blocks), compares(n_blocks);
    as_warp([&](int lane) {
        for (int n = 0; n < n_blocks; ++n) {
            const QueryBlockWalk<kBlockM, kBlockN, Is_causal, true> walk{bounds.data() + n * kNumBounds, n * kBlockN,
                                                                         sq, sk, sk - sq, m_end};
            std::vector<int> u, d, pv, cmp;
            for (int m = walk.visible_at_or_above(walk.begin()); m < m_end; m = walk.visible_at_or_above(m + 1))
                u.push_back(m);
            for (int m = walk.visible_at_or_below(m_end - 1); m >= 0; m = walk.visible_at_or_below(m - 1))
                d.push_back(m);
            for (int m : u) pv.push_back(walk.previous_visitor(m));  // every lane: it ballots
            for (int m : u) cmp.push_back(int(walk.compare(m).intervals) | int(walk.compare(m).edges) << 1);
            if (lane == 0) up[n] = u, down[n] = d, previous[n] = pv, compares[n] = cmp;
        }
    });
    for (int n = 0; n < n_blocks; ++n) {
        for (int m : up[n]) std::printf("%d ", m);
        std::printf(";");
        for (int m : down[n]) std::printf(" %d", m);
        std::printf(" ;");
        for (int v : previous[n]) std::printf(" %d", v);
        std::printf(" ;");
        for (int v : compares[n]) std::printf(" %d", v);
        std::printf("\n");
    }
}

// The tile of the SM90 backward at head dim kD.
template <int kD>
void slice_at(bool causal, const std::vector<int>& col, int sq, int sk, int c) {
    constexpr sm90::BwdTile t = sm90::bwd_tile(kD);
    if (causal) slice<t.block_m, t.block_n, true>(col, sq, sk, c);
    else slice<t.block_m, t.block_n, false>(col, sq, sk, c);
}

int main(int argc, char** argv) {
    if (argc > 1 && std::string(argv[1]) == "tiles") {
        for (int d : {64, 96, 128, 192, 256})
            std::printf("%d %d %d\n", d, sm90::bwd_tile(d).block_m, sm90::bwd_tile(d).block_n);
        return 0;
    }
    int slices, sq, sk, c, causal, d;
    if (std::scanf("%d %d %d %d %d %d", &slices, &sq, &sk, &c, &causal, &d) != 6) return 1;
    std::vector<int> col(size_t(sk) * c);
    for (int s = 0; s < slices; ++s) {
        for (int& x : col)
            if (std::scanf("%d", &x) != 1) return 1;
        switch (d) {
            case 64: slice_at<64>(causal, col, sq, sk, c); break;
            case 96: slice_at<96>(causal, col, sq, sk, c); break;
            case 128: slice_at<128>(causal, col, sq, sk, c); break;
            case 192: slice_at<192>(causal, col, sq, sk, c); break;
            case 256: slice_at<256>(causal, col, sq, sk, c); break;
            default: return 2;
        }
        std::fflush(stdout);
    }
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return build_with_host_device(DRIVER, tmp_path_factory.mktemp("dq_turns"), "driver")


@pytest.fixture(scope="module")
def tiles(driver):
    """Head dim -> (block_m, block_n) of the SM90 backward, as the driver compiled them."""
    return {d: (bm, bn) for d, bm, bn in ([int(x) for x in line.split()] for line in driver_lines(driver, "tiles"))}


def walks(exe, mask: torch.Tensor, causal: bool, sq: int, d: int, block_n: int):
    """Per slice of mask ([B, Hm, Sk, C]) and key block of the head dim d tile: (blocks walked up,
    walked down, previous visitor and compare flags of each block walked up)."""
    b, hm, sk, _ = mask.shape
    lines = run_on_mask(exe, mask, sq, causal, d)
    rows = [[[int(x) for x in part.split()] for part in line.split(";")] for line in lines]
    n_blocks = -(-sk // block_n)
    assert len(rows) == b * hm * n_blocks
    return [rows[i * n_blocks:(i + 1) * n_blocks] for i in range(b * hm)]


def check_turns(exe, tiles, mask: torch.Tensor, causal: bool, sq: int, d: int):
    block_m, block_n = tiles[d]
    want = tiles_of(mask, causal, sq, block_m, block_n)  # [slice, query block, 1, key block]
    m_end = want.seen.shape[1]
    for s, blocks in enumerate(walks(exe, mask, causal, sq, d, block_n)):
        last_visitor = {}
        for n, (up, down, previous, compares) in enumerate(blocks):
            at = f"slice {s}, key block {n}"
            assert up == sorted(set(up)) and all(0 <= m < m_end for m in up), f"{at}: walked {up}"
            assert sorted(down) == up, f"{at}: walked up {up}, down {down}"
            missed = sorted(set(torch.nonzero(want.seen[s, :, 0, n]).flatten().tolist()) - set(up))
            assert not missed, f"{at}: query blocks {missed} hold visible pairs, not walked"
            for m, got, cmp in zip(up, previous, compares):
                expect = last_visitor.get(m, -1)
                assert got == expect, (f"{at}, query block {m}: previous visitor {got}, but the last lower key "
                                       f"block to visit it is {expect}")
                last_visitor[m] = n
                assert cmp & 2 or not want.edges[s, m, 0, n], f"{at}, query block {m}: causal bound or end not compared"
                assert cmp & 1 or not want.intervals[s, m, 0, n], f"{at}, query block {m}: masked pairs, no compare"


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("family", sorted(masks.FAMILIES))
def test_every_family(driver, tiles, family, d):
    """Each family at a length off the tiles (a few thousand tokens: many documents and window edges)."""
    mask, causal = example(family, 2900, batch_size=1)
    check_turns(driver, tiles, mask, causal, 2900, d)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal,c", [(True, 1), (True, 2), (False, 2), (False, 4)])
@pytest.mark.parametrize("sq,sk", [(700, 700), (333, 1000), (1000, 333), (700, 701), (700, 698), (640, 705)])
def test_random_intervals(driver, tiles, sq, sk, causal, c, d):
    """Random column intervals (a share of them block-constant, so whole tiles are hidden), Sq != Sk;
    causal offsets Sk - Sq of 1, -2 and 65 put the diagonal one key either side of block edges."""
    gen = torch.Generator().manual_seed(sq * 7 + sk * 3 + c + 11 * causal + d)
    mask = random_startend(2, 2, sq, sk, causal, c, generator=gen)
    check_turns(driver, tiles, mask, causal, sq, d)


def test_searches_past_one_round(driver, tiles):
    """The global sliding window at 16K: a window's first key block more than 128 blocks above the
    global keys, its previous visitor, so that previous_visitor's search takes more than one round
    of 32 lanes x 4 blocks."""
    mask, causal = example("global_sliding_window", 16384, batch_size=1)
    d = min(tiles, key=lambda d: tiles[d][1])  # the shortest key blocks: the most of them
    check_turns(driver, tiles, mask, causal, 16384, d)
