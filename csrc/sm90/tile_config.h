// Tile shapes of the SM90 kernels, readable from plain C++ (the registry) and from the kernels.
#pragma once

namespace flashmask::sm90 {

// Forward: BlockM query rows (64 per consumer warpgroup) against BlockN keys per pipeline stage.
struct FwdTile {
    int block_m, block_n, consumer_warpgroups, stages;
};
constexpr FwdTile fwd_tile(int head_dim) {
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
