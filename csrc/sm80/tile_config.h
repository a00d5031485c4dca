// Tile shapes per head dim, readable from plain C++ (the binding) and from the kernels.
#pragma once

namespace flashmask::sm80 {

// Forward tile per instantiated head dim: (BlockM, BlockN, warps). The binding sizes the per-block
// mask bounds with block_n and the kernel walks the same blocks, so both read this one table.
struct FwdTile {
    int block_m, block_n, warps;
};
constexpr FwdTile fwd_tile(int head_dim) {
    return head_dim <= 64 ? FwdTile{128, 128, 4} : head_dim <= 128 ? FwdTile{128, 64, 4} : FwdTile{128, 64, 8};
}

// Backward tile: BlockM query rows against BlockN keys (the K/V block a CTA owns), 8 warps.
struct BwdTile {
    int block_m, block_n, warps;
};
constexpr BwdTile bwd_tile(int head_dim) { return head_dim <= 128 ? BwdTile{64, 128, 8} : BwdTile{64, 64, 8}; }

}  // namespace flashmask::sm80
