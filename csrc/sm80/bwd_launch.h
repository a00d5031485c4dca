// Launch layer of the backward kernels.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include "common/launch_utils.h"
#include "sm80/bwd_dq_kernel.h"
#include "sm80/bwd_kv_kernel.h"

namespace flashmask::sm80 {

// dK, dV, and, when p.dq_accum is set, dQ by atomics into it and then into p.dq. kHeadDim: Q, K, dQ,
// dK; kHeadDimV: V, dO, dV (p.d <= kHeadDim, the value head dim <= kHeadDimV).
template <int kHeadDim, int kHeadDimV, typename Element>
void run_bwd_kv(const BwdParams& p, cudaStream_t stream) {
    using Traits = BwdTraits<kHeadDim, kHeadDimV, Element>;
    const dim3 grid((p.sk + Traits::kBlockN - 1) / Traits::kBlockN * p.hq, 1, p.b);
    dispatch_bool(p.softcap_scale != 0.f, [&](auto softcap) {
        constexpr bool kSoftcap = decltype(softcap)::value;
        dispatch_mask_mode(p.causal, p.mask != nullptr ? p.mask_c : 0, [&](auto is_causal, auto mask_c) {
            constexpr bool causal = decltype(is_causal)::value;
            launch_with_smem(&bwd_kv_kernel<Traits, causal, decltype(mask_c)::value, kSoftcap>, grid, Traits::kNThreads,
                             Traits::kSmemBytes, p, stream);
            // The key blocks no interval reaches: every CTA of one of the two launches returns at once.
            if constexpr (decltype(mask_c)::value > 0) {
                launch_with_smem(&bwd_kv_kernel<Traits, causal, 0, kSoftcap>, grid, Traits::kNThreads,
                                 Traits::kSmemBytes, p, stream);
            }
        });
    });
    if (p.dq_accum != nullptr) {
        const dim3 grid_q((p.sq + Traits::kBlockM - 1) / Traits::kBlockM, p.hq, p.b);
        launch_with_smem(&dq_convert_kernel<Traits>, grid_q, Traits::kNThreads, Traits::kSmemQBytes, p, stream);
    }
}

// Deterministic dQ (written to p.dq), after run_bwd_kv without atomics.
template <int kHeadDim, int kHeadDimV, typename Element>
void run_bwd_dq(const BwdParams& p, cudaStream_t stream) {
    using Traits = BwdTraits<kHeadDim, kHeadDimV, Element>;
    const dim3 grid((p.sq + Traits::kBlockM - 1) / Traits::kBlockM, p.hq, p.b);
    dispatch_bool(p.softcap_scale != 0.f, [&](auto softcap) {
        dispatch_mask_mode(p.causal, p.mask != nullptr ? p.mask_c : 0, [&](auto is_causal, auto mask_c) {
            launch_with_smem(
                &bwd_dq_kernel<Traits, decltype(is_causal)::value, decltype(mask_c)::value, decltype(softcap)::value>,
                grid, Traits::kNThreads, Traits::kSmemDqBytes, p, stream);
        });
    });
}

}  // namespace flashmask::sm80
