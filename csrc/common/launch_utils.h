// Shared pieces of the launch layers.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

namespace flashmask {

// Dynamic shared memory past 48 KiB needs the kernel's attribute raised on each device, once: a
// driver call on every launch costs microseconds of a short call's host time.
template <typename Kernel>
void allow_smem(Kernel kernel, int smem) {
    if (smem <= 48 * 1024) return;
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    static std::mutex mutex;
    static std::map<std::pair<const void*, int>, int> allowed;  // (kernel, device) -> bytes
    const std::lock_guard<std::mutex> lock(mutex);
    int& bytes = allowed[{reinterpret_cast<const void*>(kernel), device}];
    if (bytes >= smem) return;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    bytes = smem;
}

template <typename Kernel, typename Params>
void launch_with_smem(Kernel kernel, dim3 grid, int threads, int smem, const Params& p, cudaStream_t stream) {
    allow_smem(kernel, smem);
    kernel<<<grid, threads, smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls f(flag) with flag as a compile-time constant (std::true_type or std::false_type).
template <typename F>
void dispatch_bool(bool flag, F&& f) {
    if (flag)
        f(std::true_type{});
    else
        f(std::false_type{});
}

// Calls f(is_causal, mask_c) with both as compile-time constants (the valid (causal, C) modes).
template <typename F>
void dispatch_mask_mode(bool causal, int mask_c, F&& f) {
    using True = std::true_type;
    using False = std::false_type;
    if (causal) {
        if (mask_c == 0)
            f(True{}, std::integral_constant<int, 0>{});
        else if (mask_c == 1)
            f(True{}, std::integral_constant<int, 1>{});
        else
            f(True{}, std::integral_constant<int, 2>{});
    } else {
        if (mask_c == 0)
            f(False{}, std::integral_constant<int, 0>{});
        else if (mask_c == 2)
            f(False{}, std::integral_constant<int, 2>{});
        else
            f(False{}, std::integral_constant<int, 4>{});
    }
}

}  // namespace flashmask
