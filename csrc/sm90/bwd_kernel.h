// Hopper backward with FlashMask skipping: key/value-stationary, TMA loads, wgmma, warp
// specialisation.
//
// (Key block, query head, batch) jobs (tile_scheduler.h) run in the order of the mask's job
// list (heaviest key blocks first, few heads in flight: MaskMeta::jobs; in deterministic mode each
// head's key blocks ascending) or, without one, of job_and_head, one CTA per SM drawing them. The
// producer warpgroup gives its registers away; one warp loads each job's K and V and the Q, dO,
// LSE and D of the query blocks that see them (bwd_producer.h), two or three more add the dQ tiles
// to the fp32 accumulator (bwd_dq_warps.h). Two consumer warpgroups own 64 keys each (above head
// dim 128: share 64 keys, each with half the head dim of dK and dV) and run the mainloop
// (bwd_mainloop.h: S^T, dP^T, dV, dK and dQ as wgmma) and the epilogue (bwd_epilogue.h: dK and dV
// by TMA store). This body sets up the shared storage and pipelines and gives each warp
// its role.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/params.h"
#include "sm90/bwd_dq_warps.h"
#include "sm90/bwd_epilogue.h"
#include "sm90/bwd_job.h"
#include "sm90/bwd_mainloop.h"
#include "sm90/bwd_producer.h"
#include "sm90/bwd_traits.h"
#include "sm90/tile_scheduler.h"

namespace flashmask::sm90 {
using namespace cute;

// kSoftcap: the scores are soft-capped (common/softcap.h).
template <typename Traits, bool Is_causal, int kMaskC, typename Args, bool kSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel(const __grid_constant__ Args args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Pipeline = typename Traits::Pipeline;
    using Mainloop = BwdMainloop<Traits, Is_causal, kMaskC, kSoftcap>;
    using Job = typename Mainloop::Job;
    const BwdParams& p = args.p;

    extern __shared__ __align__(1024) char smem_raw[];
    auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
    const int warp_group = threadIdx.x / 128;
    const int warp = threadIdx.x / 32;
    const BwdScheduler<Traits::kConsumerThreads, Traits::kDqWarps> scheduler(p, Traits::kBlockN);

    // Barriers: K and V's (one arrival with its byte count, one phase per job that loads them), the
    // consumers' release of K and V once a job's last GEMM is done (one phase per such job), and
    // the Q/dO pipeline, whose state runs on across jobs.
    if (threadIdx.x == 0) {
        shared.barrier_kv.init(1);
        shared.kv_free.init(Traits::kConsumerThreads);
    }
    typename Pipeline::Params pipe_params;
    pipe_params.transaction_bytes = Traits::kTmaBytesQ + Traits::kTmaBytesDO + 2 * Traits::kBytesRows;
    pipe_params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    pipe_params.is_leader = threadIdx.x == 0;
    pipe_params.num_consumers = Traits::kConsumerThreads;
    Pipeline pipeline_q(shared.pipeline_q, pipe_params, Shape<_1, _1, _1>{});
    cutlass::arch::fence_barrier_init();
    __syncthreads();

    if (warp_group == 0) {
        cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
        if (warp == 0) BwdProducer<Traits, Is_causal, kMaskC>::load_jobs(args, scheduler, shared, pipeline_q);
        if (warp >= 1 && warp <= Traits::kDqWarps)
            dq_warp_jobs<Traits, Job>(p, scheduler, shared, warp - 1, Mainloop::kDqHandoff);
        return;
    }

    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    const int ctid = threadIdx.x - 128;
    Mainloop mainloop(shared, pipeline_q, ctid);
    for (int x = scheduler.first(); scheduler.valid(x); x = scheduler.take_next(shared.next_job)) {
        const Job job(p, scheduler.job(p, x));
        typename Mainloop::AccK acc_dk;
        typename Mainloop::AccV acc_dv;
        clear(acc_dk);
        clear(acc_dv);
        if (!job.empty()) mainloop.run(p, job, acc_dk, acc_dv);
        BwdEpilogue<Traits>::store(args, job, acc_dk, acc_dv, shared, ctid, Mainloop::kDqHandoff);
    }
#endif
}

}  // namespace flashmask::sm90
