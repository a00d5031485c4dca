// Launch layer of the backward kernels.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include "bwd_kernel.h"
#include "launch_utils.h"

namespace flashmask {

// dK, dV and (atomically, unless deterministic) dQ; deterministic runs the dQ kernel after.
template <int kHeadDim, typename Element>
void run_bwd(const BwdParams& p, bool deterministic, cudaStream_t stream) {
    using Traits = BwdTraits<kHeadDim, Element>;
    const int c = p.mask != nullptr ? p.mask_c : 0;
    dispatch_mask_mode(p.causal, c, [&](auto is_causal, auto mask_c) {
        constexpr bool kCausal = decltype(is_causal)::value;
        constexpr int kC = decltype(mask_c)::value;
        const dim3 grid_kv((p.sk + Traits::kBlockN - 1) / Traits::kBlockN, p.hq, p.b);
        if (deterministic) {
            launch_with_smem(&bwd_kv_kernel<Traits, kCausal, kC, false>, grid_kv, Traits::kNThreads, Traits::kSmemBytes, p, stream);
            const dim3 grid_q((p.sq + Traits::kBlockM - 1) / Traits::kBlockM, p.hq, p.b);
            launch_with_smem(&bwd_dq_kernel<Traits, kCausal, kC>, grid_q, Traits::kNThreads, Traits::kSmemDqBytes, p, stream);
        } else {
            launch_with_smem(&bwd_kv_kernel<Traits, kCausal, kC, true>, grid_kv, Traits::kNThreads, Traits::kSmemBytes, p, stream);
        }
    });
}

template <typename Element>
void run_bwd_dsum(const BwdParams& p, const float* dlse, cudaStream_t stream) {
    const int64_t rows = int64_t(p.b) * p.hq * p.sq;
    if (rows == 0) return;
    constexpr int kThreads = 256;
    const int64_t grid = (rows * 32 + kThreads - 1) / kThreads;
    bwd_dsum_kernel<Element><<<grid, kThreads, 0, stream>>>(
        static_cast<const Element*>(p.dout), static_cast<const Element*>(p.o), dlse, const_cast<float*>(p.dsum), p.sq,
        p.hq, p.d, p.do_batch_stride, p.do_row_stride, p.do_head_stride, p.o_batch_stride, p.o_row_stride,
        p.o_head_stride, rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flashmask
