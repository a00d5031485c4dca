// The SM90 backward's last step: the fp32 dQ accumulator, in the order the kernel staged its tiles
// (bwd_mainloop.h), scaled and cast to dQ's dtype.
#pragma once
#include <cute/tensor.hpp>

#include "common/params.h"

namespace flashmask::sm90 {
using namespace cute;

// dQ = softmax_scale * accumulator, cast to the input dtype. The accumulator holds one
// [BlockM, head dim] tile per (batch, head, query block) in the order the kernel stages it: value v
// of consumer thread t in dQ slice s at (s * V + v) / 4 * 4 * kConsumerThreads + 4 * t + v % 4, V
// values a slice. One CTA per tile, one thread per consumer thread: each puts its values where
// TiledMmaQ's partition says they belong in a row-major tile in shared memory, and the CTA writes
// the tile's rows out in 16-byte pieces (2-byte stores scattered by the MMA layout filled a quarter
// of each 32-byte sector they touched). The API guarantees what the pieces need: head dim and dQ's
// strides multiples of 8, 16-byte aligned.
template <typename Traits>
__global__ void dq_convert_kernel(const BwdParams p) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
    constexpr int kPitch = kHeadDim + 8;  // 16 bytes of padding per row: the row-major stores spread over the banks
    constexpr int kPieces = kHeadDim / 8;
    constexpr int kSliceCols = kHeadDim / Traits::kDqSlices;
    __shared__ alignas(16) Element tile[kBlockM * kPitch];
    const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    typename Traits::TiledMmaQ mma_q;
    const Tensor coords =
        mma_q.get_thread_slice(threadIdx.x).partition_C(make_identity_tensor(typename Traits::TileDq{}));
    const int64_t index = (int64_t(b) * p.hq + h) * gridDim.x + m;
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum + index * kBlockM * kHeadDim) + threadIdx.x;
    CUTE_UNROLL
    for (int slice = 0; slice < Traits::kDqSlices; ++slice) {
        CUTE_UNROLL
        for (int v = 0; v < size(coords); v += 4) {
            const float4 x = src[(slice * size(coords) + v) / 4 * Traits::kConsumerThreads];
            const float xs[4] = {x.x, x.y, x.z, x.w};
            CUTE_UNROLL
            for (int j = 0; j < 4; ++j) {
                const int col = slice * kSliceCols + get<1>(coords(v + j));
                tile[get<0>(coords(v + j)) * kPitch + col] = Element(xs[j] * p.softmax_scale);
            }
        }
    }
    __syncthreads();
    Element* dq = static_cast<Element*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride;
    for (int i = threadIdx.x; i < kBlockM * kPieces; i += Traits::kConsumerThreads) {
        const int r = i / kPieces, c = (i % kPieces) * 8, row = m * kBlockM + r;
        if (row < p.sq && c < p.d) {
            *reinterpret_cast<uint4*>(dq + int64_t(row) * p.dq_row_stride + c) =
                *reinterpret_cast<const uint4*>(tile + r * kPitch + c);
        }
    }
}

}  // namespace flashmask::sm90
