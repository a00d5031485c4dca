// Mask metadata computed once per mask and reused: the same mask tensor goes through every layer
// of a step (24-80 forwards and as many backwards), and its metadata depends only on the mask's
// contents and the call's shape, not on q, k, v.
#pragma once
#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace flashmask {

// Which job list a launch takes (MaskMeta::jobs): none; the persistent forward's query tiles; the
// SM90 backward's key blocks, heaviest first; or, for its deterministic mode, its key blocks in
// turn (each head's ascending, the order its dQ additions follow).
enum class Jobs { none, query_tiles, key_blocks, key_blocks_in_turn };

// What a call needs from its mask.
struct MaskMeta {
    at::Tensor mask;    // contiguous int32 [B, Hm, Sk, C]
    at::Tensor bounds;  // [B, Hm, ceil(Sk / block_n), kNumBounds]: per-key-block min/max (mask/bounds.h)
    at::Tensor order;   // int32 [B * Hm, ceil(Sq / block_m)]: query tiles longest first; only if block_m > 0
    // int32 [B * Hm, ceil(Sq / block_m)]: the lowest key block each query tile sees (n_key_blocks if
    // none), where the forward's downward walk stops; with order.
    at::Tensor floor;
    // A job list, int32 [B * Hq * tiles] of (b * Hq + h) * tiles + tile: every (tile, head, batch) job,
    // heaviest work first in buckets within a factor sqrt(2) of each other, and within a bucket by
    // batch, head and decreasing work, so that CTAs in flight together share few heads (what they
    // stream stays in L2). The tiles are the forward's query tiles (the persistent forward draws jobs
    // in this order) or, with key_blocks, the backward's key blocks (its launch order), weighed by
    // the query blocks of block_m rows that see them. In turn (Jobs::key_blocks_in_turn): the launch
    // order of heads interleaved in groups and key blocks ascending, the group chosen on the device
    // from the mask (compute_turn_jobs in mask_cache.cpp). Only if block_m > 0 and jobs != none.
    at::Tensor jobs;
    // int32 [B, Hm, Sq]: how many keys each query row may attend (0: the mask hides it); only if
    // asked for (the forward, which tells a hidden row from one that met only -inf scores).
    at::Tensor keys_seen;
};

// The metadata of `user_mask` (int32 [B, Hm, Sk, C], already checked) for key blocks of block_n
// columns and, when block_m > 0, the forward's tile order for query tiles of block_m rows (not with
// the backward's key block jobs) and the job list `jobs` for hq query heads; with `keys_seen`, the
// per-row key counts. Taken from the cache when the same tensor, unchanged, was seen with the same
// shapes on this stream; computed on `stream` (the current stream) otherwise. The cache is skipped
// while the stream captures a CUDA graph, for inference tensors (no version counter) and when the
// environment variable FLASHMASK_MASK_CACHE is 0 (read once, at the first call with a mask).
MaskMeta mask_metadata(const at::Tensor& user_mask, bool causal, int sq, int block_m, int block_n, int hq, Jobs jobs,
                       bool keys_seen, cudaStream_t stream);

// (hits, misses) since the last clear; calls that skip the cache count as neither.
std::pair<int64_t, int64_t> mask_cache_stats();
// Drops every entry (their GPU memory returns to the caching allocator) and zeroes the counts.
void mask_cache_clear();

}  // namespace flashmask
