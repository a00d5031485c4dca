// Register-tile building blocks shared by the kernels: layout views of MMA fragments, GEMM loops
// over shared memory, predicated global->shared copies and the output store.
#pragma once
#include <cute/tensor.hpp>

#include "common/convert.h"

namespace flashmask::sm80 {
using namespace cute;

// An SM80 accumulator fragment ((2 cols, 2 row halves), MMA_M, MMA_N) seen as (rows, cols) =
// ((2, MMA_M), (2, MMA_N)), so that softmax can walk rows.
template <typename Layout>
__forceinline__ __device__ constexpr auto rowcol_layout(Layout l) {
    static_assert(decltype(rank(l))::value == 3);
    auto v = get<0>(l);
    return make_layout(make_layout(get<1>(v), get<1>(l)), make_layout(get<0>(v), get<2>(l)));
}

template <typename Tensor>
__forceinline__ __device__ auto rowcol(Tensor&& t) {
    return make_tensor(t.data(), rowcol_layout(t.layout()));
}

// Two neighbouring n8 accumulator tiles hold exactly the registers of one k16 A-operand tile:
// ((2,2), MMA_M, MMA_N) -> ((2,2,2), MMA_M, MMA_N/2). Lets P feed P*V straight from registers.
template <typename Layout>
__forceinline__ __device__ constexpr auto acc_as_a_layout(Layout l) {
    auto d = logical_divide(l, Shape<Underscore, Underscore, _2>{});
    return make_layout(make_layout(get<0, 0>(d), get<0, 1>(d), get<2, 0>(d)), get<1>(d), get<2, 1>(d));
}

// acc += A * B with both operands read from shared memory by ldmatrix, one k-slice ahead of the MMAs.
template <typename Acc, typename RA, typename RB, typename SA, typename SB, typename TiledMma, typename CopyA,
          typename CopyB, typename ThrCopyA, typename ThrCopyB>
__forceinline__ __device__ void gemm_ss(Acc& acc, RA& rA, RB& rB, SA const& sA, SB const& sB, TiledMma const& mma,
                                        CopyA const& copy_a, CopyB const& copy_b, ThrCopyA const& thr_a,
                                        ThrCopyB const& thr_b) {
    Tensor rA_view = thr_a.retile_D(rA);
    Tensor rB_view = thr_b.retile_D(rB);
    copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
    copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
    CUTE_UNROLL
    for (int k = 0; k < size<2>(rA); ++k) {
        if (k + 1 < size<2>(rA)) {
            copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
            copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
        }
        gemm(mma, rA(_, _, k), rB(_, _, k), acc);
    }
}

// acc += A * B with A already in registers and B read from shared memory.
template <typename Acc, typename RA, typename RB, typename SB, typename TiledMma, typename CopyB, typename ThrCopyB>
__forceinline__ __device__ void gemm_rs(Acc& acc, RA const& rA, RB& rB, SB const& sB, TiledMma const& mma,
                                        CopyB const& copy_b, ThrCopyB const& thr_b) {
    Tensor rB_view = thr_b.retile_D(rB);
    copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
    CUTE_UNROLL
    for (int k = 0; k < size<2>(rA); ++k) {
        if (k + 1 < size<2>(rA)) copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
        gemm(mma, rA(_, _, k), rB(_, _, k), acc);
    }
}

// Copies a (rows, cols) tile partitioned by a zero-filling cp.async TiledCopy: vectors whose row is
// >= max_rows or whose column is >= max_cols are not read and land as zeros in shared memory.
template <typename TiledCopy, typename Src, typename Dst, typename Coords>
__forceinline__ __device__ void copy_zfill(TiledCopy const& tiled_copy, Src const& src, Dst&& dst, Coords const& coords,
                                           int max_rows, int max_cols) {
    CUTE_UNROLL
    for (int m = 0; m < size<1>(src); ++m) {
        CUTE_UNROLL
        for (int k = 0; k < size<2>(src); ++k) {
            const auto c = coords(0, m, k);
            const bool in = get<0>(c) < max_rows && get<1>(c) < max_cols;
            copy(tiled_copy.with(in), src(_, m, k), dst(_, m, k));
        }
    }
}

// Writes a register accumulator tile to global memory through shared memory `sTile` (which the
// caller must have freed): fragments -> shared in 4-byte pairs, barrier, then 16-byte coalesced
// stores of the rows < max_rows and columns < max_cols.
template <typename SmemCopyAtom, typename GmemTiledCopy, typename Element, typename Acc, typename TiledMma,
          typename STile, typename GTile>
__forceinline__ __device__ void store_tile(Acc const& acc, TiledMma const& mma, STile& sTile, GTile& gTile,
                                           int max_rows, int max_cols, int tidx) {
    auto smem_copy = make_tiled_copy_C(SmemCopyAtom{}, mma);
    auto smem_thr = smem_copy.get_thread_slice(tidx);
    Tensor r = convert_to<Element>(acc);
    copy(smem_copy, smem_thr.retile_S(r), smem_thr.partition_D(sTile));
    __syncthreads();
    GmemTiledCopy gmem_copy;
    auto gmem_thr = gmem_copy.get_thread_slice(tidx);
    Tensor src = gmem_thr.partition_S(sTile);
    Tensor dst = gmem_thr.partition_D(gTile);
    Tensor coords = gmem_thr.partition_D(make_identity_tensor(shape(gTile)));
    CUTE_UNROLL
    for (int m = 0; m < size<1>(dst); ++m) {
        CUTE_UNROLL
        for (int k = 0; k < size<2>(dst); ++k) {
            const auto c = coords(0, m, k);
            if (get<0>(c) < max_rows && get<1>(c) < max_cols) copy(gmem_copy, src(_, m, k), dst(_, m, k));
        }
    }
}

}  // namespace flashmask::sm80
