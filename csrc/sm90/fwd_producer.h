// The SM90 forward's producer warpgroup. Its load warp walks the visible key blocks of each job
// (mask/block_walk.h), loading the job's Q into a ring of Traits::kQStages buffers and each visible
// block's K and V by TMA into pipelines of mbarrier-guarded stages: a block the column intervals
// mask entirely is never loaded. With each block it queues a ticket (block_ticket.h: which block,
// and for each consumer warpgroup whether its rows see the block and what compare they need) and,
// for a block the intervals cut partly, the block's mask columns, in a ring slot of shared memory,
// so that the consumers walk no bounds and stage no mask. It runs ahead into the next job while
// the consumers finish this one. With kDecodeWarp a second warp draws and decodes each job one
// ahead of the load warp (FwdTile::decode_warp_keys).
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/cp_async.h"
#include "common/params.h"
#include "mask/element_mask.h"
#include "sm90/block_ticket.h"
#include "sm90/fwd_job.h"
#include "sm90/tile_scheduler.h"

namespace flashmask::sm90 {
using namespace cute;

template <typename Traits, bool Is_causal, int kMaskC, bool kDecodeWarp>
struct FwdProducer {
    static constexpr bool Has_mask = kMaskC > 0;
    static constexpr int kBlockN = Traits::kBlockN;
    using Job = TileJob<Traits, Is_causal, Has_mask>;
    using Ticket = GroupTicket<Traits::kConsumerWarpgroups>;
    using Scheduler = FwdScheduler<Traits::kConsumerWarpgroups>;
    using SharedStorage = typename Traits::SharedStorage;
    using Pipeline = typename Traits::Pipeline;
    using PipelineQ = typename Traits::PipelineQ;

    // Job x decoded, and its highest visible key block (-1: none, or no job x).
    __forceinline__ __device__ static FwdSlot decode(const AttnParams& p, const Scheduler& scheduler, int x,
                                                     int& n_top) {
        FwdSlot s{x, {}, 0};
        n_top = -1;
        if (scheduler.valid(x)) {
            s.job = scheduler.template job<Is_causal>(p, x);
            BlockBounds bnd;
            n_top = Job(p, s.job).top_block(p, bnd);
            s.visible = n_top >= 0;
        }
        return s;
    }

    // The decode warp: every job of this CTA, the end marker too, one ahead of the load warp.
    __forceinline__ __device__ static void decode_jobs(const AttnParams& p, const Scheduler& scheduler,
                                                       SharedStorage& shared) {
        uint32_t phase = 1;
        for (bool first = true;; first = false) {
            shared.hand_over.wait_free(phase);
            const int x = first ? scheduler.first() : scheduler.draw(p);
            int n_top;
            const FwdSlot next = decode(p, scheduler, x, n_top);
            shared.hand_over.put(next, n_top);
            if (!scheduler.valid(x)) break;
        }
    }

    // The load warp's next job: from the decode warp, or drawn and decoded here.
    __forceinline__ __device__ static FwdSlot next_job(const AttnParams& p, const Scheduler& scheduler,
                                                       SharedStorage& shared, bool first, int& n_top) {
        if constexpr (kDecodeWarp)
            return shared.hand_over.take(n_top);
        else
            return decode(p, scheduler, first ? scheduler.first() : scheduler.draw(p), n_top);
    }

    // The visible block after block n (or -1), told to n's ticket; leaves that block's bounds in
    // `bnd` and its sight in `sight`, which its own ticket is made from.
    template <typename Walk>
    __forceinline__ __device__ static int next_block(const Walk& walk, int n, BlockBounds& bnd, int& sight,
                                                     Ticket& ticket) {
        bnd = walk.bounds_of(n - 1);
        const int next = walk.visible_at_or_below(n - 1, bnd);
        sight = next >= 0 ? Ticket::template sight<Traits::kGroupSight>(walk, next, bnd) : 0;
        ticket.set_next(sight, next < 0);
        return next;
    }

    // Block n's ring slot: its mask columns where the intervals cut it partly, and its ticket.
    __forceinline__ __device__ static void fill_slot(const AttnParams& p, const Job& tile, SharedStorage& shared,
                                                     int slot, const Ticket& ticket, int n, int lane) {
        if (Has_mask && ticket.any_intervals()) {
            stage_mask_columns<kBlockN, kMaskC, 32>(shared.mask_cols[slot], tile.mask.cols, n * kBlockN, p.sk, lane);
            cp_async_fence();
            cp_async_wait<0>();
        }
        if (lane == 0) shared.tickets[slot] = ticket.bits;
        __syncwarp();  // every lane's mask columns before lane 0's arrival on the K stage
    }

    // The load warp, job after job. Each job's first block is found when the job is drawn, before
    // it is published, and carried into its turn here. A job's loads stay in this loop: moved into
    // a [&] lambda, they made ptxas guard the head dim 128 consumers' code with runtime traps.
    template <typename Args>
    __forceinline__ __device__ static void load_jobs(const Args& args, const Scheduler& scheduler,
                                                     SharedStorage& shared, Pipeline& pipeline_k, Pipeline& pipeline_v,
                                                     PipelineQ& pipeline_q) {
        const AttnParams& p = args.p;
        const int lane = threadIdx.x % 32;
        Tensor mQ = args.tma_q.get_tma_tensor(make_shape(p.sq, p.d, p.hq, p.b));
        Tensor mK = args.tma_k.get_tma_tensor(make_shape(p.sk, p.d, p.hk, p.b));
        Tensor mV = args.tma_v.get_tma_tensor(make_shape(p.sk, p.d_v, p.hk, p.b));
        Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQStages{});
        Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
        Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutV{});
        auto state = cutlass::make_producer_start_state<Pipeline>();
        auto state_q = cutlass::make_producer_start_state<PipelineQ>();
        int queued = 0;  // ring slots filled, over all jobs
        int n_block;
        FwdSlot job = next_job(p, scheduler, shared, /*first=*/true, n_block);
        scheduler.publish(job, shared.next_job, /*after_first=*/false);
        while (scheduler.valid(job.x)) {
            if (n_block >= 0) {  // else the consumers write zeros
                const Job tile(p, job.job);
                const auto walk = tile.walk(p);
                BlockBounds bnd = walk.bounds_of(n_block);
                Tensor gQ =
                    local_tile(mQ(_, _, tile.h, tile.b), typename Traits::TileQ{}, make_coord(tile.m_block, _0{}));
                Tensor gK = local_tile(mK(_, _, tile.kv_h, tile.b), typename Traits::TileKV{}, make_coord(_, _0{}));
                Tensor gV = local_tile(mV(_, _, tile.kv_h, tile.b), typename Traits::TileV{}, make_coord(_, _0{}));
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
                // A block's ring slot is filled before the arrival on its K stage publishes it: the
                // first block's here, each next one's while the block before it waits for its V stage.
                // Spelled out at both places: as one helper it costs up to 2 more local loads a block
                // in the masked producers at head dim 64.
                int sight = Ticket::template sight<Traits::kGroupSight>(walk, n_block, bnd);
                int n_next;
                {
                    Ticket ticket = Ticket::template make<Traits::kGroupSight>(walk, n_block, bnd, sight);
                    n_next = next_block(walk, n_block, bnd, sight, ticket);
                    fill_slot(p, tile, shared, queued % Traits::kSlots, ticket, n_block, lane);
                }
                while (n_block >= 0) {
                    if (lane == 0) {
                        pipeline_k.producer_acquire(state);
                        copy(args.tma_k.with(*pipeline_k.producer_get_barrier(state), 0), tKg(_, n_block),
                             tKs(_, state.index()));
                    }
                    // All lanes stage the next block's mask columns: they wait with lane 0 for this K
                    // stage, whose release frees that slot, or they overwrite columns still being read.
                    __syncwarp();
                    // The walk's loads and compares for the next block wait with this block's V stage,
                    // not between this V and the next K. The next block's slot is free: its last block
                    // was read before the K stage just acquired was released (FwdTraits::kSlots).
                    int n_after = -1;
                    if (n_next >= 0) {
                        BlockBounds b = walk.bounds_of(n_next);  // read by the walk just before: from L1
                        Ticket ticket = Ticket::template make<Traits::kGroupSight>(walk, n_next, b, sight);
                        n_after = next_block(walk, n_next, b, sight, ticket);
                        fill_slot(p, tile, shared, (queued + 1) % Traits::kSlots, ticket, n_next, lane);
                    }
                    if (lane == 0) {
                        pipeline_v.producer_acquire(state);
                        copy(args.tma_v.with(*pipeline_v.producer_get_barrier(state), 0), tVg(_, n_block),
                             tVs(_, state.index()));
                    }
                    ++state;
                    ++queued;
                    n_block = n_next;
                    n_next = n_after;
                }
            }
            job = next_job(p, scheduler, shared, /*first=*/false, n_block);
            scheduler.publish(job, shared.next_job, /*after_first=*/true);
        }
    }
};

}  // namespace flashmask::sm90
