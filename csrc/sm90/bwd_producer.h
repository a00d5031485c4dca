// The SM90 backward's load warp: each job's K and V once the consumers are done with the last
// job's, then the Q, dO, LSE and D of the query blocks that see the keys (QueryBlockWalk: the
// causal bound, the block's interval bounds, jumps over fully masked runs) into a pipeline, each
// block with a ticket saying which block it is and what its tile needs (block_ticket.h), so that
// the consumers walk nothing. LSE and D come by bulk copies of the rows the preprocessing padded.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/params.h"
#include "sm90/block_ticket.h"
#include "sm90/bwd_job.h"

namespace flashmask::sm90 {
using namespace cute;

template <typename Traits, bool Is_causal, int kMaskC>
struct BwdProducer {
    using Job = KeyJob<Traits, Is_causal, (kMaskC > 0)>;
    using Pipeline = typename Traits::Pipeline;

    template <typename Args, typename Scheduler>
    __forceinline__ __device__ static void load_jobs(const Args& args, const Scheduler& scheduler,
                                                     typename Traits::SharedStorage& shared, Pipeline& pipeline_q) {
        constexpr int kBlockM = Traits::kBlockM;
        const BwdParams& p = args.p;
        const int lane = threadIdx.x % 32;
        Tensor mQ = args.tma_q.get_tma_tensor(make_shape(p.sq, p.d, p.hq, p.b));
        Tensor mdO = args.tma_do.get_tma_tensor(make_shape(p.sq, p.d_v, p.hq, p.b));
        Tensor mK = args.tma_k.get_tma_tensor(make_shape(p.sk, p.d, p.hk, p.b));
        Tensor mV = args.tma_v.get_tma_tensor(make_shape(p.sk, p.d_v, p.hk, p.b));
        Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
        Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutDO{});
        Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutK{});
        Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutV{});
        using BarrierType = cutlass::arch::ClusterTransactionBarrier::ValueType;
        auto state = cutlass::make_producer_start_state<Pipeline>();
        int kv_free_phase = 0;
        bool kv_loaded = false;
        int queued = 0;  // tickets written, over all jobs
        for (int x = scheduler.first(); scheduler.valid(x); x = scheduler.publish_next(p, x, shared.next_job)) {
            const Job job(p, scheduler.job(p, x));
            if (job.empty()) continue;  // the consumers write zeros: nothing to load
            Tensor gQ = local_tile(mQ(_, _, job.h, job.b), typename Traits::TileQ{}, make_coord(_, _0{}));
            Tensor gdO = local_tile(mdO(_, _, job.h, job.b), typename Traits::TileDO{}, make_coord(_, _0{}));
            Tensor gK = local_tile(mK(_, _, job.kv_h, job.b), typename Traits::TileK{}, make_coord(job.n_block, _0{}));
            Tensor gV = local_tile(mV(_, _, job.kv_h, job.b), typename Traits::TileV{}, make_coord(job.n_block, _0{}));
            auto [tQg, tQs] =
                tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
            auto [tdOg, tdOs] =
                tma_partition(args.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
            auto [tKg, tKs] =
                tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
            auto [tVg, tVs] =
                tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
            if (kv_loaded) {
                shared.kv_free.wait(kv_free_phase);
                kv_free_phase ^= 1;
            }
            kv_loaded = true;
            if (lane == 0) {
                shared.barrier_kv.arrive_and_expect_tx(Traits::kTmaBytesKV);
                copy(args.tma_k.with(reinterpret_cast<BarrierType&>(shared.barrier_kv), 0), tKg, tKs);
                copy(args.tma_v.with(reinterpret_cast<BarrierType&>(shared.barrier_kv), 0), tVg, tVs);
            }
            const int64_t rows = (int64_t(job.b) * p.hq + job.h) * p.stats_stride;
            for (int m = job.m_first; job.valid(m);) {
                const int m_next = job.next(m);
                if (lane == 0) {
                    // Before the stage's arrival, which publishes it (Traits::kTickets).
                    shared.tickets[queued % Traits::kTickets] =
                        BlockTicket::make(m, job.walk.compare(m), !job.valid(m_next)).bits;
                    pipeline_q.producer_acquire(state);
                    BarrierType* full = pipeline_q.producer_get_barrier(state);
                    copy(args.tma_q.with(*full, 0), tQg(_, m), tQs(_, state.index()));
                    copy(args.tma_do.with(*full, 0), tdOg(_, m), tdOs(_, state.index()));
                    float* stats = shared.row_stats[state.index()][0];
                    SM90_BULK_COPY_G2S::copy(p.lse_log2 + rows + m * kBlockM, full, stats, Traits::kBytesRows);
                    SM90_BULK_COPY_G2S::copy(p.dsum + rows + m * kBlockM, full, stats + kBlockM, Traits::kBytesRows);
                }
                ++queued;
                ++state;
                m = m_next;
            }
        }
    }
};

}  // namespace flashmask::sm90
