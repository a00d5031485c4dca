#include <c10/cuda/CUDAException.h>

#include <climits>

#include "mask/block_walk.h"
#include "mask/bounds.h"

namespace flashmask {

namespace {

// One warp per key block: the lanes stride over the block's columns, then reduce.
__global__ void mask_bounds_kernel(const int* __restrict__ mask, int* __restrict__ bounds, int total_blocks,
                                   int n_blocks, int sk, int c, bool causal, int sq, int block_n) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= total_blocks) return;
    const int n = warp % n_blocks;
    const int* col = mask + int64_t(warp / n_blocks) * sk * c;
    int lo[4] = {INT_MAX, INT_MAX, INT_MAX, INT_MAX};
    int hi[4] = {INT_MIN, INT_MIN, INT_MIN, INT_MIN};
    const int j_end = min((n + 1) * block_n, sk);
    for (int j = n * block_n + lane; j < j_end; j += 32) {
        const ColumnIntervals iv = read_column(col, j, c, causal, sq);
        const int vals[4] = {iv.lts, iv.lte, iv.uts, iv.ute};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            lo[t] = min(lo[t], vals[t]);
            hi[t] = max(hi[t], vals[t]);
        }
    }
#pragma unroll
    for (int t = 0; t < 4; ++t) {
#pragma unroll
        for (int s = 16; s > 0; s /= 2) {
            lo[t] = min(lo[t], __shfl_xor_sync(0xffffffffu, lo[t], s));
            hi[t] = max(hi[t], __shfl_xor_sync(0xffffffffu, hi[t], s));
        }
    }
    if (lane == 0) {
        int* out = bounds + int64_t(warp) * kNumBounds;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            out[2 * t] = lo[t];
            out[2 * t + 1] = hi[t];
        }
    }
}

// One warp per query tile: its lanes classify the key blocks up to the causal bound; the count of
// visible ones, and the lowest (n_blocks if none) into floors.
__global__ void tile_work_kernel(const int* __restrict__ bounds, int* __restrict__ work, int* __restrict__ floors,
                                 int total_tiles, int n_blocks, int m_tiles, int block_m, int block_n, int sq, int sk,
                                 bool causal) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= total_tiles) return;
    const int r0 = (warp % m_tiles) * block_m;
    const int r1 = min(r0 + block_m, sq);
    int n_end = n_blocks;
    if (causal) {
        const int last_key = r1 - 1 + sk - sq;
        n_end = last_key < 0 ? 0 : min(n_end, last_key / block_n + 1);
    }
    const int* b = bounds + int64_t(warp / m_tiles) * n_blocks * kNumBounds;
    int count = 0, lowest = n_blocks;
    for (int n = lane; n < n_end; n += 32) {
        const bool visible = !classify_tile(b + n * kNumBounds, r0, r1).fully_masked;
        count += visible;
        if (visible) lowest = min(lowest, n);
    }
    for (int s = 16; s > 0; s /= 2) {
        count += __shfl_xor_sync(0xffffffffu, count, s);
        lowest = min(lowest, __shfl_xor_sync(0xffffffffu, lowest, s));
    }
    if (lane == 0) {
        work[warp] = count;
        floors[warp] = lowest;
    }
}

// One warp per key block: the number of query blocks of block_m rows that see any of its keys
// (what the backward's walk visits).
__global__ void key_block_work_kernel(const int* __restrict__ bounds, int* __restrict__ work, int total_blocks,
                                      int n_blocks, int m_blocks, int block_m, int block_n, int sq, int sk,
                                      bool causal) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= total_blocks) return;
    const int c0 = (warp % n_blocks) * block_n;
    const int m_begin = causal ? causal_query_block_begin(c0, sk - sq, block_m, m_blocks) : 0;
    const int* b = bounds + int64_t(warp) * kNumBounds;
    int count = 0;
    for (int m = m_begin + lane; m < m_blocks; m += 32) {
        count += !classify_tile(b, m * block_m, min(m * block_m + block_m, sq)).fully_masked;
    }
    for (int s = 16; s > 0; s /= 2) count += __shfl_xor_sync(0xffffffffu, count, s);
    if (lane == 0) work[warp] = count;
}

}  // namespace

void launch_work(const int* bounds, int* work, int* floors, int batch_heads, int n_blocks, int m_tiles, int block_m,
                 int block_n, int sq, int sk, bool causal, bool key_blocks, cudaStream_t stream) {
    const int total = batch_heads * (key_blocks ? n_blocks : m_tiles);  // one warp each
    if (total == 0) return;
    constexpr int kThreads = 256;
    const int grid = (total * 32 + kThreads - 1) / kThreads;
    if (key_blocks) {
        key_block_work_kernel<<<grid, kThreads, 0, stream>>>(bounds, work, total, n_blocks, m_tiles, block_m, block_n,
                                                             sq, sk, causal);
    } else {
        tile_work_kernel<<<grid, kThreads, 0, stream>>>(bounds, work, floors, total, n_blocks, m_tiles, block_m,
                                                        block_n, sq, sk, causal);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_mask_bounds(const int* mask, int* bounds, int batch_heads, int sk, int c, bool causal, int sq, int block_n,
                        cudaStream_t stream) {
    const int n_blocks = (sk + block_n - 1) / block_n;
    const int total = batch_heads * n_blocks;
    if (total == 0) return;
    constexpr int kThreads = 256;
    const int grid = (total * 32 + kThreads - 1) / kThreads;
    mask_bounds_kernel<<<grid, kThreads, 0, stream>>>(mask, bounds, total, n_blocks, sk, c, causal, sq, block_n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flashmask
