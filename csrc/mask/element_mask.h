// The element-wise mask of a partially masked tile: its key columns' raw interval values staged in
// shared memory, and the compare on a (rows, cols) view of the score accumulator. Architecture
// neutral: a kernel passes its accumulator and the matching identity partition as (rows, cols).
#pragma once
#include <cute/tensor.hpp>
#include <type_traits>

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

// Sets the masked scores of key column ki of the thread's share of a tile to -inf (ki indexes the
// keys of the (rows, cols) view: its cols, or its rows with kKeyRows), testing only what the tile
// needs: kIntervals (the column intervals, from the raw values staged in smem_mask) and kEdges
// (causal diagonal, key end). s and coords are (rows, cols) views of the score accumulator and of its
// identity partition: rows are queries and cols keys, or the other way round with kKeyRows (a
// transposed S^T = K Q^T, as a key-stationary backward computes it). r0 and c0 are the tile's first
// query and first key.
template <bool Is_causal, int kMaskC, bool kIntervals, bool kEdges, bool kKeyRows, typename S, typename Coords>
__device__ __forceinline__ void mask_key_column(S& s, Coords const& coords, int ki, int r0, int c0, int sk,
                                                int causal_offset, const int* smem_mask) {
    constexpr int kKeyMode = kKeyRows ? 0 : 1;
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
            if constexpr (kKeyRows)
                s(ki, qi) = -INFINITY;
            else
                s(qi, ki) = -INFINITY;
        }
    }
}

template <bool Is_causal, int kMaskC, bool kIntervals, bool kEdges, bool kKeyRows, typename S, typename Coords>
__device__ __forceinline__ void mask_scores_with(S& s, Coords const& coords, int r0, int c0, int sk, int causal_offset,
                                                 const int* smem_mask) {
    CUTE_UNROLL  // the outer loop runs over keys: one read of each key's values
        for (int ki = 0; ki < cute::size<kKeyRows ? 0 : 1>(s); ++ki) {
        mask_key_column<Is_causal, kMaskC, kIntervals, kEdges, kKeyRows>(s, coords, ki, r0, c0, sk, causal_offset,
                                                                         smem_mask);
    }
}

// The lanes (bit l) whose four keys 4l .. 4l + 3 of a 128-key tile are seen by all 16 query rows of
// the warp, and those whose four keys all of them miss (mask_scores_by_quarter).
template <bool Is_causal, int kMaskC, bool kIntervals, bool kEdges, typename Coords>
__device__ __forceinline__ void classify_quarters(Coords const& coords, int r0, int c0, int sk, int causal_offset,
                                                  const int* smem_mask, unsigned& seen_lanes, unsigned& hidden_lanes) {
    const int lane = threadIdx.x % 32;
    const int w0 = __shfl_sync(0xffffffffu, r0 + cute::get<0>(coords(0, 0)), 0), w1 = w0 + 15;
    bool seen = true, hidden = true;
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {
        const int c = 4 * lane + i, col = c0 + c;
        RowSpanMask m{false, true};
        if constexpr (kEdges) {
            m.all = col >= sk || (Is_causal && col > w1 + causal_offset);
            m.none = col < sk && (!Is_causal || col <= w0 + causal_offset);
        }
        if constexpr (kIntervals) {
            int vals[kMaskC];
            CUTE_UNROLL
            for (int v = 0; v < kMaskC; ++v) vals[v] = smem_mask[c * kMaskC + v];
            const RowSpanMask iv = rows_masked<Is_causal, kMaskC>(vals, w0, w1);
            m = {m.all || iv.all, m.none && iv.none};
        }
        seen &= m.none;
        hidden &= m.all;
    }
    seen_lanes = __ballot_sync(0xffffffffu, seen);
    hidden_lanes = __ballot_sync(0xffffffffu, hidden);
}

// The forward's compare of a 128-key tile by quarters, a warp at a time: each lane classifies four
// key columns against the warp's 16 query rows (rows_masked), and a ballot gathers each quarter of
// 32 keys; a quarter that no row of the warp has masked is skipped, one that masks them all is
// filled, and only the others are compared score by score. A window's or the diagonal's edge
// crosses a warp's rows within 16 keys, so most of a partial tile's quarters need no compare.
// Needs the thread layout of a 16-row mma.sync or wgmma accumulator (rows lane/4 and lane/4 + 8;
// keys 8j + 2 (lane % 4) + e, e in {0, 1}: the thread's key columns [8Q, 8Q + 8) are the tile's
// keys [32Q, 32Q + 32)).
template <bool Is_causal, int kMaskC, bool kIntervals, bool kEdges, typename S, typename Coords>
__device__ __forceinline__ void mask_scores_by_quarter(S& s, Coords const& coords, int r0, int c0, int sk,
                                                       int causal_offset, const int* smem_mask) {
    static_assert(decltype(cute::size<1>(s))::value == 32 && decltype(cute::size<0>(s))::value == 2,
                  "a 16-row accumulator's share of 128 keys");
    unsigned seen_lanes, hidden_lanes;
    classify_quarters<Is_causal, kMaskC, kIntervals, kEdges>(coords, r0, c0, sk, causal_offset, smem_mask, seen_lanes,
                                                             hidden_lanes);
    // Quarter q of the tile's keys (the thread's key columns [8q, 8q + 8)) was classified by lanes
    // [8q, 8q + 8). Filled in a pass of its own: with three ways per quarter ptxas kept every score
    // live across them (2 KB of spills at head dim 64). The empty asm keeps each fill a branch:
    // without it the fills became 64 selects that every partial tile ran.
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) {
        const unsigned lanes = 0xffu << (8 * q);
        if ((seen_lanes & lanes) != lanes && (hidden_lanes & lanes) != lanes) {
            CUTE_UNROLL
            for (int ki = 8 * q; ki < 8 * q + 8; ++ki) {
                mask_key_column<Is_causal, kMaskC, kIntervals, kEdges, false>(s, coords, ki, r0, c0, sk, causal_offset,
                                                                              smem_mask);
            }
        }
    }
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) {
        const unsigned lanes = 0xffu << (8 * q);
        if ((hidden_lanes & lanes) == lanes) {
            asm volatile("");
            CUTE_UNROLL
            for (int ki = 8 * q; ki < 8 * q + 8; ++ki) s(0, ki) = s(1, ki) = -INFINITY;
        }
    }
}

// kQuarters: the forward's compare by quarters (mask_scores_by_quarter); rows must be queries.
template <bool Is_causal, int kMaskC, bool kIntervals, bool kEdges, bool kKeyRows, bool kQuarters, typename S,
          typename Coords>
__device__ __forceinline__ void mask_tile(S& s, Coords const& coords, int r0, int c0, int sk, int causal_offset,
                                          const int* smem_mask) {
    if constexpr (kQuarters) {
        static_assert(!kKeyRows);
        mask_scores_by_quarter<Is_causal, kMaskC, kIntervals, kEdges>(s, coords, r0, c0, sk, causal_offset, smem_mask);
    } else {
        mask_scores_with<Is_causal, kMaskC, kIntervals, kEdges, kKeyRows>(s, coords, r0, c0, sk, causal_offset,
                                                                          smem_mask);
    }
}

// kQuarters: the causal diagonal and the key end by quarters, and the column intervals too where
// the producer found them tight (bounds_tight: their ends move little across the block, as along a
// window); intervals that jump from key to key (random eviction) cut every quarter, and there the
// quarters' ballots and branches would cost more than they skip.
template <bool Is_causal, int kMaskC, bool kKeyRows = false, bool kQuarters = false, typename S, typename Coords>
__device__ __forceinline__ void mask_scores(S& s, Coords const& coords, const TileCompare& t, int r0, int c0, int sk,
                                            int causal_offset, const int* smem_mask, bool tight = false) {
    if constexpr (kMaskC > 0) {
        if (t.intervals) {
            const auto with = [&](auto edges, auto quarters) {
                mask_tile<Is_causal, kMaskC, true, decltype(edges)::value, kKeyRows, decltype(quarters)::value>(
                    s, coords, r0, c0, sk, causal_offset, smem_mask);
            };
            if (kQuarters && tight) {
                if (t.edges)
                    with(std::true_type{}, std::bool_constant<kQuarters>{});
                else
                    with(std::false_type{}, std::bool_constant<kQuarters>{});
            } else {
                if (t.edges)
                    with(std::true_type{}, std::false_type{});
                else
                    with(std::false_type{}, std::false_type{});
            }
            return;
        }
    }
    mask_tile<Is_causal, kMaskC, false, true, kKeyRows, kQuarters>(s, coords, r0, c0, sk, causal_offset, smem_mask);
}

}  // namespace flashmask
