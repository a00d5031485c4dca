// The SM90 backward's epilogue: dK (scaled by the softmax scale) and dV of a job's query-head
// slice leave by TMA store (tile_store.h) through the dQ buffer, one after the other, once the dQ
// warp that read the job's last dQ tile is done with it; a key block no query sees writes zeros.
// Before the buffer takes the next job's dQ, the TMA unit has read dV (the warpgroups of each
// row tile wait for its stores here, and the next dQ hand-over waits for all).
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/params.h"
#include "sm90/bwd_barriers.h"

namespace flashmask::sm90 {
using namespace cute;

template <typename Traits>
struct BwdEpilogue {
    using Element = typename Traits::Element;

    template <typename Args, typename Job, typename AccK, typename AccV>
    __forceinline__ __device__ static void store(const Args& args, const Job& job, AccK& acc_dk, AccV& acc_dv,
                                                 typename Traits::SharedStorage& shared, int ctid,
                                                 int handoff_threads) {
        const BwdParams& p = args.p;
        typename Traits::TiledMmaK mma_k;
        typename Traits::TiledMmaV mma_v;
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
        using KStore = typename Traits::KStore;
        using VStore = typename Traits::VStore;
        const int tile_barrier = kBwdStoreBarrier + ctid / KStore::kTileThreads;
        cutlass::arch::NamedBarrier::sync(handoff_threads, kBwdDqEmptyBarrier);
        Element* const buffer = reinterpret_cast<Element*>(shared.dq);
        const int row_tile0 = job.n_block * (Traits::kBlockN / 64);
        KStore::template store<Traits::kBlockN>(args.tma_dk, make_shape(p.sk, p.d, p.hq, p.b), acc_dk, mma_k, buffer,
                                                row_tile0, job.h, job.b, ctid, tile_barrier);
        VStore::template store<Traits::kBlockN>(args.tma_dv, make_shape(p.sk, p.d_v, p.hq, p.b), acc_dv, mma_v, buffer,
                                                row_tile0, job.h, job.b, ctid, tile_barrier);
        VStore::drain(ctid);
        cutlass::arch::NamedBarrier::sync(VStore::kTileThreads, tile_barrier);
    }
};

}  // namespace flashmask::sm90
