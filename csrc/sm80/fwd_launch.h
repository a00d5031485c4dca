// Launch layer of the forward kernel: grid, shared memory and the compile-time variants.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include "common/launch_utils.h"
#include "sm80/fwd_kernel.h"

namespace flashmask::sm80 {

// kHeadDim: Q and K; kHeadDimV: V and O (p.d <= kHeadDim, p.d_v <= kHeadDimV).
template <int kHeadDim, int kHeadDimV, typename Element>
void run_fwd(const AttnParams& p, cudaStream_t stream) {
    using Traits = FwdTraits<kHeadDim, kHeadDimV, Element>;
    const dim3 grid((p.sq + Traits::kBlockM - 1) / Traits::kBlockM * p.hq, 1, p.b * p.num_splits);
    constexpr int smem = Traits::kSmemBytes;
    dispatch_bool(p.softcap_scale != 0.f, [&](auto softcap) {
        dispatch_mask_mode(p.causal, p.mask != nullptr ? p.mask_c : 0, [&](auto is_causal, auto mask_c) {
            launch_with_smem(
                &fwd_kernel<Traits, decltype(is_causal)::value, decltype(mask_c)::value, decltype(softcap)::value>,
                grid, Traits::kNThreads, smem, p, stream);
        });
    });
}

}  // namespace flashmask::sm80
