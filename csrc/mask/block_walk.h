// Which tiles of the (query block x key block) grid a CTA must visit, from the causal bound and
// the per-key-block interval bounds, and which of those need the element-wise compare. Both
// architectures walk their blocks with these helpers; they know the tile sizes only as template
// arguments.
#pragma once
#include "mask/intervals.h"

namespace flashmask {

struct TileCompare {
    bool intervals;  // the column intervals cut the tile partly: test them per element
    bool edges;      // the causal diagonal or the end of the keys crosses the tile
    bool any;        // some element needs a test
};

__device__ __forceinline__ TileCompare tile_compare(const int* bnd, int r0, int r1, int c0, int block_n, int sk,
                                                    bool causal, int causal_offset) {
    TileCompare t{false, c0 + block_n > sk, false};                // keys past the end
    if (causal) t.edges |= c0 + block_n - 1 > r0 + causal_offset;  // crosses the diagonal
    if (bnd != nullptr) t.intervals = classify_tile(bnd, r0, r1).partial;
    t.any = t.intervals || t.edges;
    return t;
}

// The first query block of block_m rows that sees key c0 under the causal bound (causal_offset =
// Sk - Sq: row r sees keys up to r + causal_offset), at most m_end; shared by QueryBlockWalk and the
// backward's work count (mask/bounds.cu).
__device__ __forceinline__ int causal_query_block_begin(int c0, int causal_offset, int block_m, int m_end) {
    const int first_row = c0 - causal_offset;
    return first_row <= 0 ? 0 : min(first_row / block_m, m_end);
}

// The 8 bounds of one key block, held in registers.
struct BlockBounds {
    int v[kNumBounds];
};

__device__ __forceinline__ BlockBounds load_bounds(const int* row) {  // rows are 32-byte aligned
    const int4 a = reinterpret_cast<const int4*>(row)[0];
    const int4 c = reinterpret_cast<const int4*>(row)[1];
    return {{a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w}};
}

// The highest key block in [floor, top] that rows [r0, r1) see, or -1; bounds: the head's
// [n_key_blocks, 8]. Below a masked block there are often long masked runs (other documents, keys
// outside a window), so each lane classifies kPerLane of the next 32 * kPerLane blocks at once: a
// run costs one round of loads per 32 * kPerLane blocks instead of one dependent load per block.
// Whole warps only (uniform control flow).
template <int kPerLane>
__device__ __forceinline__ int highest_visible_block(const int* bounds, int top, int floor, int r0, int r1) {
    const int lane = threadIdx.x % 32;
    for (; top >= floor; top -= 32 * kPerLane) {
        bool seen[kPerLane];
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            const int cand = top - 32 * i - lane;
            seen[i] = cand >= floor && !classify_tile(load_bounds(bounds + cand * kNumBounds).v, r0, r1).fully_masked;
        }
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            const unsigned ballot = __ballot_sync(0xffffffffu, seen[i]);
            if (ballot != 0u) return top - 32 * i - (__ffs(ballot) - 1);
        }
    }
    return -1;
}

// Forward and dQ: a query tile [r0, r1) walks key blocks downwards. Callers fetch a block's
// bounds (bounds_of) well before they need them, so that the load hides behind a GEMM.
template <int kBlockN, bool Is_causal, bool Has_mask>
struct KeyBlockWalk {
    const int* bounds;  // this (batch, mask head)'s [n_key_blocks, 8], or nullptr
    int r0, r1, sk, causal_offset;
    int n_floor = 0;  // the walk stops below this block: the lowest the tile sees (tile_floor), or a split's start

    // Split-KV: narrows the walk to share `split` of `num_splits` equal shares of the blocks
    // [n_floor, n_end) the tile may see, and returns the share's end.
    __device__ int take_split(int n_end, int split, int num_splits) {
        const int per_split = max(0, (n_end - n_floor + num_splits - 1) / num_splits);
        n_floor += split * per_split;
        return min(n_end, n_floor + per_split);
    }

    __device__ BlockBounds bounds_of(int n) const {
        return Has_mask && n >= n_floor ? load_bounds(bounds + n * kNumBounds) : BlockBounds{};
    }

    // One past the last key block any row of the tile may see.
    __device__ int end() const {
        int n = (sk + kBlockN - 1) / kBlockN;
        if (Is_causal) {
            const int last_key = r1 - 1 + causal_offset;
            n = last_key < 0 ? 0 : min(n, last_key / kBlockN + 1);
        }
        return n;
    }
    // The largest visible block in [n_floor, n], or -1; `b` holds block n's bounds and is left
    // holding the result's. Must be called by whole warps (uniform control flow).
    __device__ int visible_at_or_below(int n, BlockBounds& b) const {
        if (n < n_floor) return -1;
        if (!Has_mask || !classify_tile(b.v, r0, r1).fully_masked) return n;
        n = highest_visible_block<1>(bounds, n - 1, n_floor, r0, r1);
        if (n >= 0) b = bounds_of(n);
        return n;
    }
    __device__ TileCompare compare(int n, const BlockBounds& b) const {
        return tile_compare(Has_mask ? b.v : nullptr, r0, r1, n * kBlockN, kBlockN, sk, Is_causal, causal_offset);
    }
    // Rows [g0, g1) of the tile (a consumer warpgroup's share) against visible block n: whether
    // any of them sees the block, and what their compare needs. A window's first and last blocks
    // are often seen by part of a tall tile only.
    __device__ bool rows_see(int n, const BlockBounds& b, int g0, int g1) const {
        g1 = min(g1, r1);
        if (g0 >= g1) return false;
        if (Is_causal && n * kBlockN > g1 - 1 + causal_offset) return false;
        return !Has_mask || !classify_tile(b.v, g0, g1).fully_masked;
    }
    __device__ TileCompare rows_compare(int n, const BlockBounds& b, int g0, int g1) const {
        return tile_compare(Has_mask ? b.v : nullptr, g0, min(g1, r1), n * kBlockN, kBlockN, sk, Is_causal,
                            causal_offset);
    }
};

// dK/dV: a key block [c0, c0 + BlockN) walks query blocks upwards, jumping over runs of rows that
// one interval masks for every column of the block.
template <int kBlockM, int kBlockN, bool Is_causal, bool Has_mask>
struct QueryBlockWalk {
    const int* bnd;  // this key block's 8 bounds (unused without a mask)
    int c0, sq, sk, causal_offset, m_end;

    __device__ int begin() const { return Is_causal ? causal_query_block_begin(c0, causal_offset, kBlockM, m_end) : 0; }
    // Whether one interval masks every row of query block m for every column of the key block;
    // if so, [start, end) are the rows it masks for all of them.
    __device__ bool hidden(int m, int& start, int& end) const {
        const int r0 = m * kBlockM, r1 = min(r0 + kBlockM, sq);
        if (r0 >= bnd[kLtsMax] && r1 <= bnd[kLteMin]) {
            start = bnd[kLtsMax];
            end = bnd[kLteMin];
            return true;
        }
        if (r0 >= bnd[kUtsMax] && r1 <= bnd[kUteMin]) {
            start = bnd[kUtsMax];
            end = bnd[kUteMin];
            return true;
        }
        return false;
    }
    // The smallest visible block >= m, or m_end: a hidden block is left past its interval's end.
    __device__ int visible_at_or_above(int m) const {
        int start, end;
        if (Has_mask) {
            while (m < m_end && hidden(m, start, end)) m = max(m + 1, end / kBlockM);
        }
        return min(m, m_end);
    }
    // The largest visible block in [begin(), m], or -1 (the SM90 deterministic backward walks down):
    // a hidden block is left below its interval's start.
    __device__ int visible_at_or_below(int m) const {
        const int lo = begin();
        int start, end;
        if (Has_mask) {
            while (m >= lo && hidden(m, start, end)) m = min(m - 1, (max(start, 0) + kBlockM - 1) / kBlockM - 1);
        }
        return m >= lo ? m : -1;
    }
    // Deterministic dQ: the key block below this one that sees query block m (a block this walk
    // visits) last before it, or -1: the test of visible_at_or_above, made from the query side. A
    // lower block passes the causal bound wherever this one does. Mostly the block just below; past
    // a window's or a document's edge the answer is far down or none, and the search there takes
    // four blocks per lane (a dQ turn waits on it). The whole warp must call it.
    __device__ int previous_visitor(int m) const {
        const int n = c0 / kBlockN;
        if (!Has_mask || n == 0) return n - 1;
        const int r0 = m * kBlockM, r1 = min(r0 + kBlockM, sq);
        const int* const head = bnd - n * kNumBounds;
        if (!classify_tile(head + (n - 1) * kNumBounds, r0, r1).fully_masked) return n - 1;  // the usual answer
        return highest_visible_block<4>(head, n - 2, 0, r0, r1);
    }
    __device__ TileCompare compare(int m) const {
        const int r0 = m * kBlockM;
        return tile_compare(Has_mask ? bnd : nullptr, r0, min(r0 + kBlockM, sq), c0, kBlockN, sk, Is_causal,
                            causal_offset);
    }
};

}  // namespace flashmask
