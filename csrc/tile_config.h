// Tile shapes per head dim, readable from plain C++ (the binding) and from the kernels.
#pragma once

namespace flashmask {

// Forward tile per instantiated head dim: (BlockM, BlockN, warps). The binding sizes the per-block
// mask bounds with block_n and the kernel walks the same blocks, so both read this one table.
struct FwdTile {
    int block_m, block_n, warps;
};
constexpr FwdTile fwd_tile(int head_dim) {
    return head_dim <= 64 ? FwdTile{128, 128, 4}
         : head_dim <= 128 ? FwdTile{128, 64, 4}
         : FwdTile{128, 64, 8};
}

}  // namespace flashmask
