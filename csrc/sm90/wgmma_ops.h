// Register views of wgmma fragments and the wgmma issue loop of the SM90 kernels.
#pragma once
#include <cute/tensor.hpp>

#include "common/convert.h"

namespace flashmask::sm90 {
using namespace cute;

// A wgmma accumulator ((2 cols, 2 row halves, N/8), MMA_M, MMA_N) seen as (rows, cols) =
// ((2, MMA_M), (2, N/8, MMA_N)): each thread's rows, as the softmax and the mask walk them.
template <typename Layout>
__forceinline__ __device__ constexpr auto rowcol_layout(Layout l) {
    static_assert(decltype(rank(get<0>(l)))::value == 3);
    auto v = get<0>(l);
    return make_layout(make_layout(get<1>(v), get<1>(l)), make_layout(get<0>(v), get<2>(v), get<2>(l)));
}

template <typename T>
__forceinline__ __device__ auto rowcol(T&& t) {
    return make_tensor(t.data(), rowcol_layout(t.layout()));
}

// The accumulator of S = Q K^T, once converted to 16-bit, holds the registers of the A operand of
// O += P V: ((2, 2, N/8), MMA_M, 1) -> ((2, 2, 2), MMA_M, N/16).
template <typename Layout>
__forceinline__ __device__ constexpr auto acc_as_a_layout(Layout l) {
    auto v = logical_divide(get<0>(l), Shape<Underscore, Underscore, _2>{});  // (2, 2, (2, N/16))
    return make_layout(make_layout(get<0>(v), get<1>(v), get<2, 0>(v)), get<1>(l),
                       coalesce(make_layout(get<2, 1>(v), get<2>(l))));
}

// acc (+)= A B as one batch of wgmma over the k slices of A and B; A from shared memory
// (descriptors) or registers. The caller waits (warpgroup_wait) before reading acc.
template <bool kZeroInit, typename TiledMma, typename TA, typename TB, typename TC>
__forceinline__ __device__ void wgmma_gemm(TiledMma& mma, TA const& a, TB const& b, TC& acc) {
    // Shared-memory operands arrive as wgmma descriptors; anything else is a register fragment.
    constexpr bool kARegisters = !is_same_v<typename TA::iterator, GMMA::DescriptorIterator>;
    if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TA&>(a));
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(a); ++k) {
        cute::gemm(mma, a(_, _, k), b(_, _, k), acc);
        mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(acc);
    if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TA&>(a));
}

}  // namespace flashmask::sm90
