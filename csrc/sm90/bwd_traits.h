// Shared-memory layouts, wgmma tiles and the shared storage of the SM90 backward kernel.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "sm90/tile_config.h"
#include "sm90/tile_store.h"

namespace flashmask::sm90 {

// kHeadDim: of Q and K (and dQ, dK); kHeadDimV: of V and dO (and dV).
template <int kHeadDim_, int kHeadDimV_, typename Element_>
struct BwdTraits {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimV = kHeadDimV_;
    static constexpr BwdTile kTile = bwd_tile(kHeadDim, kHeadDimV);
    static constexpr int kBlockM = kTile.block_m;  // queries per step
    static constexpr int kBlockN = kTile.block_n;  // keys per CTA
    static constexpr int kStages = kTile.stages;
    static constexpr int kConsumerWarpgroups = kTile.consumer_warpgroups;
    static constexpr bool kEarlyDv = kTile.early_dv;
    static constexpr int kDqWarps = kTile.dq_warps;
    static constexpr bool kSplitHeadDim = kTile.split_head_dim;
    static constexpr int kDqSlices = kTile.dq_slices;
    static_assert(!kSplitHeadDim || kEarlyDv, "split: dV is issued as soon as P^T is in shared memory");
    static_assert(kDqWarps >= 1 && kDqWarps <= 3, "the producer warpgroup has three warps besides the producer");
    static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
    static constexpr int kNThreads = kConsumerThreads + 128;
    // setmaxnreg (bwd_kernel.h): the producer warpgroup keeps 24 registers, the consumers take 240.
    static constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;
    static_assert(setmaxnreg_fits(kNThreads, kProducerRegisters, kConsumerThreads, kConsumerRegisters),
                  "more registers than the CTA holds at launch: the consumers' setmaxnreg would wait for ever");
    // The warpgroups that share each 64-key row tile of dK and dV (splitting its head dim).
    static constexpr int kGroupsPerKeyTile = kSplitHeadDim ? kConsumerWarpgroups : 1;
    static_assert(kBlockN == 64 * kConsumerWarpgroups / kGroupsPerKeyTile);

    using TileQ = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>;
    using TileDO = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDimV>>;
    using TileK = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>;
    using TileV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimV>>;
    using TileST = cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>;  // (keys, queries)

    // Key-stationary: S^T = K Q^T and dP^T = V dO^T have the keys as rows. Each consumer warpgroup
    // owns 64 keys, whose P^T and dS^T stay in registers as the A operands of dV += P^T dO and
    // dK += dS^T Q; or (kSplitHeadDim) one warpgroup computes S^T and the other dP^T (TiledMmaRole)
    // and they split the head dim of dK and dV, P^T and dS^T passing through shared memory
    // (TiledMmaSdP then goes unused). dQ = dS K reads dS from shared memory; there the warpgroups
    // split the head dim, kDqSlices slices one after the other.
    using AtomKeys = cute::Layout<
        cute::Shape<cute::Int<kConsumerWarpgroups / kGroupsPerKeyTile>, cute::Int<kGroupsPerKeyTile>, cute::_1>>;
    using AtomCols = cute::Layout<cute::Shape<cute::_1, cute::Int<kConsumerWarpgroups>, cute::_1>>;
    using TiledMmaSdP = decltype(cute::make_tiled_mma(
        cute::GMMA::ss_op_selector<
            Element, Element, float,
            cute::Shape<cute::Int<64>, cute::Int<kBlockM / kGroupsPerKeyTile>, cute::Int<kHeadDim>>>(),
        AtomKeys{}));
    // Split head dim: S^T (warpgroup 0) or dP^T (warpgroup 1) of the whole block by one warpgroup.
    using TiledMmaRole = decltype(cute::make_tiled_mma(
        cute::GMMA::ss_op_selector<Element, Element, float,
                                   cute::Shape<cute::Int<64>, cute::Int<kBlockM>, cute::Int<kHeadDim>>>()));
    // dK += dS^T Q (kDim: the head dim) and dV += P^T dO (the value head dim).
    template <int kDim,
              typename Shape = cute::Shape<cute::Int<64>, cute::Int<kDim / kGroupsPerKeyTile>, cute::Int<kBlockM>>>
    using MmaRowsTimesQueries = std::conditional_t<
        kSplitHeadDim,
        decltype(cute::make_tiled_mma(
            cute::GMMA::ss_op_selector<Element, Element, float, Shape, cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
            AtomCols{})),
        decltype(cute::make_tiled_mma(
            cute::GMMA::rs_op_selector<Element, Element, float, Shape, cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
            AtomKeys{}))>;
    using TiledMmaK = MmaRowsTimesQueries<kHeadDim>;
    using TiledMmaV = MmaRowsTimesQueries<kHeadDimV>;
    using TileDq = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim / kDqSlices>>;  // one slice of dQ
    using TiledMmaQ = decltype(cute::make_tiled_mma(
        cute::GMMA::ss_op_selector<
            Element, Element, float,
            cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim / kDqSlices / kConsumerWarpgroups>, cute::Int<kBlockN>>,
            cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
        AtomCols{}));

    template <int kRows, int kCols>
    using KMajorAtom =
        decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, Element, cute::Int<kRows>,
                                                                     cute::Int<kCols>>());
    // The swizzle atoms' width: where the warpgroups split the head dim, each warpgroup's columns
    // of Q^T, dO^T (dK, dV) and K^T (dQ) must be whole atoms of the MN-major B operand (head dim
    // 192: 96 columns, 64-byte swizzle).
    static constexpr int kKAtomCols = kSplitHeadDim ? kHeadDim / kDqSlices / kConsumerWarpgroups : kHeadDim;
    // Q and dO: (queries, kDim, stage); their transposes are the B operands of dK and dV.
    template <int kDim>
    using SmemLayoutRows =
        decltype(cute::tile_to_shape(KMajorAtom<kBlockM, kDim / kGroupsPerKeyTile>{},
                                     cute::Shape<cute::Int<kBlockM>, cute::Int<kDim>, cute::Int<kStages>>{}));
    template <int kDim>
    using SmemLayoutRowsT = decltype(cute::composition(
        SmemLayoutRows<kDim>{},
        cute::make_ordered_layout(cute::Shape<cute::Int<kDim>, cute::Int<kBlockM>, cute::Int<kStages>>{},
                                  cute::Step<cute::_2, cute::_1, cute::_3>{})));
    using SmemLayoutQ = SmemLayoutRows<kHeadDim>;
    using SmemLayoutQt = SmemLayoutRowsT<kHeadDim>;
    using SmemLayoutDO = SmemLayoutRows<kHeadDimV>;
    using SmemLayoutDOt = SmemLayoutRowsT<kHeadDimV>;
    // K and V: (keys, head dim); K^T is the B operand of dQ (a slice of its rows per dQ slice).
    using SmemLayoutK = decltype(cute::tile_to_shape(KMajorAtom<kBlockN, kKAtomCols>{}, TileK{}));
    using SmemLayoutKt = decltype(cute::composition(
        SmemLayoutK{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                                 cute::Step<cute::_2, cute::_1>{})));
    using SmemLayoutV = decltype(cute::tile_to_shape(KMajorAtom<kBlockN, kHeadDimV>{}, TileV{}));
    // dS (and P where kSplitHeadDim): (queries, keys), the A operand of dQ.
    using SmemLayoutDS = decltype(cute::tile_to_shape(KMajorAtom<kBlockM, kBlockN>{},
                                                      cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
    // The same memory as (keys, queries): where the S^T-shaped dS^T registers are stored, and
    // (kSplitHeadDim) the A operands of dK and dV.
    using SmemLayoutDSt = decltype(cute::composition(
        SmemLayoutDS{}, cute::make_ordered_layout(TileST{}, cute::Step<cute::_2, cute::_1>{})));

    // dK and dV leave through shared memory (tile_store.h), one after the other through the dQ
    // buffer, between jobs (the Q and dO buffers already hold the next job's first blocks).
    using KStore = WarpgroupRowsStore<Element, kHeadDim, kGroupsPerKeyTile>;
    using VStore = WarpgroupRowsStore<Element, kHeadDimV, kGroupsPerKeyTile>;
    static_assert(cute::cosize_v<typename KStore::template SmemLayout<kBlockN>> * sizeof(Element) <=
                  kBlockM * kHeadDim * sizeof(float));
    static_assert(kHeadDimV <= kHeadDim, "dV goes through the dQ buffer too");

    using Pipeline = cutlass::PipelineTmaAsync<kStages>;
    static constexpr int kTmaBytesQ = kBlockM * kHeadDim * int(sizeof(Element));
    static constexpr int kTmaBytesDO = kBlockM * kHeadDimV * int(sizeof(Element));
    static constexpr int kTmaBytesKV = kBlockN * (kHeadDim + kHeadDimV) * int(sizeof(Element));
    static constexpr int kBytesRows = kBlockM * int(sizeof(float));  // a query block's LSE, or D
    // A ring longer than the pipeline: the producer writes a block's ticket before it waits for the
    // block's stage, so a slot is rewritten only after the consumers released a later block.
    static constexpr int kTickets = 8;
    static_assert(kTickets > kStages + 1);

    struct SharedStorage {
        alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> q;
        alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutDO>> dout;
        alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>> k;
        alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>> v;
        alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutDS>> ds;
        alignas(1024) cute::array_aligned<Element, kSplitHeadDim ? cute::cosize_v<SmemLayoutDS> : 0> p;
        // A query block's dQ on its way to global memory (bwd_dq_warps.h), and between jobs dK and dV
        // (1024-byte aligned for their swizzled layout).
        alignas(1024) float dq[kBlockM * kHeadDim];
        // A query block's LSE * log2(e) and D, loaded with its Q and dO (one per pipeline stage).
        alignas(16) float row_stats[kStages][2][kBlockM];
        int tickets[kTickets];                   // the query blocks the producer has queued (bwd_producer.h)
        alignas(16) int mask_cols[4 * kBlockN];  // the raw [BlockN, C] mask columns of the CTA's keys
        cutlass::arch::ClusterTransactionBarrier barrier_kv;
        cutlass::arch::ClusterBarrier kv_free;  // the consumers are done with a job's K and V
        int next_job;  // the job the producer hands to the consumers and the dQ warps (tile_scheduler.h)
        typename Pipeline::SharedStorage pipeline_q;  // Q and dO of a query block travel together
    };
    static constexpr int kSmemBytes = int(sizeof(SharedStorage));
    static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an H100 SM has for one block");
};

}  // namespace flashmask::sm90
