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

}  // namespace flashmask::sm90
