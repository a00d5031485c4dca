// Launch layer of the SM90 forward: TMA descriptors of Q, K and V over their real strides, the
// grid, the shared memory and the compile-time mask modes.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "common/launch_utils.h"
#include "sm90/fwd_kernel.h"

namespace flashmask::sm90 {

template <int kHeadDim, typename Element>
void run_fwd(const AttnParams& p, cudaStream_t stream) {
    using namespace cute;
    using Traits = FwdTraits<kHeadDim, Element>;
    // [S, D, H, B] views: rows, the head dim (contiguous; zero-filled past p.d), heads, batch. Rows
    // past the end of the sequence are zero-filled by the TMA unit too. The binding lets a dimension
    // of size 1 have any stride, which a TMA descriptor would reject: such a stride is never
    // followed, so it is replaced by a valid one.
    auto gmem = [&](const void* ptr, int s, int h, int64_t row, int64_t head, int64_t batch) {
        const int64_t rows = s == 1 ? int64_t(kHeadDim) : row;
        const int64_t heads = h == 1 ? rows * s : head;
        const int64_t batches = p.b == 1 ? heads * h : batch;
        return make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)), make_shape(s, p.d, h, p.b),
                           make_stride(rows, _1{}, heads, batches));
    };
    auto tma_q = make_tma_copy(SM90_TMA_LOAD{}, gmem(p.q, p.sq, p.hq, p.q_row_stride, p.q_head_stride, p.q_batch_stride),
                               typename Traits::SmemLayoutQ{}, typename Traits::TileQ{}, _1{});
    auto tma_k = make_tma_copy(SM90_TMA_LOAD{}, gmem(p.k, p.sk, p.hk, p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                               take<0, 2>(typename Traits::SmemLayoutKV{}), typename Traits::TileKV{}, _1{});
    auto tma_v = make_tma_copy(SM90_TMA_LOAD{}, gmem(p.v, p.sk, p.hk, p.v_row_stride, p.v_head_stride, p.v_batch_stride),
                               take<0, 2>(typename Traits::SmemLayoutKV{}), typename Traits::TileKV{}, _1{});
    using Args = FwdArgs<decltype(tma_q), decltype(tma_k), decltype(tma_v)>;
    const Args args{p, tma_q, tma_k, tma_v};
    const dim3 grid((p.sq + Traits::kBlockM - 1) / Traits::kBlockM * p.hq, 1, p.b);
    dispatch_mask_mode(p.causal, p.mask != nullptr ? p.mask_c : 0, [&](auto is_causal, auto mask_c) {
        launch_with_smem(&fwd_kernel<Traits, decltype(is_causal)::value, decltype(mask_c)::value, Args>, grid,
                         Traits::kNThreads, Traits::kSmemBytes, args, stream);
    });
}

}  // namespace flashmask::sm90
