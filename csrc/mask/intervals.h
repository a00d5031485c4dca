// The FlashMask column-interval format as the kernels read it: one place that both architectures
// include. docs/format.md is the contract this file implements.
//
// Every (causal, C) mode is read as two masked row intervals per key column j:
//   lower [LTS[j], LTE[j])  and  upper [UTS[j], UTE[j]),
// with absent vectors given neutral values (LTE = Sq: "to the last row"; UTS = UTE = 0: empty).
// The causal triangle is handled separately by the kernels. Values outside [0, Sq] compare as if
// clamped to it, and an interval whose start is past its end masks nothing: both fall out of the
// comparisons below without a clamp.
#pragma once
#include <cstdint>

namespace flashmask {

enum Bound : int { kLtsMin = 0, kLtsMax, kLteMin, kLteMax, kUtsMin, kUtsMax, kUteMin, kUteMax, kNumBounds };

struct ColumnIntervals {
    int lts, lte, uts, ute;
};

// Reads column j of one (batch, mask head) slice `col` ([Sk, C] row-major) in canonical form.
__host__ __device__ inline ColumnIntervals read_column(const int* col, int j, int c, bool causal, int sq) {
    const int* v = col + int64_t(j) * c;
    if (causal) return {v[0], c == 2 ? v[1] : sq, 0, 0};
    if (c == 2) return {v[0], sq, 0, v[1]};
    return {v[0], v[1], v[2], v[3]};
}

// How the query rows [r0, r1) meet one key block, from that block's 8 bounds.
struct TileMask {
    bool fully_masked;  // every (row, column) pair is masked by one interval: skip the tile
    bool partial;       // some pair may be masked: run the element-wise compare
};

__host__ __device__ inline TileMask classify_tile(const int* b, int r0, int r1) {
    TileMask t;
    t.fully_masked = (r0 >= b[kLtsMax] && r1 <= b[kLteMin]) || (r0 >= b[kUtsMax] && r1 <= b[kUteMin]);
    t.partial = (r1 > b[kLtsMin] && r0 < b[kLteMax]) || (r1 > b[kUtsMin] && r0 < b[kUteMax]);
    return t;
}

// Whether the column intervals' ends move by at most `rows` across a key block, from its bounds:
// then a warp's 16 rows meet few of the block's keys on an interval's edge (a window's edges move
// one row per key), while ends that jump from key to key (random eviction) cut every part of it.
// Only a speed hint: the compare by quarters is exact whatever it says.
__host__ __device__ inline bool bounds_tight(const int* b, int rows) {
    return b[kLtsMax] - b[kLtsMin] <= rows && b[kLteMax] - b[kLteMin] <= rows && b[kUtsMax] - b[kUtsMin] <= rows &&
           b[kUteMax] - b[kUteMin] <= rows;
}

// Whether query row `row` is masked for a key column whose C raw values are `v`, in the
// (causal, C) mode fixed at compile time (the causal triangle is checked separately).
template <bool Is_causal, int kC>
__host__ __device__ __forceinline__ bool row_masked(const int (&v)[kC], int row) {
    if constexpr (Is_causal) {
        if constexpr (kC == 1)
            return row >= v[0];
        else
            return row >= v[0] && row < v[1];
    } else {
        if constexpr (kC == 2)
            return row >= v[0] || row < v[1];
        else
            return (row >= v[0] && row < v[1]) || (row >= v[2] && row < v[3]);
    }
}

// Whether the query rows [a, b] (inclusive) are all masked, or none, by a key column whose C raw
// values are `v`: row_masked's intervals tested against a span of rows at once, so that a warp can
// leave out the columns its rows need no compare for. An answer of neither is always safe: it only
// means the rows get compared one by one (a span on an interval's edge, or covered by two
// intervals together only).
struct RowSpanMask {
    bool all, none;
};
template <bool Is_causal, int kC>
__host__ __device__ __forceinline__ RowSpanMask rows_masked(const int (&v)[kC], int a, int b) {
    const auto within = [&](int lo, int hi) { return RowSpanMask{lo <= a && b < hi, b < lo || a >= hi}; };
    const auto from = [&](int lo) { return RowSpanMask{lo <= a, b < lo}; };
    const auto below = [&](int hi) { return RowSpanMask{b < hi, a >= hi}; };
    const auto either = [](RowSpanMask x, RowSpanMask y) { return RowSpanMask{x.all || y.all, x.none && y.none}; };
    if constexpr (Is_causal) {
        if constexpr (kC == 1)
            return from(v[0]);
        else
            return within(v[0], v[1]);
    } else {
        if constexpr (kC == 2)
            return either(from(v[0]), below(v[1]));
        else
            return either(within(v[0], v[1]), within(v[2], v[3]));
    }
}

// The query rows that may attend key column j, as at most three runs [lo[t], hi[t]) in ascending
// order: the rows [0, Sq) less the column's two intervals (clamped to [0, Sq]) and, with causal,
// the rows above the bottom-right aligned diagonal (row i sees key j iff j <= i + Sk - Sq). Returns
// the number of runs. The per-row key counts of the forward (mask/keys_seen.cu) sum these runs.
__host__ __device__ inline int visible_runs(const ColumnIntervals& iv, int j, bool causal, int sq, int sk, int (&lo)[3],
                                            int (&hi)[3]) {
    const auto clamp = [sq](int x) { return x < 0 ? 0 : x > sq ? sq : x; };
    // The hidden runs, sorted by start: the visible rows are the gaps between them.
    int a[3] = {0, clamp(iv.lts), clamp(iv.uts)};
    int b[3] = {causal ? clamp(j - (sk - sq)) : 0, clamp(iv.lte), clamp(iv.ute)};
    for (int i = 0; i < 2; ++i) {
        for (int t = 0; t < 2 - i; ++t) {
            if (a[t + 1] < a[t]) {
                const int x = a[t], y = b[t];
                a[t] = a[t + 1], b[t] = b[t + 1];
                a[t + 1] = x, b[t + 1] = y;
            }
        }
    }
    int runs = 0, seen_to = 0;  // rows below seen_to are hidden or already in a run
    for (int t = 0; t < 3; ++t) {
        if (b[t] <= a[t]) continue;
        if (a[t] > seen_to) lo[runs] = seen_to, hi[runs++] = a[t];
        seen_to = seen_to > b[t] ? seen_to : b[t];
    }
    if (seen_to < sq) lo[runs] = seen_to, hi[runs++] = sq;
    return runs;
}

}  // namespace flashmask
