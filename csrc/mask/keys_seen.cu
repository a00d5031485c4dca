#include <c10/cuda/CUDAException.h>

#include "mask/bounds.h"

namespace flashmask {

namespace {

// One thread per key column: each run of query rows that may attend it (visible_runs) adds +1 at
// its first row and -1 past its last, so that a prefix sum over rows counts the keys each row sees.
__global__ void key_count_steps_kernel(const int* __restrict__ mask, int* __restrict__ steps, int64_t total, int sk,
                                       int c, bool causal, int sq) {
    const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    const int64_t bh = idx / sk;
    const int j = idx % sk;
    int lo[3], hi[3];
    const int runs = visible_runs(read_column(mask + bh * sk * c, j, c, causal, sq), j, causal, sq, sk, lo, hi);
    int* row_steps = steps + bh * (sq + 1);
    for (int t = 0; t < runs; ++t) {
        atomicAdd(row_steps + lo[t], 1);
        atomicAdd(row_steps + hi[t], -1);
    }
}

}  // namespace

void launch_key_count_steps(const int* mask, int* steps, int batch_heads, int sk, int c, bool causal, int sq,
                            cudaStream_t stream) {
    const int64_t total = int64_t(batch_heads) * sk;
    if (total == 0) return;
    constexpr int kThreads = 256;
    key_count_steps_kernel<<<(total + kThreads - 1) / kThreads, kThreads, 0, stream>>>(mask, steps, total, sk, c,
                                                                                       causal, sq);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flashmask
