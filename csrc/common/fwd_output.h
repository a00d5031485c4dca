// Where and how a forward CTA writes its query tile, on (rows, cols) views of its accumulator that
// either architecture provides: the output and LSE, a split-KV partial result in fp32, or the zeros
// and +inf (or the sink) of a tile that no key reaches. Both kernels stage the output itself through shared
// memory (sm80/fwd_epilogue.h, sm90/tile_store.h); the LSE, the split-KV partial results and the
// empty tiles are written here.
#pragma once
#include <cute/tensor.hpp>

#include "common/params.h"

namespace flashmask {

// Where a (batch, head, split) writes its rows: the output (or the fp32 partial output of a split)
// and the LSE (or the split's partial LSE).
template <typename Element>
struct FwdOutput {
    Element* o;     // row 0 of this (batch, head) in p.o
    float* o_part;  // split-KV: row 0 of this split's [Sq, Dv] partial output, else nullptr
    float* lse;     // row 0 of the LSE (or the split's partial LSE)
    int64_t row_stride;
    int d;  // the value head dim: the columns of O
    // The head's sink logit for the softmax's denominator (-inf: none; a split leaves it to the
    // merge, which adds it once).
    float sink;

    __forceinline__ __device__ FwdOutput(const AttnParams& p, int b, int h, int split_idx) {
        const bool split = p.num_splits > 1;
        const int64_t row_base = (int64_t(split_idx) * p.b * p.hq + int64_t(b) * p.hq + h) * p.sq;
        o = static_cast<Element*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride;
        o_part = split ? p.o_partial + row_base * p.d_v : nullptr;
        lse = (split ? p.lse_partial : p.lse) + row_base;
        row_stride = p.o_row_stride;
        d = p.d_v;
        sink = !split && p.sinks != nullptr ? p.sinks[h] : -INFINITY;
    }

    // Rows [r0, r1) see no key: output 0 and LSE +inf, or the sink where there is one (in a split,
    // -inf: it adds nothing to the merge).
    __forceinline__ __device__ void write_empty(int r0, int r1, int tidx, int threads) const {
        for (int i = tidx; i < (r1 - r0) * d; i += threads) {
            const int row = r0 + i / d, col = i % d;
            if (o_part != nullptr)
                o_part[int64_t(row) * d + col] = 0.f;
            else
                o[row * row_stride + col] = Element(0.f);
        }
        const float empty_lse = o_part != nullptr ? -INFINITY : sink == -INFINITY ? INFINITY : sink;
        for (int r = r0 + tidx; r < r1; r += threads) lse[r] = empty_lse;
    }

    // A split's normalised partial output stays fp32, written from registers. o_rc and coords are
    // (rows, cols) views of the accumulator and its identity partition; lse per register row.
    template <typename O, typename Coords>
    __forceinline__ __device__ void write_partial(O const& o_rc, Coords const& coords, const float* row_lse, int r0,
                                                  int r1, int tidx) const {
        CUTE_UNROLL
        for (int mi = 0; mi < cute::size<0>(o_rc); ++mi) {
            const int row = r0 + cute::get<0>(coords(mi, 0));
            if (row >= r1) continue;
            CUTE_UNROLL
            for (int di = 0; di < cute::size<1>(o_rc); ++di) {
                const int col = cute::get<1>(coords(mi, di));
                if (col < d) o_part[int64_t(row) * d + col] = o_rc(mi, di);
            }
        }
        store_lse</*kSplit=*/true>(coords, row_lse, r0, r1, tidx);
    }

    // The normalised output straight from registers, two adjacent columns per 4-byte store (the
    // accumulators hold columns in pairs; the binding guarantees even strides and a 16-byte base).
    template <typename O, typename Coords>
    __forceinline__ __device__ void write_rows(O const& o_rc, Coords const& coords, int r0, int r1) const {
        CUTE_UNROLL
        for (int mi = 0; mi < cute::size<0>(o_rc); ++mi) {
            const int row = r0 + cute::get<0>(coords(mi, 0));
            if (row >= r1) continue;
            CUTE_UNROLL
            for (int di = 0; di < cute::size<1>(o_rc); di += 2) {
                const int col = cute::get<1>(coords(mi, di));
                if (col >= d) continue;
                cute::array<Element, 2> pair;
                pair[0] = Element(o_rc(mi, di));
                pair[1] = Element(o_rc(mi, di + 1));
                *reinterpret_cast<uint32_t*>(o + int64_t(row) * row_stride + col) =
                    *reinterpret_cast<const uint32_t*>(pair.data());
            }
        }
    }

    // The LSE of the rows this thread holds, from the first lane of each quad.
    template <typename Coords>
    __forceinline__ __device__ void write_lse(Coords const& coords, const float* row_lse, int r0, int r1,
                                              int tidx) const {
        store_lse</*kSplit=*/false>(coords, row_lse, r0, r1, tidx);
    }

private:
    // The LSE of rows [r0, r1) from the first lane of each quad; a split's +inf (a row no key of the
    // split reaches) is written -inf, so that it adds nothing to the merge.
    template <bool kSplit, typename Coords>
    __forceinline__ __device__ void store_lse(Coords const& coords, const float* row_lse, int r0, int r1,
                                              int tidx) const {
        if (tidx % 4 != 0) return;
        CUTE_UNROLL
        for (int mi = 0; mi < cute::size<0>(coords); ++mi) {
            const int row = r0 + cute::get<0>(coords(mi, 0));
            if (row >= r1) continue;
            lse[row] = kSplit && row_lse[mi] == INFINITY ? -INFINITY : row_lse[mi];
        }
    }
};

}  // namespace flashmask
