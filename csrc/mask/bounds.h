// Host entry points of the mask preprocessing kernels: per-key-block bounds (8 numbers per block,
// O(Sk / BlockN)), per-query-tile or per-key-block work and per-row key counts, computed once per
// mask and tile shape (the binding caches them: api/mask_cache.h).
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

// steps [B, Hm, Sq + 1] (zeroed) <- per key column, +1 at the first row of each run of query rows
// that may attend it and -1 past its end: a prefix sum over the first Sq gives the number of keys
// each query row may attend (0: the mask hides the row entirely).
void launch_key_count_steps(const int* mask, int* steps, int batch_heads, int sk, int c, bool causal, int sq,
                            cudaStream_t stream);

}  // namespace flashmask
