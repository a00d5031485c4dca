// Hopper forward with FlashMask tile skipping: TMA loads, wgmma, warp specialisation.
//
// One CTA per (query tile, head, batch), tiles started by decreasing work as on SM80. A producer
// warpgroup gives up its registers (setmaxnreg) and one of its warps walks the visible key blocks
// of the tile, loading Q once and each visible block's K and V by TMA into a pipeline of
// mbarrier-guarded stages: a block the column intervals mask entirely is never loaded. Two consumer
// warpgroups of 64 rows each walk the same blocks (KeyBlockWalk, shared with the SM80 kernels) and
// issue S = Q K^T and O += P V as wgmma; only partial blocks get the element-wise compare, against
// their mask columns staged in shared memory.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/fwd_output.h"
#include "common/launch_order.h"
#include "common/params.h"
#include "common/softmax.h"
#include "mask/block_walk.h"
#include "mask/element_mask.h"
#include "mask/mask_head.h"
#include "sm90/fwd_traits.h"
#include "sm90/wgmma_ops.h"

namespace flashmask::sm90 {
using namespace cute;

// The kernel's argument: the common parameters and the TMA descriptors of Q, K and V (which must
// live in parameter space, hence __grid_constant__).
template <typename TmaQ, typename TmaK, typename TmaV>
struct FwdArgs {
    AttnParams p;
    TmaQ tma_q;
    TmaK tma_k;
    TmaV tma_v;
};

// Which tile a CTA takes and which rows, heads and mask slice that means; identical in every warp.
template <typename Traits, bool Is_causal, bool Has_mask>
struct TileJob {
    int m_block, h, b, r0, r1, kv_h;
    MaskHead mask;

    __device__ TileJob(const AttnParams& p) {
        const int m_tiles = gridDim.x / p.hq;
        const JobHead job = job_and_head(blockIdx.x, m_tiles, p.head_group);
        h = job.head;
        b = blockIdx.z;
        m_block = Has_mask && p.tile_order != nullptr
                      ? p.tile_order[(int64_t(b) * p.hm + h / p.q_per_mask_head) * m_tiles + job.job]
                      : (Is_causal ? m_tiles - 1 - job.job : job.job);
        r0 = m_block * Traits::kBlockM;
        r1 = min(r0 + Traits::kBlockM, p.sq);
        kv_h = h / p.q_per_kv_head;
        mask = mask_head(p, b, h);
    }
    __device__ KeyBlockWalk<Traits::kBlockN, Is_causal, Has_mask> walk(const AttnParams& p) const {
        return {mask.bounds, r0, r1, p.sk, p.sk - p.sq};
    }
};

template <typename Traits, bool Is_causal, int kMaskC, typename Args>
__global__ void __launch_bounds__(Traits::kNThreads, 1) fwd_kernel(const __grid_constant__ Args args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool Has_mask = kMaskC > 0;
    using Element = typename Traits::Element;
    using SharedStorage = typename Traits::SharedStorage;
    using Pipeline = typename Traits::Pipeline;
    constexpr int kBlockN = Traits::kBlockN;
    const AttnParams& p = args.p;

    extern __shared__ __align__(1024) char smem_raw[];
    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem_raw);
    const int warp_group = threadIdx.x / 128;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    const TileJob<Traits, Is_causal, Has_mask> tile(p);
    const auto walk = tile.walk(p);
    const int n_last = walk.end() - 1;

    // Barriers: Q's (one arrival with its byte count), and the K and V pipelines (warp 0 of the
    // producer is their only producer; every consumer thread releases a stage).
    if (threadIdx.x == 0) shared.barrier_q.init(1);
    typename Pipeline::Params pipe_params;
    pipe_params.transaction_bytes = Traits::kTmaBytesKV;
    pipe_params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    pipe_params.is_leader = threadIdx.x == 0;
    pipe_params.num_consumers = Traits::kConsumerThreads;
    Pipeline pipeline_k(shared.pipeline_k, pipe_params, Shape<_1, _1, _1>{});
    Pipeline pipeline_v(shared.pipeline_v, pipe_params, Shape<_1, _1, _1>{});
    cutlass::arch::fence_barrier_init();
    __syncthreads();

    if (warp_group == 0) {
        cutlass::arch::warpgroup_reg_dealloc<24>();
        if (warp != 0) return;
        BlockBounds bnd = walk.bounds_of(n_last);
        int n_block = walk.visible_at_or_below(n_last, bnd);
        if (n_block < 0) return;
        Tensor mQ = args.tma_q.get_tma_tensor(make_shape(p.sq, p.d, p.hq, p.b));
        Tensor mK = args.tma_k.get_tma_tensor(make_shape(p.sk, p.d, p.hk, p.b));
        Tensor mV = args.tma_v.get_tma_tensor(make_shape(p.sk, p.d, p.hk, p.b));
        Tensor gQ = local_tile(mQ(_, _, tile.h, tile.b), typename Traits::TileQ{}, make_coord(tile.m_block, _0{}));
        Tensor gK = local_tile(mK(_, _, tile.kv_h, tile.b), typename Traits::TileKV{}, make_coord(_, _0{}));
        Tensor gV = local_tile(mV(_, _, tile.kv_h, tile.b), typename Traits::TileKV{}, make_coord(_, _0{}));
        Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
        Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
        Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutKV{});
        auto [tQg, tQs] = tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        auto [tKg, tKs] = tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        auto [tVg, tVs] = tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

        auto state = cutlass::make_producer_start_state<Pipeline>();
        if (lane == 0) {
            shared.barrier_q.arrive_and_expect_tx(Traits::kTmaBytesQ);
            copy(args.tma_q.with(reinterpret_cast<typename cutlass::arch::ClusterTransactionBarrier::ValueType&>(
                                     shared.barrier_q),
                                 0),
                 tQg, tQs);
        }
        while (n_block >= 0) {
            if (lane == 0) {
                pipeline_k.producer_acquire(state);
                copy(args.tma_k.with(*pipeline_k.producer_get_barrier(state), 0), tKg(_, n_block), tKs(_, state.index()));
                pipeline_v.producer_acquire(state);
                copy(args.tma_v.with(*pipeline_v.producer_get_barrier(state), 0), tVg(_, n_block), tVs(_, state.index()));
            }
            ++state;
            bnd = walk.bounds_of(n_block - 1);
            n_block = walk.visible_at_or_below(n_block - 1, bnd);
        }
        return;
    }

    // Consumers.
    cutlass::arch::warpgroup_reg_alloc<240>();
    const int ctid = threadIdx.x - 128;  // thread index among the consumers
    const int cwg = warp_group - 1;
    const FwdOutput<Element> output(p, tile.b, tile.h, 0);
    BlockBounds bnd = walk.bounds_of(n_last);
    int n_block = walk.visible_at_or_below(n_last, bnd);
    if (n_block < 0) {
        output.write_empty(tile.r0, tile.r1, ctid, Traits::kConsumerThreads);
        return;
    }

    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutVt{});
    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(ctid);
    auto thr_pv = mma_pv.get_thread_slice(ctid);
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
    Tensor tSrK = thr_qk.partition_fragment_B(sK);
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);
    Tensor acc_o = partition_fragment_C(mma_pv, typename Traits::TileQ{});
    clear(acc_o);
    Tensor cS = rowcol(thr_qk.partition_C(make_identity_tensor(typename Traits::TileS{})));
    constexpr int kRows = decltype(size<0>(cS))::value;
    OnlineSoftmax<kRows> softmax;
    int* smem_mask = shared.mask_cols[cwg];

    shared.barrier_q.wait(0);
    cutlass::PipelineState<Traits::kStages> state;
    TileCompare compare = walk.compare(n_block, bnd);
    while (n_block >= 0) {
        const int c0 = n_block * kBlockN;
        if (Has_mask && compare.intervals) {
            // The warpgroup's previous readers of its mask buffer finished with the last block.
            cutlass::arch::NamedBarrier::sync(128, 1 + cwg);
            stage_mask_columns<kBlockN, kMaskC, 128>(smem_mask, tile.mask.cols, c0, p.sk, ctid % 128);
            cp_async_fence();
            cp_async_wait<0>();
            cutlass::arch::NamedBarrier::sync(128, 1 + cwg);
        }
        Tensor acc_s = partition_fragment_C(mma_qk, typename Traits::TileS{});
        pipeline_k.consumer_wait(state);
        wgmma_gemm</*zero_init=*/true>(mma_qk, tSrQ, tSrK(_, _, _, state.index()), acc_s);
        warpgroup_wait<0>();
        pipeline_k.consumer_release(state);

        bnd = walk.bounds_of(n_block - 1);
        const int n_next = walk.visible_at_or_below(n_block - 1, bnd);
        Tensor s_rc = rowcol(acc_s);
        if (compare.any) {
            mask_scores<Is_causal, kMaskC>(s_rc, cS, compare, tile.r0, c0, p.sk, walk.causal_offset, smem_mask);
        }
        Tensor o_rc = rowcol(acc_o);
        softmax.update(s_rc, o_rc, p.scale_log2);

        Tensor rP = convert_to<Element>(acc_s);
        Tensor tOrP = make_tensor(rP.data(), acc_as_a_layout(rP.layout()));
        pipeline_v.consumer_wait(state);
        wgmma_gemm</*zero_init=*/false>(mma_pv, tOrP, tOrV(_, _, _, state.index()), acc_o);
        warpgroup_wait<0>();
        pipeline_v.consumer_release(state);
        ++state;
        if (n_next >= 0) compare = walk.compare(n_next, bnd);
        n_block = n_next;
    }

    float lse[kRows];
    Tensor o_rc = rowcol(acc_o);
    softmax.finalize(o_rc, p.softmax_scale, lse);
    Tensor cO = rowcol(thr_pv.partition_C(make_identity_tensor(typename Traits::TileQ{})));
    output.write_rows(o_rc, cO, lse, tile.r0, tile.r1, ctid);
#endif
}

}  // namespace flashmask::sm90
