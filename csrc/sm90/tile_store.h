// Writing a wgmma accumulator tile to global memory through shared memory: each consumer
// warpgroup converts its 64 rows to 16 bits, writes them into its own shared-memory buffer
// (stmatrix), and one of its threads hands the buffer to the TMA unit, which clips rows and
// columns past the tensor's end. With kGroupsPerTile > 1 that many warpgroups share one 64-row
// tile, each holding some of its columns, and the first of them stores it. The warpgroup goes on while the store runs;
// only its next store into the buffer, or drain() before the CTA exits, waits for the TMA unit to have read it. The
// forward writes O this way, the backward dK and dV.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "common/convert.h"

namespace flashmask::sm90 {
using namespace cute;

template <typename Element, int kHeadDim, int kGroupsPerTile = 1>
struct WarpgroupRowsStore {
    static constexpr int kTileThreads = 128 * kGroupsPerTile;  // the threads that write one buffer
    using TileHalf = Shape<_64, Int<kHeadDim>>;                // one consumer warpgroup's rows
    // One row tile's buffer, as the TMA store reads it; its swizzle atoms no wider than each
    // warpgroup's columns.
    using SmemLayoutHalf =
        decltype(tile_to_shape(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, _64,
                                                                                   Int<kHeadDim / kGroupsPerTile>>(),
                               TileHalf{}));
    static constexpr int kHalfElems = cosize_v<SmemLayoutHalf>;
    // All warpgroups' buffers together, as the (rows, head dim) tile that the accumulator partitions.
    template <int kRows>
    using SmemLayout = decltype(tile_to_shape(SmemLayoutHalf{}, Shape<Int<kRows>, Int<kHeadDim>>{}));

    // The TMA store of a [S, D, H, B] view (tma_views.h) from one warpgroup's buffer.
    template <typename View>
    static auto make_tma(View const& gmem) {
        return make_tma_copy(SM90_TMA_STORE{}, gmem, SmemLayoutHalf{}, TileHalf{}, _1{});
    }

    // acc: the calling thread's accumulator of tiled_mma over the (kRows, head dim) tile whose
    // warpgroup rows start at global row 64 * row_tile0; smem: kRows * kHeadDim elements (all
    // warpgroups' buffers); shape: the global view's (S, D, H, B); barrier_id: a named barrier of the
    // kTileThreads threads that share the calling thread's buffer alone.
    template <int kRows, typename Tma, typename Acc, typename TiledMma, typename GShape>
    __device__ static void store(const Tma& tma, GShape const& shape, Acc const& acc, TiledMma const& tiled_mma,
                                 Element* smem, int row_tile0, int h, int b, int ctid, int barrier_id) {
        const int tile = ctid / kTileThreads;
        const bool leader = ctid % kTileThreads == 0;
        // The last store from this buffer must have read it before it is overwritten.
        if (leader) tma_store_wait<0>();
        cutlass::arch::NamedBarrier::sync(kTileThreads, barrier_id);

        Tensor s = make_tensor(make_smem_ptr(smem), SmemLayout<kRows>{});
        auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma);
        auto thr = r2s.get_thread_slice(ctid);
        Tensor r = convert_to<Element>(acc);
        copy(r2s, thr.retile_S(r), thr.partition_D(s));
        // Generic-proxy writes made visible to the TMA unit (async proxy), then to the leader.
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(kTileThreads, barrier_id);

        const int row_tile = row_tile0 + tile;
        if (leader && row_tile * 64 < get<0>(shape)) {
            Tensor g = local_tile(tma.get_tma_tensor(shape)(_, _, h, b), TileHalf{}, make_coord(row_tile, _0{}));
            Tensor half = make_tensor(make_smem_ptr(smem + tile * kHalfElems), SmemLayoutHalf{});
            auto [tg, ts] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(half), group_modes<0, 2>(g));
            copy(tma, ts, tg);
            tma_store_arrive();
        }
    }

    // Before the CTA exits: the warpgroup's stores must have finished reading shared memory.
    __device__ static void drain(int ctid) {
        if (ctid % kTileThreads == 0) tma_store_wait<0>();
    }
};

}  // namespace flashmask::sm90
