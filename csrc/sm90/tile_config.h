// Tile shapes of the SM90 kernels, readable from plain C++ (the registry) and from the kernels.
#pragma once

namespace flashmask::sm90 {

// Forward: BlockM query rows (64 per consumer warpgroup) against BlockN keys per pipeline stage.
struct FwdTile {
    int block_m, block_n, consumer_warpgroups, stages;
};
// Head dim 64 runs three consumer warpgroups (192-row tiles, no pingpong): its GEMMs are half as
// long next to the same softmax, and a third warpgroup keeps the tensor cores fed (H100: +10-25%
// on most families at 32K-128K, -10% on global + sliding window; docs/perf_notes.md, version 20).
// FLASHMASK_SM90_FWD_WG64=2 builds the two-warpgroup pingpong instead (scripts/sweep_fwd_variants.sh).
#ifndef FLASHMASK_SM90_FWD_WG64
#define FLASHMASK_SM90_FWD_WG64 3
#endif
constexpr FwdTile fwd_tile(int head_dim) {
    return head_dim <= 64 ? FwdTile{64 * FLASHMASK_SM90_FWD_WG64, 128, FLASHMASK_SM90_FWD_WG64, 3}
                          : FwdTile{128, 128, 2, 2};
}

// Backward: a CTA owns BlockN keys (64 per consumer warpgroup) and walks query blocks of BlockM rows,
// whose Q and dO go through a pipeline of `stages`.
struct BwdTile {
    int block_m, block_n, consumer_warpgroups, stages;
};
constexpr BwdTile bwd_tile(int head_dim) {
    return BwdTile{64, 128, 2, 2};
}

}  // namespace flashmask::sm90
