// GQA inside the SM90 backward: a query head's dK or dV tile (a wgmma accumulator over BlockN keys
// and the head dim) added in fp32 into its key/value head's slice of a zeroed [B, Sk, Hk, D]
// accumulator, so that the group needs no pass of its own afterwards. The additions resolve in L2
// (red.global.add); adjacent columns, which the accumulator holds as value pairs, go as one 8-byte
// reduction. Not bitwise reproducible: the deterministic backward keeps the binding's sum.
#pragma once
#include <cute/tensor.hpp>

namespace flashmask::sm90 {

__device__ __forceinline__ void red_add_pair(float* dst, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
}

// acc: the calling consumer thread's accumulator of tiled_mma over the (kBlockN, kHeadDim) tile of
// keys [n0, n0 + kBlockN); rows past sk and columns past d are left out. d is a multiple of 8 (the
// binding checks it), so a pair never straddles d and its 8 bytes are aligned.
template <int kBlockN, int kHeadDim, typename Acc, typename TiledMma>
__device__ __forceinline__ void add_to_group(float* accum, Acc const& acc, TiledMma const& tiled_mma, int ctid,
                                             int n0, int sk, int d, int hk, int kv_h, int b) {
    using namespace cute;
    const Tensor c =
        tiled_mma.get_thread_slice(ctid).partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    float* const head = accum + (int64_t(b) * sk * hk + kv_h) * d;  // key row r at r * hk * d
    const int64_t row_stride = int64_t(hk) * d;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
        const int row = n0 + get<0>(c(i)), col = get<1>(c(i));
        if (row < sk && col < d) red_add_pair(head + row * row_stride + col, acc(i), acc(i + 1));
    }
}

}  // namespace flashmask::sm90
