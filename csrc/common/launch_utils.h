// Shared pieces of the launch layers.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <type_traits>

namespace flashmask {

template <typename Kernel, typename Params>
void launch_with_smem(Kernel kernel, dim3 grid, int threads, int smem, const Params& p, cudaStream_t stream) {
    if (smem > 48 * 1024) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    kernel<<<grid, threads, smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls f(is_causal, mask_c) with both as compile-time constants (the valid (causal, C) modes).
template <typename F>
void dispatch_mask_mode(bool causal, int mask_c, F&& f) {
    using True = std::true_type;
    using False = std::false_type;
    if (causal) {
        if (mask_c == 0) f(True{}, std::integral_constant<int, 0>{});
        else if (mask_c == 1) f(True{}, std::integral_constant<int, 1>{});
        else f(True{}, std::integral_constant<int, 2>{});
    } else {
        if (mask_c == 0) f(False{}, std::integral_constant<int, 0>{});
        else if (mask_c == 2) f(False{}, std::integral_constant<int, 2>{});
        else f(False{}, std::integral_constant<int, 4>{});
    }
}

}  // namespace flashmask
