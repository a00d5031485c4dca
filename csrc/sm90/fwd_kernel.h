// Hopper forward with FlashMask tile skipping: TMA loads, wgmma, warp specialisation.
//
// Persistent: one CTA per SM takes (query tile, head, batch) jobs from tile_scheduler.h, heaviest
// first. A producer warpgroup gives up its registers (setmaxnreg) and one of its warps walks the
// visible key blocks of each job, loading its Q (into a ring of Traits::kQStages buffers) and each
// visible block's K and V by TMA into pipelines of mbarrier-guarded stages: a block the column
// intervals mask entirely is never loaded. The producer runs ahead into the next job while the
// consumers finish and write this one. With each block it queues a ticket (block_ticket.h: which
// block, and for each consumer warpgroup whether its rows see the block and what compare they
// need) and, for a block the intervals cut partly, the block's mask columns, in a ring slot of
// shared memory. Two consumer warpgroups of 64 rows each (three at head dim 64) take the blocks
// from the ring and issue S = Q K^T and O += P V as wgmma, each block's S together with the
// previous block's P V; two warpgroups take turns (pingpong); three may each skip the blocks
// their rows do not see (tile_config.h). The output leaves by TMA store (tile_store.h).
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
#include "sm90/block_ticket.h"
#include "sm90/fwd_barriers.h"
#include "sm90/fwd_traits.h"
#include "sm90/tile_scheduler.h"
#include "sm90/wgmma_ops.h"

namespace flashmask::sm90 {
using namespace cute;

// The kernel's argument: the common parameters and the TMA descriptors of Q, K, V and O (which
// must live in parameter space, hence __grid_constant__).
template <typename TmaQ, typename TmaK, typename TmaV, typename TmaO>
struct FwdArgs {
    AttnParams p;
    TmaQ tma_q;
    TmaK tma_k;
    TmaV tma_v;
    TmaO tma_o;
};

// What a job means: its rows, heads and mask slice; identical in every warp.
template <typename Traits, bool Is_causal, bool Has_mask>
struct TileJob {
    int m_block, h, b, r0, r1, kv_h;
    MaskHead mask;

    __device__ TileJob(const AttnParams& p, const FwdJob& job) : m_block(job.m_block), h(job.h), b(job.b) {
        r0 = m_block * Traits::kBlockM;
        r1 = min(r0 + Traits::kBlockM, p.sq);
        kv_h = h / p.q_per_kv_head;
        mask = mask_head(p, b, h);
    }
    __device__ KeyBlockWalk<Traits::kBlockN, Is_causal, Has_mask> walk(const AttnParams& p) const {
        const int m_tiles = (p.sq + Traits::kBlockM - 1) / Traits::kBlockM;
        return {mask.bounds, r0, r1, p.sk, p.sk - p.sq, Has_mask ? tile_floor(p, b, h, m_block, m_tiles) : 0};
    }
    // The highest visible key block, where the downward walk starts, or -1 (nothing to load); bnd
    // is left holding its bounds.
    __device__ int top_block(const AttnParams& p, BlockBounds& bnd) const {
        const auto w = walk(p);
        const int n_last = w.end() - 1;
        bnd = w.bounds_of(n_last);
        return w.visible_at_or_below(n_last, bnd);
    }
};

// kDecodeWarp: a second producer warp draws and decodes each job one ahead (FwdTile::decode_warp_keys).
template <typename Traits, bool Is_causal, int kMaskC, typename Args, bool kDecodeWarp>
__global__ void __launch_bounds__(Traits::kNThreads, 1) fwd_kernel(const __grid_constant__ Args args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool Has_mask = kMaskC > 0;
    constexpr int kWarpgroups = Traits::kConsumerWarpgroups;
    using Barriers = FwdBarriers<kWarpgroups>;
    using Element = typename Traits::Element;
    using SharedStorage = typename Traits::SharedStorage;
    using Pipeline = typename Traits::Pipeline;
    using PipelineQ = typename Traits::PipelineQ;
    using Job = TileJob<Traits, Is_causal, Has_mask>;
    constexpr int kBlockN = Traits::kBlockN;
    using Ticket = GroupTicket<kWarpgroups>;
    constexpr bool kSkip = Traits::kGroupSight;  // each warpgroup skips the blocks its rows do not see
    constexpr bool kStaleMax = Traits::kStaleMax;
    const AttnParams& p = args.p;

    extern __shared__ __align__(1024) char smem_raw[];
    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem_raw);
    const int warp_group = cutlass::canonical_warp_group_idx();  // warp-uniform for ptxas: wgmma sits under it
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const FwdScheduler<kWarpgroups> scheduler(p, Traits::kBlockM);

    // Pipelines of Q (a stage per job that loads one), K and V: warp 0 of the producer is their
    // only producer, every consumer thread releases a stage. Pipeline states run on across jobs.
    typename Pipeline::Params pipe_params;
    pipe_params.transaction_bytes = Traits::kTmaBytesKV;
    pipe_params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    pipe_params.is_leader = threadIdx.x == 0;
    pipe_params.num_consumers = Traits::kConsumerThreads;
    Pipeline pipeline_k(shared.pipeline_k, pipe_params, Shape<_1, _1, _1>{});
    typename PipelineQ::Params q_params;
    q_params.transaction_bytes = Traits::kTmaBytesQ;
    q_params.role = warp_group == 0 ? PipelineQ::ThreadCategory::Producer : PipelineQ::ThreadCategory::Consumer;
    q_params.is_leader = pipe_params.is_leader;
    q_params.num_consumers = pipe_params.num_consumers;
    PipelineQ pipeline_q(shared.pipeline_q, q_params, Shape<_1, _1, _1>{});
    Pipeline pipeline_v(shared.pipeline_v, pipe_params, Shape<_1, _1, _1>{});
    if constexpr (kDecodeWarp) {
        if (threadIdx.x == 0) shared.hand_over.init();
    }
    cutlass::arch::fence_barrier_init();
    __syncthreads();

    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQStages{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});

    if (warp_group == 0) {
        cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
        // Job x decoded, and its highest visible key block (-1: none, or no job x).
        auto decode = [&](int x, int& n_top) {
            FwdSlot s{x, {}, 0};
            n_top = -1;
            if (scheduler.valid(x)) {
                s.job = scheduler.template job<Is_causal>(p, x);
                BlockBounds bnd;
                n_top = Job(p, s.job).top_block(p, bnd);
                s.visible = n_top >= 0;
            }
            return s;
        };
        if constexpr (kDecodeWarp) {
            if (warp == 1) {  // every job of this CTA, the end marker too, one ahead of the load warp
                uint32_t phase = 1;
                for (bool first = true;; first = false) {
                    shared.hand_over.wait_free(phase);
                    const int x = first ? scheduler.first() : scheduler.draw(p);
                    int n_top;
                    const FwdSlot next = decode(x, n_top);
                    shared.hand_over.put(next, n_top);
                    if (!scheduler.valid(x)) break;
                }
                return;
            }
        }
        if (warp != 0) return;
        // The load warp's next job: from the decode warp, or drawn and decoded here.
        auto next_job = [&](bool first, int& n_top) {
            if constexpr (kDecodeWarp)
                return shared.hand_over.take(n_top);
            else
                return decode(first ? scheduler.first() : scheduler.draw(p), n_top);
        };
        Tensor mQ = args.tma_q.get_tma_tensor(make_shape(p.sq, p.d, p.hq, p.b));
        Tensor mK = args.tma_k.get_tma_tensor(make_shape(p.sk, p.d, p.hk, p.b));
        Tensor mV = args.tma_v.get_tma_tensor(make_shape(p.sk, p.d, p.hk, p.b));
        Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutKV{});
        auto state = cutlass::make_producer_start_state<Pipeline>();
        auto state_q = cutlass::make_producer_start_state<PipelineQ>();
        int queued = 0;  // ring slots filled, over all jobs
        // Each job's first block is found when the job is drawn, before it is published, and
        // carried into its turn here. The loads are written in the loop, not in a [&] lambda, in
        // which ptxas guarded the head dim 128 consumers' code with runtime traps.
        int n_block;
        FwdSlot job = next_job(/*first=*/true, n_block);
        scheduler.publish(job, shared.next_job, /*after_first=*/false);
        while (scheduler.valid(job.x)) {
            if (n_block >= 0) {  // else the consumers write zeros
                const Job tile(p, job.job);
                const auto walk = tile.walk(p);
                BlockBounds bnd = walk.bounds_of(n_block);
                Tensor gQ =
                    local_tile(mQ(_, _, tile.h, tile.b), typename Traits::TileQ{}, make_coord(tile.m_block, _0{}));
                Tensor gK = local_tile(mK(_, _, tile.kv_h, tile.b), typename Traits::TileKV{}, make_coord(_, _0{}));
                Tensor gV = local_tile(mV(_, _, tile.kv_h, tile.b), typename Traits::TileKV{}, make_coord(_, _0{}));
                auto [tQg, tQs] =
                    tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
                auto [tKg, tKs] =
                    tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
                auto [tVg, tVs] =
                    tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
                // A Q buffer is free once every consumer warpgroup has issued the last S of its job.
                if (lane == 0) {
                    pipeline_q.producer_acquire(state_q);
                    copy(args.tma_q.with(*pipeline_q.producer_get_barrier(state_q), 0), tQg, tQs(_, state_q.index()));
                }
                ++state_q;
                int sight = Ticket::template sight<Traits::kGroupSight>(walk, n_block, bnd);
                Ticket ticket = Ticket::template make<Traits::kGroupSight>(walk, n_block, bnd, sight);
                while (n_block >= 0) {
                    bnd = walk.bounds_of(n_block - 1);
                    const int n_next = walk.visible_at_or_below(n_block - 1, bnd);
                    sight = n_next >= 0 ? Ticket::template sight<Traits::kGroupSight>(walk, n_next, bnd) : 0;
                    ticket.set_next(sight, n_next < 0);
                    // The block's ring slot, filled before the arrival on its K stage publishes it.
                    const int slot = queued % Traits::kSlots;
                    if (Has_mask && ticket.any_intervals()) {
                        stage_mask_columns<kBlockN, kMaskC, 32>(shared.mask_cols[slot], tile.mask.cols,
                                                                n_block * kBlockN, p.sk, lane);
                        cp_async_fence();
                        cp_async_wait<0>();
                    }
                    if (lane == 0) shared.tickets[slot] = ticket.bits;
                    __syncwarp();  // every lane's mask columns before lane 0's copy
                    if (lane == 0) {
                        pipeline_k.producer_acquire(state);
                        copy(args.tma_k.with(*pipeline_k.producer_get_barrier(state), 0), tKg(_, n_block),
                             tKs(_, state.index()));
                        pipeline_v.producer_acquire(state);
                        copy(args.tma_v.with(*pipeline_v.producer_get_barrier(state), 0), tVg(_, n_block),
                             tVs(_, state.index()));
                    }
                    ++state;
                    ++queued;
                    n_block = n_next;
                    if (n_block >= 0) ticket = Ticket::template make<Traits::kGroupSight>(walk, n_block, bnd, sight);
                }
            }
            job = next_job(/*first=*/false, n_block);
            scheduler.publish(job, shared.next_job, /*after_first=*/true);
        }
        return;
    }

    // Consumers.
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    const int ctid = threadIdx.x - 128;  // thread index among the consumers
    const int cwg = warp_group - 1;
    Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutVt{});
    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(ctid);
    auto thr_pv = mma_pv.get_thread_slice(ctid);
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
    Tensor tSrK = thr_qk.partition_fragment_B(sK);
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);
    Tensor cS = rowcol(thr_qk.partition_C(make_identity_tensor(typename Traits::TileS{})));
    Tensor cO = rowcol(thr_pv.partition_C(make_identity_tensor(typename Traits::TileQ{})));
    constexpr int kRows = decltype(size<0>(cS))::value;

    // Pingpong (two consumer warpgroups): they take turns issuing their GEMMs, so that one's
    // softmax runs while the other's GEMMs keep the tensor cores busy. A warpgroup waits on its
    // own named barrier, which the other one's arrival completes once that one has issued;
    // warpgroup 0 goes first in every job. Three warpgroups issue freely.
    const int buffers_barrier = Barriers::buffers(cwg);
    auto wait_turn = [&]() {
        if constexpr (Barriers::kPingpong) cutlass::arch::NamedBarrier::sync(256, Barriers::turn(cwg));
    };
    auto pass_turn = [&]() {
        if constexpr (Barriers::kPingpong) cutlass::arch::NamedBarrier::arrive(256, Barriers::turn(cwg ^ 1));
    };

    cutlass::PipelineState<Traits::kStages> state_k, state_v;
    cutlass::PipelineState<Traits::kQStages> state_q;
    // After the job's last S: its Q buffer may take another job's Q.
    auto release_q = [&]() {
        pipeline_q.consumer_release(state_q);
        ++state_q;
    };
    int taken = 0;  // ring slots read, over all jobs
    // The next block from the ring, once its K stage has landed.
    auto take_ticket = [&](int& slot) {
        slot = taken++ % Traits::kSlots;
        return Ticket{shared.tickets[slot]};
    };
    // Every job, the first too, comes decoded from the producer: no block walk in the consumers.
    for (FwdSlot job = scheduler.take_next(shared.next_job, cwg); scheduler.valid(job.x);
         job = scheduler.take_next(shared.next_job, cwg)) {
        const Job tile(p, job.job);
        const FwdOutput<Element> output(p, tile.b, tile.h, 0);
        if (!job.visible) {  // the producer queued nothing
            output.write_empty(tile.r0, tile.r1, ctid, Traits::kConsumerThreads);
            continue;
        }

        Tensor acc_o = partition_fragment_C(mma_pv, typename Traits::TileQ{});
        clear(acc_o);
        OnlineSoftmax<kRows> softmax;

        // The first block alone, then each next block's S = Q K^T is issued together with the
        // previous block's O += P V, one batch for the tensor cores. The source waits for that
        // P V only after the new S's softmax, but ptxas moves the wait up to the top of its basic
        // block (forcing it below the softmax was slower). Another warpgroup's GEMMs run under
        // this one's softmax.
        Tensor acc_s = partition_fragment_C(mma_qk, typename Traits::TileS{});
        Tensor rP = make_tensor<Element>(acc_s.layout());
        Tensor tOrP = make_tensor(rP.data(), acc_as_a_layout(rP.layout()));
        float correction[kRows];
        bool rescale = true;  // whether a row's max moved: O needs the correction
        // exp(S - max) of a block, masked where its ticket says, and the rescale factors of O; then P.
        auto softmax_of = [&](const Ticket& ticket, int slot) {
            Tensor s_rc = rowcol(acc_s);
            const TileCompare cmp = ticket.compare(cwg);
            if (cmp.any) {
                mask_scores<Is_causal, kMaskC, /*kKeyRows=*/false, Traits::kCompareByQuarters>(
                    s_rc, cS, cmp, tile.r0, ticket.block() * kBlockN, p.sk, p.sk - p.sq, shared.mask_cols[slot],
                    ticket.tight());
            }
            if constexpr (kStaleMax) {
                // The P V before reads P, which this writes. Waiting here rather than before the
                // compare lets a partial block's compare run under that P V.
                warpgroup_wait<0>();
                Tensor p_rc = rowcol(rP);
                // A block not kept at the running max goes round once more at the raised max: one
                // copy of the exponentials in the loop's code, not two (a second copy ran slower).
                rescale = false;
                bool force = false;
#pragma unroll 1
                while (!softmax.exp_at_running_max(s_rc, p_rc, p.scale_log2, force)) {
                    rescale = softmax.raise_max(s_rc, p.scale_log2, correction);
                    force = true;
                }
            } else {
                rescale = softmax.update_scores(s_rc, p.scale_log2, correction);
            }
        };
        // kStaleMax writes P in the softmax.
        auto store_p = [&]() {
            if constexpr (!kStaleMax) {
                Tensor converted = convert_to<Element>(acc_s);
                CUTE_UNROLL
                for (int i = 0; i < size(rP); ++i) rP(i) = converted(i);
            }
        };

        if (cwg == 1) pass_turn();  // pingpong: warpgroup 0 goes first
        pipeline_q.consumer_wait(state_q);
        const int q_stage = state_q.index();
        int slot;
        pipeline_k.consumer_wait(state_k);
        Ticket ticket = take_ticket(slot);
        // With kSkip the warpgroup's blocks go in runs of blocks its rows see; without, the job is
        // one run. A run's first S is issued alone and its last P V after the loop, so every wgmma
        // is unconditional within its loop (ptxas serialises a wgmma it finds on a divergent path).
        // Where a run ends is in its last ticket: nothing waits on the next one before the GEMMs.
        while (true) {
            if constexpr (kSkip) {
                // An unseen block's stages are released only after its loads have landed: the
                // producer must not re-arm a barrier whose transaction is still under way.
                auto pass_block = [&]() {
                    pipeline_v.consumer_wait(state_v);
                    pipeline_k.consumer_release(state_k);
                    ++state_k;
                    pipeline_v.consumer_release(state_v);
                    ++state_v;
                };
                while (!ticket.sees(cwg) && !ticket.last()) {
                    pass_block();
                    pipeline_k.consumer_wait(state_k);
                    ticket = take_ticket(slot);
                }
                if (!ticket.sees(cwg)) {  // the job's last block, unseen: nothing of the job is left
                    pass_block();
                    release_q();
                    break;
                }
            }
            wait_turn();
            wgmma_gemm</*zero_init=*/true>(mma_qk, tSrQ(_, _, _, q_stage), tSrK(_, _, _, state_k.index()), acc_s);
            pass_turn();
            warpgroup_wait<0>();
            pipeline_k.consumer_release(state_k);
            ++state_k;
            softmax_of(ticket, slot);
            if (kSkip && rescale) {  // O holds the runs before this one (without kSkip it is zero)
                Tensor o_rc = rowcol(acc_o);
                softmax.rescale(o_rc, correction);
            }
            store_p();
            while (ticket.run_continues(cwg)) {
                pipeline_k.consumer_wait(state_k);
                pipeline_v.consumer_wait(state_v);
                ticket = take_ticket(slot);
                wait_turn();
                wgmma_gemm</*zero_init=*/true>(mma_qk, tSrQ(_, _, _, q_stage), tSrK(_, _, _, state_k.index()), acc_s);
                wgmma_gemm</*zero_init=*/false>(mma_pv, tOrP, tOrV(_, _, _, state_v.index()), acc_o);
                pass_turn();
                warpgroup_wait<1>();  // S is in; P V may still run
                pipeline_k.consumer_release(state_k);
                ++state_k;
                softmax_of(ticket, slot);
                warpgroup_wait<0>();
                pipeline_v.consumer_release(state_v);  // also frees the last block's ring slot (fwd_traits.h)
                ++state_v;
                if (rescale) {
                    Tensor o_rc = rowcol(acc_o);
                    softmax.rescale(o_rc, correction);
                }
                store_p();
            }
            // Every S of this job is in: the producer may load the next job's Q.
            const bool job_done = ticket.last();
            if (job_done) release_q();
            pipeline_v.consumer_wait(state_v);
            wait_turn();
            wgmma_gemm</*zero_init=*/false>(mma_pv, tOrP, tOrV(_, _, _, state_v.index()), acc_o);
            if (cwg == 0) pass_turn();  // pingpong: warpgroup 1's last turn is its last, no arrival left pending
            warpgroup_wait<0>();
            pipeline_v.consumer_release(state_v);
            ++state_v;
            if (!kSkip || job_done) break;
            pipeline_k.consumer_wait(state_k);  // the next block, which this warpgroup does not see
            ticket = take_ticket(slot);
        }

        float lse[kRows];
        Tensor o_rc = rowcol(acc_o);
        softmax.finalize(o_rc, p.softmax_scale, lse);
        Traits::OutStore::template store<Traits::kBlockM>(args.tma_o, make_shape(p.sq, p.d, p.hq, p.b), acc_o, mma_pv,
                                                          shared.o.data(), tile.m_block * kWarpgroups, tile.h, tile.b,
                                                          ctid, buffers_barrier);
        output.write_lse(cO, lse, tile.r0, tile.r1, ctid);
    }
    Traits::OutStore::drain(ctid);
#endif
}

}  // namespace flashmask::sm90
