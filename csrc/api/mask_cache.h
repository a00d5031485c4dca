// Mask metadata computed once per mask and reused: the same mask tensor goes through every layer
// of a step (24-80 forwards and as many backwards), and its metadata depends only on the mask's
// contents and the call's shape, not on q, k, v.
#pragma once
#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace flashmask {

// What a call needs from its mask.
struct MaskMeta {
    at::Tensor mask;    // contiguous int32 [B, Hm, Sk, C]
    at::Tensor bounds;  // [B, Hm, ceil(Sk / block_n), kNumBounds]: per-key-block min/max (mask/bounds.h)
    at::Tensor order;   // int32 [B * Hm, ceil(Sq / block_m)]: query tiles longest first; only if block_m > 0
};

// The metadata of `user_mask` (int32 [B, Hm, Sk, C], already checked) for key blocks of block_n
// columns and, when block_m > 0, the forward's tile order for query tiles of block_m rows. Taken
// from the cache when the same tensor, unchanged, was seen with the same shapes on this stream;
// computed on `stream` (the current stream) otherwise. The cache is skipped while the stream
// captures a CUDA graph, for inference tensors (no version counter) and when the environment
// variable FLASHMASK_MASK_CACHE is 0.
MaskMeta mask_metadata(const at::Tensor& user_mask, bool causal, int sq, int block_m, int block_n,
                       cudaStream_t stream);

// (hits, misses) since the last clear; calls that skip the cache count as neither.
std::pair<int64_t, int64_t> mask_cache_stats();
// Drops every entry (their GPU memory returns to the caching allocator) and zeroes the counts.
void mask_cache_clear();

}  // namespace flashmask
