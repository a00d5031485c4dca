// Shared-memory layouts, wgmma tiles and the shared storage of the SM90 forward kernel.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "sm90/tile_config.h"
#include "sm90/tile_scheduler.h"
#include "sm90/tile_store.h"

namespace flashmask::sm90 {

// kHeadDim: of Q and K; kHeadDimV: of V and O.
template <int kHeadDim_, int kHeadDimV_, typename Element_>
struct FwdTraits {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimV = kHeadDimV_;
    static constexpr int kBlockM = fwd_tile(kHeadDim, kHeadDimV).block_m;
    static constexpr int kBlockN = fwd_tile(kHeadDim, kHeadDimV).block_n;
    static constexpr int kStages = fwd_tile(kHeadDim, kHeadDimV).stages;
    static constexpr int kQStages = fwd_tile(kHeadDim, kHeadDimV).q_stages;
    static constexpr int kConsumerWarpgroups = fwd_tile(kHeadDim, kHeadDimV).consumer_warpgroups;
    static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
    static constexpr int kNThreads = kConsumerThreads + 128;  // + one producer warpgroup
    // setmaxnreg: the producer gives its registers to the consumers.
    static constexpr int kProducerRegisters = fwd_tile(kHeadDim, kHeadDimV).producer_registers;
    static constexpr int kConsumerRegisters = fwd_tile(kHeadDim, kHeadDimV).consumer_registers;
    static_assert(fwd_registers_fit(kHeadDim, kHeadDimV),
                  "more registers than the CTA holds at launch: the consumers' setmaxnreg would wait for ever");
    static_assert(kBlockM == 64 * kConsumerWarpgroups);
    static constexpr bool kGroupSight = fwd_tile(kHeadDim, kHeadDimV).group_sight;
    static_assert(!kGroupSight || kConsumerWarpgroups == 3, "pingpong turns must pair up: no warpgroup may skip");
    static constexpr bool kCompareByQuarters = fwd_tile(kHeadDim, kHeadDimV).compare_by_quarters;
    static constexpr bool kStaleMax = fwd_tile(kHeadDim, kHeadDimV).stale_max;

    using TileQ = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>;
    using TileKV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>;  // a block of K
    using TileV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimV>>;
    using TileO = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDimV>>;
    using TileS = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>;

    // S = Q K^T with both operands in shared memory; O += P V with P in registers and V read
    // through a transposed (MN-major) view. The consumer warpgroups split the rows, 64 each.
    using AtomLayout = cute::Layout<cute::Shape<cute::Int<kConsumerWarpgroups>, cute::_1, cute::_1>>;
    using TiledMmaQK = decltype(cute::make_tiled_mma(
        cute::GMMA::ss_op_selector<Element, Element, float,
                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>>(),
        AtomLayout{}));
    using TiledMmaPV = decltype(cute::make_tiled_mma(
        cute::GMMA::rs_op_selector<Element, Element, float,
                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDimV>, cute::Int<kBlockN>>,
                                   cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
        AtomLayout{}));

    // One Q buffer (the TMA box) and the ring of kQStages of them.
    using SmemLayoutQ = decltype(cute::tile_to_shape(
        cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, Element, cute::Int<kBlockM>,
                                                            cute::Int<kHeadDim>>(),
        TileQ{}));
    using SmemLayoutQStages = decltype(cute::tile_to_shape(
        cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, Element, cute::Int<kBlockM>,
                                                            cute::Int<kHeadDim>>(),
        cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kQStages>>{}));
    using SmemLayoutKV = decltype(cute::tile_to_shape(
        cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, Element, cute::Int<kBlockN>,
                                                            cute::Int<kHeadDim>>(),
        cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
    using SmemLayoutV = decltype(cute::tile_to_shape(
        cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, Element, cute::Int<kBlockN>,
                                                            cute::Int<kHeadDimV>>(),
        cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimV>, cute::Int<kStages>>{}));
    // V as (head dim, key, stage): the B operand of P V.
    using SmemLayoutVt = decltype(cute::composition(
        SmemLayoutV{},
        cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDimV>, cute::Int<kBlockN>, cute::Int<kStages>>{},
                                  cute::Step<cute::_2, cute::_1, cute::_3>{})));

    // The output, through one shared-memory buffer per consumer warpgroup (tile_store.h) where that
    // fits beside the pipelines; else straight from the registers (fwd_epilogue.h).
    using OutStore = WarpgroupRowsStore<Element, kHeadDimV>;
    using SmemLayoutO = typename OutStore::template SmemLayout<kBlockM>;

    using Pipeline = cutlass::PipelineTmaAsync<kStages>;
    // Q's ring: a buffer is free again once every consumer warpgroup has issued its job's last S.
    using PipelineQ = cutlass::PipelineTmaAsync<kQStages>;
    static constexpr int kTmaBytesQ = kBlockM * kHeadDim * int(sizeof(Element));
    static constexpr int kTmaBytesK = kBlockN * kHeadDim * int(sizeof(Element));
    static constexpr int kTmaBytesV = kBlockN * kHeadDimV * int(sizeof(Element));
    // The producer fills block i + 1's ring slot once its whole load warp holds block i's K stage,
    // so the consumers have released block i - kStages's K stage; a consumer reads a block's slot
    // just after releasing its K stage, so the slots of blocks i - kStages .. i may still be read:
    // with block i + 1's, kStages + 2 slots are in use, no fewer.
    static constexpr int kSlots = kStages + 2;

    // Shared memory for everything but the output buffer, and whether that fits beside it.
    static constexpr int kSmemMainBytes =
        int(sizeof(Element)) *
            (cute::cosize_v<SmemLayoutQStages> + cute::cosize_v<SmemLayoutKV> + cute::cosize_v<SmemLayoutV>)+kSlots *
            (4 + 16 * kBlockN) +
        4096;
    static constexpr bool kOThroughSmem =
        kSmemMainBytes + int(sizeof(Element)) * cute::cosize_v<SmemLayoutO> <= 227 * 1024;

    struct SharedStorage {
        alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQStages>> q;
        alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>> k;
        alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>> v;
        alignas(1024) cute::array_aligned<Element, kOThroughSmem ? cute::cosize_v<SmemLayoutO> : 8> o;
        // The ring of queued key blocks (fwd_producer.h): each one's ticket and, for a block the
        // intervals cut partly, its raw [BlockN, C] mask columns.
        int tickets[kSlots];
        alignas(16) int mask_cols[kSlots][4 * kBlockN];
        FwdSlot next_job;  // the job the producer hands to the consumers (tile_scheduler.h)
        typename PipelineQ::SharedStorage pipeline_q;
        typename Pipeline::SharedStorage pipeline_k;
        typename Pipeline::SharedStorage pipeline_v;
        JobHandOver hand_over;  // from the producer's decode warp to its load warp, where it runs
    };
    static constexpr int kSmemBytes = int(sizeof(SharedStorage));
    static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an H100 SM has for one block");
};

}  // namespace flashmask::sm90
