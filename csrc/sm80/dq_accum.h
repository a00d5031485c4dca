// The fp32 dQ accumulator of the atomic backward and the kernel that turns it into dQ.
//
// Each (batch, query head, query block) owns one contiguous BlockM x kHeadDim tile, stored in the
// register order of the dQ MMA fragment rather than row-major: accumulators 4j..4j+3 of thread t
// live at floats (j * threads + t) * 4. A warp's atomic adds then cover 512 contiguous bytes, one
// 16-byte vector atomic per thread on sm_90, where the fragment's own layout scatters a warp over
// 8 rows in half-used 32-byte sectors. dq_convert_kernel reads the tile back in the same order,
// so the permutation never has to be written down.
#pragma once
#include <cute/tensor.hpp>

#include "common/params.h"
#include "sm80/tile_ops.h"

namespace flashmask::sm80 {
using namespace cute;

template <typename Traits>
__forceinline__ __device__ float* dq_accum_tile(const BwdParams& p, int b, int h, int m_block) {
    const int m_blocks = (p.sq + Traits::kBlockM - 1) / Traits::kBlockM;
    return p.dq_accum + ((int64_t(b) * p.hq + h) * m_blocks + m_block) * (Traits::kBlockM * Traits::kHeadDim);
}

template <int kThreads, typename Acc>
__forceinline__ __device__ void atomic_add_tile(float* tile, Acc const& acc, int tidx) {
    constexpr int kChunks = decltype(size(acc))::value / 4;
    static_assert(decltype(size(acc))::value % 4 == 0);
    CUTE_UNROLL
    for (int j = 0; j < kChunks; ++j) {
        float* dst = tile + (j * kThreads + tidx) * 4;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float4*>(dst),
                  make_float4(acc(4 * j), acc(4 * j + 1), acc(4 * j + 2), acc(4 * j + 3)));
#else
        CUTE_UNROLL
        for (int e = 0; e < 4; ++e) atomicAdd(dst + e, acc(4 * j + e));
#endif
    }
}

// dQ = softmax_scale * accumulator, cast to the input dtype: one CTA per (query block, head, batch).
template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads) dq_convert_kernel(const BwdParams p) {
    // Empty on sm_90 in a unit that csrc/instantiations.py builds for older archs only (skips_sm90).
#if !(defined(FLASHMASK_SM80_SKIP_SM90) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900)
    using Element = typename Traits::Element;
    using TileQ = Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>;
    extern __shared__ __align__(128) char smem[];
    const int tidx = threadIdx.x;
    const int m_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int r0 = m_block * Traits::kBlockM;

    typename Traits::TiledMmaQ mma_q;
    Tensor acc = partition_fragment_C(mma_q, TileQ{});
    const float4* tile = reinterpret_cast<const float4*>(dq_accum_tile<Traits>(p, b, h, m_block));
    CUTE_UNROLL
    for (int j = 0; j < size(acc) / 4; ++j) {
        const float4 v = tile[j * Traits::kNThreads + tidx];
        acc(4 * j) = v.x * p.softmax_scale;
        acc(4 * j + 1) = v.y * p.softmax_scale;
        acc(4 * j + 2) = v.z * p.softmax_scale;
        acc(4 * j + 3) = v.w * p.softmax_scale;
    }
    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
    Element* dq_ptr =
        reinterpret_cast<Element*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride + int64_t(r0) * p.dq_row_stride;
    Tensor gdQ = make_tensor(make_gmem_ptr(dq_ptr), TileQ{}, make_stride(p.dq_row_stride, _1{}));
    store_tile<typename Traits::SmemCopyAtomC, typename Traits::GmemTiledCopyOut, Element>(acc, mma_q, sQ, gdQ,
                                                                                           p.sq - r0, p.d, tidx);
#endif
}

}  // namespace flashmask::sm80
