// The SM90 forward's consumer mainloop: one consumer warpgroup's 64 rows of a job, block after
// block as the producer queued them. S = Q K^T (both operands in shared memory) and O += P V (P
// from registers, V through a transposed view) are issued as wgmma, each block's S together with
// the previous block's P V. The element mask (mask/element_mask.h) runs only where a block's
// ticket says the rows need a compare; the online softmax (common/softmax.h) rescales O only when
// a row's max moved. Two warpgroups take turns issuing their GEMMs (pingpong) so that one's
// softmax runs under the other's GEMMs; three issue freely and may each skip the blocks their rows
// do not see (FwdTile::group_sight).
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/params.h"
#include "common/softcap.h"
#include "common/softmax.h"
#include "mask/element_mask.h"
#include "sm90/block_ticket.h"
#include "sm90/fwd_barriers.h"
#include "sm90/fwd_job.h"
#include "sm90/wgmma_ops.h"

namespace flashmask::sm90 {
using namespace cute;

// kSoftcap: the scores are soft-capped (common/softcap.h).
template <typename Traits, bool Is_causal, int kMaskC, bool kSoftcap>
struct FwdMainloop {
    static constexpr int kWarpgroups = Traits::kConsumerWarpgroups;
    static constexpr int kBlockN = Traits::kBlockN;
    static constexpr bool kSkip = Traits::kGroupSight;  // each warpgroup skips the blocks its rows do not see
    static constexpr bool kStaleMax = Traits::kStaleMax;
    using Barriers = FwdBarriers<kWarpgroups>;
    using Element = typename Traits::Element;
    using SharedStorage = typename Traits::SharedStorage;
    using Pipeline = typename Traits::Pipeline;
    using PipelineQ = typename Traits::PipelineQ;
    using Job = TileJob<Traits, Is_causal, (kMaskC > 0)>;
    using Ticket = GroupTicket<kWarpgroups>;
    // The output accumulator of a thread, and the rows of it the thread holds.
    using AccO = decltype(partition_fragment_C(std::declval<typename Traits::TiledMmaPV&>(), typename Traits::TileO{}));
    static constexpr int kRows = decltype(size<0>(rowcol_layout(typename AccO::layout_type{})))::value;
    using Softmax = OnlineSoftmax<kRows>;

    SharedStorage& shared;
    Pipeline& pipeline_k;
    Pipeline& pipeline_v;
    PipelineQ& pipeline_q;
    const int cwg;   // this consumer warpgroup
    const int ctid;  // this thread among the consumers
    // Pipeline states and the ring position run on across jobs.
    cutlass::PipelineState<Traits::kStages> state_k, state_v;
    cutlass::PipelineState<Traits::kQStages> state_q;
    int taken = 0;  // ring slots read, over all jobs

    __forceinline__ __device__ FwdMainloop(SharedStorage& shared_, Pipeline& k, Pipeline& v, PipelineQ& q, int cwg_,
                                           int ctid_)
        : shared(shared_), pipeline_k(k), pipeline_v(v), pipeline_q(q), cwg(cwg_), ctid(ctid_) {}

    // Pingpong (two consumer warpgroups): a warpgroup waits on its own named barrier, which the
    // other one's arrival completes once that one has issued; warpgroup 0 goes first in every job.
    __forceinline__ __device__ void wait_turn() const {
        if constexpr (Barriers::kPingpong) cutlass::arch::NamedBarrier::sync(256, Barriers::turn(cwg));
    }
    __forceinline__ __device__ void pass_turn() const {
        if constexpr (Barriers::kPingpong) cutlass::arch::NamedBarrier::arrive(256, Barriers::turn(cwg ^ 1));
    }
    // After the job's last S: its Q buffer may take another job's Q.
    __forceinline__ __device__ void release_q() {
        pipeline_q.consumer_release(state_q);
        ++state_q;
    }
    // The next block from the ring, once its K stage has landed.
    __forceinline__ __device__ Ticket take_ticket(int& slot) {
        slot = taken++ % Traits::kSlots;
        return Ticket{shared.tickets[slot]};
    }
    // A block this warpgroup does not see: its stages are released only after its loads have
    // landed, since the producer must not re-arm a barrier whose transaction is still under way.
    __forceinline__ __device__ void pass_block() {
        pipeline_v.consumer_wait(state_v);
        pipeline_k.consumer_release(state_k);
        ++state_k;
        pipeline_v.consumer_release(state_v);
        ++state_v;
    }

    // The job's rows against every block queued for it: leaves O unnormalised in acc_o and the rows'
    // max and sum in softmax (for the epilogue).
    __forceinline__ __device__ void run(const AttnParams& p, const Job& tile, AccO& acc_o, Softmax& softmax) {
        typename Traits::TiledMmaQK mma_qk;
        typename Traits::TiledMmaPV mma_pv;
        auto thr_qk = mma_qk.get_thread_slice(ctid);
        auto thr_pv = mma_pv.get_thread_slice(ctid);
        Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQStages{});
        Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
        Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutVt{});
        Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
        Tensor tSrK = thr_qk.partition_fragment_B(sK);
        Tensor tOrV = thr_pv.partition_fragment_B(sVt);
        Tensor cS = rowcol(thr_qk.partition_C(make_identity_tensor(typename Traits::TileS{})));
        clear(acc_o);
        // Soft-capped bf16 scores at a fixed max: no block max and no rescale of O, where the cap's
        // tanh already keeps the MUFU busy.
        const bool fixed_max = softmax.template fix_max<kSoftcap, Element>(p.softcap_max);

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
            if constexpr (kSoftcap) softcap_scores(acc_s, p.softcap_scale);
            Tensor s_rc = rowcol(acc_s);
            const TileCompare cmp = ticket.compare(cwg);
            if (cmp.any) {
                mask_scores<Is_causal, kMaskC, /*kKeyRows=*/false, Traits::kCompareByQuarters>(
                    s_rc, cS, cmp, tile.r0, ticket.block() * kBlockN, p.sk, p.sk - p.sq, shared.mask_cols[slot],
                    ticket.tight());
            }
            if (fixed_max) {  // P is written by store_p, once the P V before is done with it
                softmax.exp_at_fixed_max(s_rc, p.scale_log2);
                rescale = false;
            } else if constexpr (kStaleMax) {
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
        // kStaleMax writes P in the softmax, but for a fixed max.
        auto store_p = [&]() {
            if (!kStaleMax || fixed_max) {
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
    }
};

}  // namespace flashmask::sm90
