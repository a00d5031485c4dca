// Hopper forward with FlashMask tile skipping: TMA loads, wgmma, warp specialisation.
//
// Persistent: one CTA per SM takes (query tile, head, batch) jobs from tile_scheduler.h, heaviest
// first (with split-KV, each tile's key range in num_splits jobs, merged by common/fwd_combine.cu).
// Warpgroup 0 is the producer (fwd_producer.h): it gives up its registers (setmaxnreg) and one of
// its warps loads each job's Q and its visible key blocks' K and V by TMA into mbarrier-guarded
// pipelines, with a ticket per block saying what its tile needs. Two consumer warpgroups of 64 rows
// each (three at head dim 64) run the mainloop (fwd_mainloop.h: S = Q K^T, mask, online softmax,
// O += P V as wgmma) and the epilogue (fwd_epilogue.h: O by TMA store, the LSE). This body sets
// up the shared storage and pipelines and gives each warp its role.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/params.h"
#include "sm90/fwd_epilogue.h"
#include "sm90/fwd_job.h"
#include "sm90/fwd_mainloop.h"
#include "sm90/fwd_producer.h"
#include "sm90/fwd_traits.h"
#include "sm90/tile_scheduler.h"

namespace flashmask::sm90 {
using namespace cute;

// kDecodeWarp: a second producer warp draws and decodes each job one ahead (FwdTile::decode_warp_keys).
// kSoftcap: the scores are soft-capped (common/softcap.h).
template <typename Traits, bool Is_causal, int kMaskC, typename Args, bool kDecodeWarp, bool kSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads, 1) fwd_kernel(const __grid_constant__ Args args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Pipeline = typename Traits::Pipeline;
    using PipelineQ = typename Traits::PipelineQ;
    using Producer = FwdProducer<Traits, Is_causal, kMaskC, kDecodeWarp>;
    using Mainloop = FwdMainloop<Traits, Is_causal, kMaskC, kSoftcap>;
    using Epilogue = FwdEpilogue<Traits>;
    const AttnParams& p = args.p;

    extern __shared__ __align__(1024) char smem_raw[];
    auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
    const int warp_group = cutlass::canonical_warp_group_idx();  // warp-uniform for ptxas: wgmma sits under it
    const int warp = threadIdx.x / 32;
    const FwdScheduler<Traits::kConsumerWarpgroups> scheduler(p, Traits::kBlockM);

    // Pipelines of Q (a stage per job that loads one), K and V: warp 0 of the producer is their
    // only producer, every consumer thread releases a stage. Pipeline states run on across jobs.
    typename Pipeline::Params pipe_params;
    pipe_params.transaction_bytes = Traits::kTmaBytesK;
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
    typename Pipeline::Params v_params = pipe_params;
    v_params.transaction_bytes = Traits::kTmaBytesV;
    Pipeline pipeline_v(shared.pipeline_v, v_params, Shape<_1, _1, _1>{});
    if constexpr (kDecodeWarp) {
        if (threadIdx.x == 0) shared.hand_over.init();
    }
    cutlass::arch::fence_barrier_init();
    __syncthreads();

    if (warp_group == 0) {
        cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
        if (kDecodeWarp && warp == 1) Producer::decode_jobs(p, scheduler, shared);
        if (warp == 0) Producer::load_jobs(args, scheduler, shared, pipeline_k, pipeline_v, pipeline_q);
        return;
    }

    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    const int cwg = warp_group - 1;
    const int ctid = threadIdx.x - 128;  // thread index among the consumers
    Mainloop mainloop(shared, pipeline_k, pipeline_v, pipeline_q, cwg, ctid);
    // Every job, the first too, comes decoded from the producer: no block walk in the consumers.
    for (FwdSlot job = scheduler.take_next(shared.next_job, cwg); scheduler.valid(job.x);
         job = scheduler.take_next(shared.next_job, cwg)) {
        const typename Mainloop::Job tile(p, job.job);
        if (!job.visible) {  // the producer queued nothing
            Epilogue::store_empty(p, tile, ctid);
            continue;
        }
        typename Mainloop::AccO acc_o;
        typename Mainloop::Softmax softmax;
        mainloop.run(p, tile, acc_o, softmax);
        Epilogue::store(args.tma_o, p, tile, acc_o, softmax, shared, cwg, ctid);
    }
    Epilogue::drain(ctid);
#endif
}

}  // namespace flashmask::sm90
