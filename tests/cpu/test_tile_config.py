"""The SM90 kernels' tile configuration (csrc/sm90/tile_config.h) on the CPU, with a C++ compiler:
the header is plain C++. Also the SM80 tiles of the unequal (head dim, value head dim) pairs, and
the register budget of the SM90 backward's tiles at every head dim.

setmaxnreg only moves registers within what the CTA got at launch; a producer / consumer split that
asks for more makes the consumers' setmaxnreg wait for ever (a head dim 128 forward with 32 producer
registers hangs). ``FwdTraits`` turns that into a compile error, but only a CUDA build of that
instantiation finds it; here a C++ compiler checks every head dim's split, and that the check
refuses the splits known to overflow.
"""
from __future__ import annotations

from tests.cxx import check_compiles, instantiations

PROGRAM = r"""
#include "sm90/tile_config.h"
using namespace flashmask::sm90;
static_assert(fwd_registers_fit(64), "head dim 64: setmaxnreg split does not fit");
static_assert(fwd_registers_fit(128), "head dim 128: setmaxnreg split does not fit");
// 384 threads get 168 registers each at launch: 32 producer registers beside two consumer
// warpgroups of 240 ask for more; 24 fit, and so do 32 beside three warpgroups of 160.
static_assert(!setmaxnreg_fits(384, 32, 256, 240), "an overflowing split passes");
static_assert(setmaxnreg_fits(384, 24, 256, 240), "head dim 128's split is refused");
static_assert(setmaxnreg_fits(512, 32, 384, 160), "head dim 64's split is refused");
static_assert(fwd_tile(64).block_m == 64 * fwd_tile(64).consumer_warpgroups, "64 rows per warpgroup");
static_assert(fwd_tile(128).block_m == 64 * fwd_tile(128).consumer_warpgroups, "64 rows per warpgroup");
// Per-warpgroup skipping needs warpgroups that issue freely: three, not the pingpong's two.
static_assert(!fwd_tile(128).group_sight || fwd_tile(128).consumer_warpgroups == 3, "pingpong skips");
static_assert(!fwd_tile(64).group_sight || fwd_tile(64).consumer_warpgroups == 3, "pingpong skips");
static_assert(bwd_tile(64).dq_warps >= 1 && bwd_tile(64).dq_warps <= 3, "three warps besides the producer");
static_assert(bwd_tile(128).dq_warps >= 1 && bwd_tile(128).dq_warps <= 3, "three warps besides the producer");
// The backward keeps a warpgroup's dK and dV accumulators in registers: 64 keys' rows, split over
// the warpgroups that share them. Beside S^T, dP^T and a dQ slice they must leave room in 240.
constexpr int dkdv_floats(int d, int dv) {
    const BwdTile t = bwd_tile(d, dv);
    return 64 * (d + dv) / (128 * (t.split_head_dim ? t.consumer_warpgroups : 1));
}
constexpr int dq_slice_floats(int d) {
    const BwdTile t = bwd_tile(d);
    return t.block_m * d / t.dq_slices / (128 * t.consumer_warpgroups);
}
constexpr bool bwd_fits(int d, int dv) {
    const BwdTile t = bwd_tile(d, dv);
    return dkdv_floats(d, dv) <= 128 && dkdv_floats(d, dv) + dq_slice_floats(d) <= 160 &&
           t.block_n == 64 * (t.split_head_dim ? 1 : t.consumer_warpgroups) &&
           d % (8 * t.dq_slices * t.consumer_warpgroups) == 0 && t.dq_warps >= 1 && t.dq_warps <= 3 &&
           (!t.split_head_dim || t.early_dv) && t.stages >= 1;
}
static_assert(bwd_fits(64, 64) && bwd_fits(96, 96) && bwd_fits(128, 128), "backward tiles up to 128");
static_assert(bwd_fits(192, 192) && bwd_fits(256, 256) && bwd_fits(192, 128), "backward tiles above 128");
// Above 128 whole rows of 64 keys would not fit: the warpgroups must split the head dim there.
static_assert(64 * (256 + 256) / 128 > 128 && bwd_tile(256).split_head_dim && bwd_tile(192).split_head_dim, "split");
static_assert(bwd_tile(192, 128).block_n == bwd_tile(192).block_n, "a pair takes its wider head dim's tiles");
int main() { return 0; }
"""


def test_register_splits_fit(tmp_path):
    check_compiles(PROGRAM, tmp_path, "fit")


def test_sm80_pair_tiles(tmp_path):
    """Every SM80 pair's tiles: an equal head dim keeps the tiles of its head dim (the kernels it had
    before pairs existed), an unequal pair takes those of its wider head dim."""
    inst = instantiations()
    lines = ['#include "sm80/tile_config.h"', "using namespace flashmask::sm80;",
             "constexpr bool same(FwdTile a, FwdTile b) {",
             "    return a.block_m == b.block_m && a.block_n == b.block_n && a.warps == b.warps;", "}",
             "constexpr bool same(BwdTile a, BwdTile b) {",
             "    return a.block_m == b.block_m && a.block_n == b.block_n && a.warps == b.warps;", "}"]
    pairs = inst.arch_head_dim_pairs("sm80")
    assert (192, 128) in pairs
    for d, dv in pairs:
        wide = max(d, dv)
        for fn in ("fwd_tile", "bwd_tile"):
            lines.append(f'static_assert(same({fn}({d}, {dv}), {fn}({wide})), "{fn}({d}, {dv})");')
    lines.append("int main() { return 0; }")
    check_compiles("\n".join(lines) + "\n", tmp_path, "pairs")


def test_sm90_pair_splits_fit(tmp_path):
    """Every SM90 forward the build list holds (equal head dims and pairs) has a register split that
    fits its CTA, 64 rows per warpgroup and a pingpong that never skips; every SM90 backward too."""
    inst = instantiations()
    lines = ['#include "sm90/tile_config.h"', "using namespace flashmask::sm90;"]
    built = {(i.head_dim, i.head_dim_v, i.kernel) for i in inst.instantiations(archs=["sm90"], dtypes=["bf16"])}
    assert {(d, dv) for d, dv, k in built if k == "fwd"} >= {(96, 96), (192, 192), (256, 256), (192, 128)}
    for d, dv, kernel in sorted(built):
        if kernel == "fwd":
            t = f"fwd_tile({d}, {dv})"
            lines += [f'static_assert(fwd_registers_fit({d}, {dv}), "{t}: split");',
                      f'static_assert({t}.block_m == 64 * {t}.consumer_warpgroups, "{t}: rows");',
                      f'static_assert(!{t}.group_sight || {t}.consumer_warpgroups == 3, "{t}: pingpong skips");',
                      f'static_assert({t}.block_n == 128 || !{t}.compare_by_quarters, "{t}: quarters");']
        else:
            lines.append(f'static_assert(bwd_tile({d}).dq_warps >= 1 && bwd_tile({d}).dq_warps <= 3, "bwd {d}");')
    lines.append("int main() { return 0; }")
    check_compiles("\n".join(lines), tmp_path, "sm90")
