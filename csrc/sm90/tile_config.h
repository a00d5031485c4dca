// Tile shapes of the SM90 kernels, readable from plain C++ (the registry) and from the kernels.
#pragma once

namespace flashmask::sm90 {

// Forward: BlockM query rows (64 per consumer warpgroup) against BlockN keys per pipeline stage.
struct FwdTile {
    int block_m, block_n, consumer_warpgroups, stages;
};
constexpr FwdTile fwd_tile(int head_dim) {
    // The kernel also runs three consumer warpgroups (192-row tiles, no pingpong; FwdBarriers).
    // At head dim 64 they were faster on most mask families on an H100, but causal document at
    // 8K fell from 256 to 66 TFLOP/s, unexplained (docs/perf_notes.md, version 19): two it stays.
    return head_dim <= 64 ? FwdTile{128, 128, 2, 3} : FwdTile{128, 128, 2, 2};
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
