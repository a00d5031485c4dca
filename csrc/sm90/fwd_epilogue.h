// The SM90 forward's output store. Each consumer warpgroup writes its 64 rows, converted to 16
// bits, into its own shared-memory buffer (stmatrix), and one of its threads hands the buffer to
// the TMA unit, which clips rows past Sq. The warpgroup goes on to its next job while the store
// runs; only its next epilogue waits for the store to have read the buffer. The LSE goes out from
// registers (one float per row).
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/convert.h"
#include "common/params.h"

namespace flashmask::sm90 {
using namespace cute;

template <typename Traits>
struct FwdEpilogue {
    using Element = typename Traits::Element;
    using TileHalf = Shape<_64, Int<Traits::kHeadDim>>;  // one consumer warpgroup's rows
    static constexpr int kHalfElems = cosize_v<typename Traits::SmemLayoutOHalf>;

    // acc_o: the normalised output of the calling thread (a TiledMmaPV accumulator); barrier_id:
    // a named barrier of the calling warpgroup's 128 threads alone.
    template <typename TmaO, typename Acc, typename TiledMma>
    __device__ static void store(const TmaO& tma_o, const AttnParams& p, Acc const& acc_o, TiledMma const& mma_pv,
                                 Element* smem_o, int m_block, int h, int b, int ctid, int barrier_id) {
        const int cwg = ctid / 128;
        const bool leader = ctid % 128 == 0;
        // The previous job's store must have read the buffer before it is overwritten.
        if (leader) tma_store_wait<0>();
        cutlass::arch::NamedBarrier::sync(128, barrier_id);

        Tensor sO = make_tensor(make_smem_ptr(smem_o), typename Traits::SmemLayoutO{});
        auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_pv);
        auto thr = r2s.get_thread_slice(ctid);
        Tensor rO = convert_to<Element>(acc_o);
        copy(r2s, thr.retile_S(rO), thr.partition_D(sO));
        // Generic-proxy writes made visible to the TMA unit (async proxy), then to the leader.
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(128, barrier_id);

        const int row_tile = m_block * Traits::kConsumerWarpgroups + cwg;
        if (leader && row_tile * 64 < p.sq) {
            Tensor mO = tma_o.get_tma_tensor(make_shape(p.sq, p.d, p.hq, p.b));
            Tensor gO = local_tile(mO(_, _, h, b), TileHalf{}, make_coord(row_tile, _0{}));
            Tensor sHalf = make_tensor(make_smem_ptr(smem_o + cwg * kHalfElems), typename Traits::SmemLayoutOHalf{});
            auto [tOg, tOs] = tma_partition(tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sHalf), group_modes<0, 2>(gO));
            copy(tma_o, tOs, tOg);
            tma_store_arrive();
        }
    }

    // Before the CTA exits: its stores must have finished reading shared memory.
    __device__ static void drain(int ctid) {
        if (ctid % 128 == 0) tma_store_wait<0>();
    }
};

}  // namespace flashmask::sm90
