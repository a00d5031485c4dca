"""The key-block walk of a query tile on the CPU: ``KeyBlockWalk`` (csrc/mask/block_walk.h) and the
SM90 forward's tickets (``GroupTicket``, csrc/sm90/block_ticket.h), compiled with a C++ compiler
and walked as the kernels walk them (both forwards, and the SM80 deterministic dQ kernel) at every
head dim's tile, against the dense mask of ``masks.to_dense``.

A query tile reads only the key blocks its walk visits, and compares scores with the mask only
where a block's ticket (SM90, per consumer warpgroup) or compare (SM80) says so: a visible key block
the walk skips, a warpgroup told it does not see a block its rows see, or a partly masked block
told it needs no compare would all silently attend the wrong keys. So: every block with a visible
pair is visited, from the tile's floor (the lowest block it sees) up to its causal end; each
warpgroup that sees a pair of a block is told so; each block with a pair masked by the causal bound
or the end of the keys has its edges compared, and each with a pair masked by the intervals its
intervals; and the tickets' chaining (the last block, a warpgroup's run going on into the next
block) agrees with the blocks that follow.
"""
from __future__ import annotations

import pytest
import torch

import masks
from masks.examples import example
from tests.attn_helpers import random_startend
from tests.cxx import build_with_host_device, driver_lines, run_on_mask
from tests.tile_oracle import tiles_of

# (kernel, head dim, value head dim): each takes its tile from csrc/sm80/tile_config.h or
# csrc/sm90/tile_config.h ("sm80dq": the SM80 deterministic dQ kernel, which walks key blocks too).
KERNELS = [("sm90", 64, 64), ("sm90", 96, 96), ("sm90", 128, 128), ("sm90", 192, 128), ("sm90", 192, 192),
           ("sm90", 256, 256), ("sm80", 64, 64), ("sm80", 128, 128), ("sm80dq", 128, 128), ("sm80dq", 256, 256)]

# stdin: slices sq sk c causal arch d dv, then each slice's [Sk, C] values. stdout: per slice and
# query tile one line, each visited block as "n last" and per row group "sees intervals edges
# continues". Argument "tiles": each kernel's "arch d dv block_m block_n groups".
DRIVER = r"""
#include "host_device.h"
#include "mask/block_walk.h"
#include "sm80/tile_config.h"
#include "sm90/block_ticket.h"
#include "sm90/tile_config.h"

using namespace flashmask;

// The lowest key block the tile sees (what the binding's tile_work_kernel leaves in tile_floor).
template <typename Walk>
int floor_of(const Walk& walk, const int* bounds, int n_blocks) {
    for (int n = 0; n < walk.end(); ++n)
        if (!classify_tile(bounds + n * kNumBounds, walk.r0, walk.r1).fully_masked) return n;
    return n_blocks;
}

// Every query tile's walk from its causal end down to its floor (with `floor`; else to block 0), as
// one output line: `blocks(walk)` walks it (every lane: the walk ballots).
template <int kBlockM, int kBlockN, bool Is_causal, typename Blocks>
void walk_tiles(const std::vector<int>& col, int sq, int sk, int c, bool floor, Blocks blocks) {
    const std::vector<int> bounds = block_bounds(col, sq, sk, c, Is_causal, kBlockN);
    const int m_tiles = (sq + kBlockM - 1) / kBlockM, n_blocks = (sk + kBlockN - 1) / kBlockN;
    std::vector<std::string> out(m_tiles);
    as_warp([&](int lane) {
        for (int m = 0; m < m_tiles; ++m) {
            KeyBlockWalk<kBlockN, Is_causal, true> walk{bounds.data(), m * kBlockM, min((m + 1) * kBlockM, sq), sk,
                                                        sk - sq};
            if (floor) walk.n_floor = floor_of(walk, bounds.data(), n_blocks);
            const std::string line = blocks(walk);
            if (lane == 0) out[m] = line;
        }
    });
    for (const auto& line : out) std::printf("%s\n", line.c_str());
}

std::string fields(std::initializer_list<int> values) {
    std::string s;
    for (int v : values) s += " " + std::to_string(v);
    return s;
}

// The SM90 forward's load warp (fwd_producer.h): each visible block's ticket, told what follows it.
template <int kBlockM, int kBlockN, int kGroups, bool kGroupSight, bool Is_causal>
void sm90_slice(const std::vector<int>& col, int sq, int sk, int c) {
    using Ticket = sm90::GroupTicket<kGroups>;
    walk_tiles<kBlockM, kBlockN, Is_causal>(col, sq, sk, c, true, [](const auto& walk) {
        std::string line;
        BlockBounds bnd = walk.bounds_of(walk.end() - 1);
        int n = walk.visible_at_or_below(walk.end() - 1, bnd);
        int sight = n >= 0 ? Ticket::template sight<kGroupSight>(walk, n, bnd) : 0;
        while (n >= 0) {
            Ticket ticket = Ticket::template make<kGroupSight>(walk, n, bnd, sight);
            bnd = walk.bounds_of(n - 1);
            const int next = walk.visible_at_or_below(n - 1, bnd);
            sight = next >= 0 ? Ticket::template sight<kGroupSight>(walk, next, bnd) : 0;
            ticket.set_next(sight, next < 0);
            line += fields({ticket.block(), ticket.last()});
            for (int g = 0; g < kGroups; ++g) {
                const TileCompare t = ticket.compare(g);
                line += fields({ticket.sees(g), t.intervals, t.edges, ticket.run_continues(g)});
            }
            n = next;
        }
        return line;
    });
}

// The SM80 forward (sm80/fwd_kernel.h; with the tile floor) and the SM80 deterministic dQ
// (sm80/bwd_dq_kernel.h; without): the same walk, one compare for the whole tile.
template <int kBlockM, int kBlockN, bool Is_causal>
void sm80_slice(const std::vector<int>& col, int sq, int sk, int c, bool floor) {
    walk_tiles<kBlockM, kBlockN, Is_causal>(col, sq, sk, c, floor, [](const auto& walk) {
        std::string line;
        BlockBounds bnd = walk.bounds_of(walk.end() - 1);
        int n = walk.visible_at_or_below(walk.end() - 1, bnd);
        while (n >= 0) {
            const TileCompare t = walk.compare(n, bnd);
            bnd = walk.bounds_of(n - 1);
            const int next = walk.visible_at_or_below(n - 1, bnd);
            line += fields({n, next < 0, 1, t.intervals, t.edges, next >= 0});
            n = next;
        }
        return line;
    });
}

template <int kD, int kDv>
void sm90_at(bool causal, const std::vector<int>& col, int sq, int sk, int c) {
    constexpr sm90::FwdTile t = sm90::fwd_tile(kD, kDv);
    if (causal) sm90_slice<t.block_m, t.block_n, t.consumer_warpgroups, t.group_sight, true>(col, sq, sk, c);
    else sm90_slice<t.block_m, t.block_n, t.consumer_warpgroups, t.group_sight, false>(col, sq, sk, c);
}

template <int kD>
void sm80_at(bool causal, const std::vector<int>& col, int sq, int sk, int c) {
    constexpr sm80::FwdTile t = sm80::fwd_tile(kD);
    if (causal) sm80_slice<t.block_m, t.block_n, true>(col, sq, sk, c, true);
    else sm80_slice<t.block_m, t.block_n, false>(col, sq, sk, c, true);
}

template <int kD>
void sm80_dq_at(bool causal, const std::vector<int>& col, int sq, int sk, int c) {
    constexpr sm80::BwdTile t = sm80::bwd_tile(kD);
    if (causal) sm80_slice<t.block_m, t.block_n, true>(col, sq, sk, c, false);
    else sm80_slice<t.block_m, t.block_n, false>(col, sq, sk, c, false);
}

int main(int argc, char** argv) {
    if (argc > 1 && std::string(argv[1]) == "tiles") {
        for (int d : {64, 96, 128, 192, 256}) {
            const sm90::FwdTile t = sm90::fwd_tile(d);
            std::printf("sm90 %d %d %d %d %d\n", d, d, t.block_m, t.block_n, t.consumer_warpgroups);
        }
        const sm90::FwdTile t = sm90::fwd_tile(192, 128);
        std::printf("sm90 192 128 %d %d %d\n", t.block_m, t.block_n, t.consumer_warpgroups);
        for (int d : {64, 128}) {
            const sm80::FwdTile t80 = sm80::fwd_tile(d);
            std::printf("sm80 %d %d %d %d 1\n", d, d, t80.block_m, t80.block_n);
        }
        for (int d : {128, 256}) {
            const sm80::BwdTile t80 = sm80::bwd_tile(d);
            std::printf("sm80dq %d %d %d %d 1\n", d, d, t80.block_m, t80.block_n);
        }
        return 0;
    }
    int slices, sq, sk, c, causal, d, dv;
    char arch[8];
    if (std::scanf("%d %d %d %d %d %7s %d %d", &slices, &sq, &sk, &c, &causal, arch, &d, &dv) != 8) return 1;
    std::vector<int> col(size_t(sk) * c);
    const bool sm90 = std::string(arch) == "sm90", dq = std::string(arch) == "sm80dq";
    for (int s = 0; s < slices; ++s) {
        for (int& x : col)
            if (std::scanf("%d", &x) != 1) return 1;
        if (sm90 && d == 64) sm90_at<64, 64>(causal, col, sq, sk, c);
        else if (sm90 && d == 96) sm90_at<96, 96>(causal, col, sq, sk, c);
        else if (sm90 && d == 128) sm90_at<128, 128>(causal, col, sq, sk, c);
        else if (sm90 && d == 192 && dv == 128) sm90_at<192, 128>(causal, col, sq, sk, c);
        else if (sm90 && d == 192) sm90_at<192, 192>(causal, col, sq, sk, c);
        else if (sm90 && d == 256) sm90_at<256, 256>(causal, col, sq, sk, c);
        else if (dq && d == 128) sm80_dq_at<128>(causal, col, sq, sk, c);
        else if (dq && d == 256) sm80_dq_at<256>(causal, col, sq, sk, c);
        else if (!sm90 && d == 64) sm80_at<64>(causal, col, sq, sk, c);
        else if (!sm90 && d == 128) sm80_at<128>(causal, col, sq, sk, c);
        else return 2;
        std::fflush(stdout);
    }
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return build_with_host_device(DRIVER, tmp_path_factory.mktemp("key_block_walk"), "driver")


@pytest.fixture(scope="module")
def tiles(driver):
    """(arch, d, dv) -> (block_m, block_n, groups) of the forward, as the driver compiled them."""
    out = {}
    for line in driver_lines(driver, "tiles"):
        arch, *nums = line.split()
        d, dv, bm, bn, groups = map(int, nums)
        out[(arch, d, dv)] = (bm, bn, groups)
    return out


def walks(exe, mask: torch.Tensor, causal: bool, sq: int, kernel, groups: int):
    """Per slice and query tile: the visited blocks, each (n, last, [(sees, intervals, edges,
    continues)] per group)."""
    per_block = 2 + 4 * groups
    tiles = []
    for line in run_on_mask(exe, mask, sq, causal, *kernel):
        v = [int(x) for x in line.split()]
        tiles.append([(v[i], v[i + 1], [tuple(v[i + 2 + 4 * g:i + 6 + 4 * g]) for g in range(groups)])
                      for i in range(0, len(v), per_block)])
    return tiles


def check_walks(exe, tiles, mask: torch.Tensor, causal: bool, sq: int, kernel):
    block_m, block_n, groups = tiles[kernel]
    # A group's rows: 64 a consumer warpgroup (SM90), the whole tile (SM80).
    want = tiles_of(mask, causal, sq, block_m, block_n, rows=block_m // groups)
    m_tiles = want.seen.shape[1]
    walked = walks(exe, mask, causal, sq, kernel, groups)
    assert len(walked) == want.seen.shape[0] * m_tiles
    for s in range(want.seen.shape[0]):
        for m in range(m_tiles):
            blocks = walked[s * m_tiles + m]
            where = f"slice {s}, query tile {m}"
            visited = [n for n, _, _ in blocks]
            assert visited == sorted(set(visited), reverse=True), f"{where}: walked {visited}"
            missed = sorted(set(torch.nonzero(want.seen[s, m].any(0)).flatten().tolist()) - set(visited))
            assert not missed, f"{where}: key blocks {missed} hold visible pairs, not walked"
            for k, (n, last, per_group) in enumerate(blocks):
                assert last == (k == len(blocks) - 1), f"{where}, block {n}: last {last}"
                for g, (sees, intervals, edges, continues) in enumerate(per_group):
                    at = f"{where}, block {n}, group {g}"
                    if k + 1 < len(blocks):
                        assert continues == blocks[k + 1][2][g][0], f"{at}: continues {continues}"
                    else:
                        assert not continues, f"{at}: continues past the last block"
                    if want.seen[s, m, g, n]:
                        assert sees, f"{at}: its rows see the block, told they do not"
                    if sees:
                        assert edges or not want.edges[s, m, g, n], f"{at}: causal bound or end of keys not compared"
                        assert intervals or not want.intervals[s, m, g, n], f"{at}: masked pairs, no interval compare"


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"{k[0]}-{k[1]}x{k[2]}")
@pytest.mark.parametrize("family", sorted(masks.FAMILIES))
def test_every_family(driver, tiles, family, kernel):
    """Each family at a length off the tiles, many documents and window edges."""
    mask, causal = example(family, 2900, batch_size=1)
    check_walks(driver, tiles, mask, causal, 2900, kernel)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"{k[0]}-{k[1]}x{k[2]}")
@pytest.mark.parametrize("causal,c", [(True, 1), (True, 2), (False, 2), (False, 4)])
@pytest.mark.parametrize("sq,sk", [(700, 700), (333, 1000), (1000, 333), (700, 701), (700, 698), (640, 705)])
def test_random_intervals(driver, tiles, sq, sk, causal, c, kernel):
    """Random column intervals (a share of them block-constant, so whole tiles are hidden), Sq != Sk;
    causal offsets Sk - Sq of 1, -2 and 65 put the diagonal one key either side of block edges."""
    gen = torch.Generator().manual_seed(sq * 7 + sk * 3 + c + 11 * causal + kernel[1] + kernel[2])
    mask = random_startend(2, 2, sq, sk, causal, c, generator=gen)
    check_walks(driver, tiles, mask, causal, sq, kernel)
