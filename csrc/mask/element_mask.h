// The element-wise mask of a partially masked tile: its key columns' raw interval values staged in
// shared memory, and the compare on a (rows, cols) view of the score accumulator. Architecture
// neutral: a kernel passes its accumulator and the matching identity partition as (rows, cols).
#pragma once
#include <cute/tensor.hpp>

#include "common/cp_async.h"
#include "mask/block_walk.h"
#include "mask/intervals.h"

namespace flashmask {

// Starts the asynchronous copy of the raw [BlockN, C] mask columns of the key block at c0 into
// shared memory (part of the caller's next cp.async group).
template <int kBlockN, int kMaskC, int kNThreads>
__device__ __forceinline__ void stage_mask_columns(int* smem_mask, const int* mask_cols, int c0, int sk, int tidx) {
    const int* src = mask_cols + int64_t(c0) * kMaskC;
    const int valid = min(kBlockN, sk - c0) * kMaskC;
    for (int i = tidx; i < kBlockN * kMaskC; i += kNThreads) {
        cp_async_4(smem_mask + i, i < valid ? src + i : mask_cols, i < valid);
    }
}

// Sets the masked scores of a tile to -inf, testing only what the tile needs: kIntervals (the
// column intervals, from the raw values staged in smem_mask) and kEdges (causal diagonal, key end).
// s and coords are (rows, cols) views of the score accumulator and of its identity partition:
// rows are queries and cols keys, or the other way round with kKeyRows (a transposed S^T = K Q^T,
// as a key-stationary backward computes it). r0 and c0 are the tile's first query and first key.
template <bool Is_causal, int kMaskC, bool kIntervals, bool kEdges, bool kKeyRows, typename S, typename Coords>
__device__ __forceinline__ void mask_scores_with(S& s, Coords const& coords, int r0, int c0, int sk,
                                                 int causal_offset, const int* smem_mask) {
    constexpr int kKeyMode = kKeyRows ? 0 : 1;  // the outer loop runs over keys: one read of each key's values
    CUTE_UNROLL
    for (int ki = 0; ki < cute::size<kKeyMode>(s); ++ki) {
        const int c = cute::get<kKeyMode>(kKeyRows ? coords(ki, 0) : coords(0, ki));
        const int col = c0 + c;
        int vals[kMaskC > 0 ? kMaskC : 1] = {};
        if constexpr (kIntervals) {
            CUTE_UNROLL
            for (int v = 0; v < kMaskC; ++v) vals[v] = smem_mask[c * kMaskC + v];
        }
        CUTE_UNROLL
        for (int qi = 0; qi < cute::size<1 - kKeyMode>(s); ++qi) {
            const int row = r0 + cute::get<1 - kKeyMode>(kKeyRows ? coords(0, qi) : coords(qi, 0));
            bool masked = false;
            if constexpr (kEdges) masked = col >= sk || (Is_causal && col > row + causal_offset);
            if constexpr (kIntervals) masked |= row_masked<Is_causal, kMaskC>(vals, row);
            if (masked) {
                if constexpr (kKeyRows) s(ki, qi) = -INFINITY;
                else s(qi, ki) = -INFINITY;
            }
        }
    }
}

template <bool Is_causal, int kMaskC, bool kKeyRows = false, typename S, typename Coords>
__device__ __forceinline__ void mask_scores(S& s, Coords const& coords, const TileCompare& t, int r0, int c0, int sk,
                                            int causal_offset, const int* smem_mask) {
    if constexpr (kMaskC > 0) {
        if (t.intervals) {
            if (t.edges) {
                mask_scores_with<Is_causal, kMaskC, true, true, kKeyRows>(s, coords, r0, c0, sk, causal_offset, smem_mask);
            } else {
                mask_scores_with<Is_causal, kMaskC, true, false, kKeyRows>(s, coords, r0, c0, sk, causal_offset,
                                                                           smem_mask);
            }
            return;
        }
    }
    mask_scores_with<Is_causal, kMaskC, false, true, kKeyRows>(s, coords, r0, c0, sk, causal_offset, smem_mask);
}

}  // namespace flashmask
