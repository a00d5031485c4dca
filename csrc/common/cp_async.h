// A 4-byte asynchronous global->shared copy (cp.async, sm_80 and later), for the small int and
// float vectors the kernels stage: mask columns, row statistics.
#pragma once
#include <cuda_runtime.h>

namespace flashmask {

// Asynchronous 4-byte global->shared copy; zero-filled (and nothing read) when !pred.
__forceinline__ __device__ void cp_async_4(void* smem_dst, const void* gmem_src, bool pred) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(pred ? 4 : 0));
}

}  // namespace flashmask
