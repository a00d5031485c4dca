// Launch layer of the forward kernel: grid, shared memory and the compile-time variants.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include "fwd_kernel.h"

namespace flashmask {

template <int kHeadDim, typename Element>
void run_fwd(const AttnParams& p, cudaStream_t stream) {
    using Traits = FwdTraits<kHeadDim, Element>;
    const dim3 grid((p.sq + Traits::kBlockM - 1) / Traits::kBlockM, p.hq, p.b);
    constexpr int smem = Traits::kSmemBytes;
    auto launch = [&](auto is_causal, auto mask_c) {
        auto kernel = &fwd_kernel<Traits, decltype(is_causal)::value, decltype(mask_c)::value>;
        if (smem > 48 * 1024) {
            C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        }
        kernel<<<grid, Traits::kNThreads, smem, stream>>>(p);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    using True = std::true_type;
    using False = std::false_type;
    const int c = p.mask != nullptr ? p.mask_c : 0;
    if (p.causal) {
        if (c == 0) launch(True{}, std::integral_constant<int, 0>{});
        else if (c == 1) launch(True{}, std::integral_constant<int, 1>{});
        else launch(True{}, std::integral_constant<int, 2>{});
    } else {
        if (c == 0) launch(False{}, std::integral_constant<int, 0>{});
        else if (c == 2) launch(False{}, std::integral_constant<int, 2>{});
        else launch(False{}, std::integral_constant<int, 4>{});
    }
}

}  // namespace flashmask
