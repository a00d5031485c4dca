#include <c10/cuda/CUDAException.h>

#include "mask/bounds.h"

namespace flashmask {

namespace {

// One thread per key column: the query rows that may attend it are [0, Sq) less the causal
// triangle and its two intervals. Each visible run of rows adds +1 at its first row and -1 past
// its last, so that a prefix sum over rows counts the keys each row may attend.
__global__ void key_count_steps_kernel(const int* __restrict__ mask, int* __restrict__ steps, int64_t total, int sk,
                                       int c, bool causal, int sq) {
    const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    const int64_t bh = idx / sk;
    const int j = idx % sk;
    const ColumnIntervals iv = read_column(mask + bh * sk * c, j, c, causal, sq);
    const auto clamp = [&](int x) { return min(max(x, 0), sq); };
    // Hidden runs [lo, hi) clamped to the rows; causal (bottom-right aligned): rows below j - (Sk - Sq).
    int lo[3] = {0, clamp(iv.lts), clamp(iv.uts)};
    int hi[3] = {causal ? clamp(j - (sk - sq)) : 0, clamp(iv.lte), clamp(iv.ute)};
    // By start, so that the visible rows are the gaps between the merged runs.
#pragma unroll
    for (int a = 0; a < 2; ++a) {
#pragma unroll
        for (int t = 0; t < 2 - a; ++t) {
            if (lo[t + 1] < lo[t]) {
                const int l = lo[t], h = hi[t];
                lo[t] = lo[t + 1], hi[t] = hi[t + 1];
                lo[t + 1] = l, hi[t + 1] = h;
            }
        }
    }
    int* row_steps = steps + bh * (sq + 1);
    int seen_to = 0;  // rows below it are hidden or already counted
#pragma unroll
    for (int t = 0; t < 3; ++t) {
        if (hi[t] <= lo[t]) continue;
        if (lo[t] > seen_to) {
            atomicAdd(row_steps + seen_to, 1);
            atomicAdd(row_steps + lo[t], -1);
        }
        seen_to = max(seen_to, hi[t]);
    }
    if (seen_to < sq) {
        atomicAdd(row_steps + seen_to, 1);
        atomicAdd(row_steps + sq, -1);
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
