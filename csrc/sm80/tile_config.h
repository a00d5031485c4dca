// Tile shapes per head dim, readable from plain C++ (the binding) and from the kernels. The head dim
// is that of Q and K, the value head dim that of V, O and dO (equal but for a few pairs).
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

// An unequal pair takes the tiles of its wider head dim: those tiles hold that width in every
// buffer and accumulator, and the narrower side only uses less of the budget ((192, 128): head
// dim 192's tiles, V, O, dO and dV a third smaller).
constexpr int wider_head_dim(int head_dim, int head_dim_v) { return head_dim > head_dim_v ? head_dim : head_dim_v; }
constexpr FwdTile fwd_tile(int head_dim, int head_dim_v) { return fwd_tile(wider_head_dim(head_dim, head_dim_v)); }
constexpr BwdTile bwd_tile(int head_dim, int head_dim_v) { return bwd_tile(wider_head_dim(head_dim, head_dim_v)); }

}  // namespace flashmask::sm80
