// Host entry points of the mask preprocessing kernels: per-key-block bounds (8 numbers per block,
// O(Sk / BlockN)) and per-query-tile or per-key-block work, computed once per mask and tile shape
// (the binding caches them: api/mask_cache.h).
#pragma once
#include <cuda_runtime.h>

#include "mask/intervals.h"

namespace flashmask {

// bounds [B, Hm, n_blocks, 8] <- min/max of each canonical vector over each block of block_n columns.
void launch_mask_bounds(const int* mask, int* bounds, int batch_heads, int sk, int c, bool causal, int sq, int block_n,
                        cudaStream_t stream);

// work [B * Hm, m_tiles] <- the number of key blocks each query tile of block_m rows visits, and
// floors [B * Hm, m_tiles] <- the lowest of them (n_blocks if none); with key_blocks, work
// [B * Hm, n_blocks] <- the number of query blocks of block_m rows that see each key block (floors
// unused).
void launch_work(const int* bounds, int* work, int* floors, int batch_heads, int n_blocks, int m_tiles, int block_m,
                 int block_n, int sq, int sk, bool causal, bool key_blocks, cudaStream_t stream);

}  // namespace flashmask
