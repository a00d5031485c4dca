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

}  // namespace flashmask
