// The slice of the mask a (batch, query head) reads: its mask head's column intervals and their
// per-key-block bounds. Mask head for query head h is h / (Hq / Hm), shared by every kernel.
#pragma once
#include <cstdint>

#include "common/params.h"
#include "mask/intervals.h"

namespace flashmask {

struct MaskHead {
    const int* bounds;  // [n_key_blocks, 8], or nullptr without a mask
    const int* cols;    // [Sk, C] raw values, or nullptr
};

__device__ __forceinline__ MaskHead mask_head(const AttnParams& p, int b, int h) {
    if (p.mask == nullptr) return {nullptr, nullptr};
    const int64_t mh = int64_t(b) * p.hm + h / p.q_per_mask_head;
    return {p.bounds + mh * p.n_key_blocks * kNumBounds, p.mask + mh * p.sk * p.mask_c};
}

// Whether the mask, with the causal alignment, hides every key from query row `row` (rows past Sq,
// a tile's padding, count as hidden): such a row is empty by design (output 0, LSE +inf); one that
// sees keys yet ends empty met only -inf scores.
__device__ __forceinline__ bool row_hidden(const AttnParams& p, int b, int h, int row) {
    if (row >= p.sq) return true;
    if (p.keys_seen != nullptr) return p.keys_seen[(int64_t(b) * p.hm + h / p.q_per_mask_head) * p.sq + row] == 0;
    return p.sk == 0 || (p.causal && row + p.sk - p.sq < 0);
}

// Where the downward key walk of query tile m_block (of m_tiles, in the forward's tile shape) may
// stop: the lowest key block the tile sees, from the mask metadata; 0 where there is none.
__device__ __forceinline__ int tile_floor(const AttnParams& p, int b, int h, int m_block, int m_tiles) {
    if (p.tile_floor == nullptr) return 0;
    return p.tile_floor[(int64_t(b) * p.hm + h / p.q_per_mask_head) * m_tiles + m_block];
}

}  // namespace flashmask
