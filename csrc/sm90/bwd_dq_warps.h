// The SM90 backward's dQ warps: producer warps that add each query block's dQ tile, computed by the
// consumers into shared memory, to the fp32 dQ accumulator in global memory with one bulk reduction,
// off the consumers' path.
//
// Deterministic mode: the key blocks of a (batch, head) that see a query block add their dQ to it in
// increasing order, so that a job only ever waits for jobs drawn before it (job_and_head). The query
// block's semaphore holds one more than the last key block that added to it (0: none yet); a key
// block waits there for the key block below it that sees the query block (QueryBlockWalk::
// previous_visitor) and then writes its own number. Key blocks that do not see a query block never
// touch its semaphore, so that a document's key blocks never wait for another document's jobs.
// Deterministic jobs walk their query blocks downwards where that shortens the waits (KeyJob).
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/params.h"
#include "sm90/bwd_barriers.h"

namespace flashmask::sm90 {

// dst[0, bytes) += src[0, bytes) in fp32, by the TMA unit (a bulk reduction; part of the issuing
// thread's bulk group: cute::tma_store_arrive commits it, cute::tma_store_wait waits for its reads).
__forceinline__ __device__ void bulk_reduce_add(float* dst, const float* src, int bytes) {
    const uint32_t s = cute::cast_smem_ptr_to_uint(src);
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(s),
                 "r"(bytes)
                 : "memory");
}

__forceinline__ __device__ void wait_dq_turn(const int* sem, int turn) {
    for (;;) {
        int v;
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(sem) : "memory");
        if (v == turn) return;
        __nanosleep(64);
    }
}
__forceinline__ __device__ void pass_dq_turn(int* sem, int next) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(sem), "r"(next) : "memory");
}

// dQ warp `slot` of kDqWarps: the job's visible query blocks go to the dQ warps in turn, each
// block's tile from shared memory into the accumulator, with p.dq_semaphore in turn (above). The
// buffer goes back to the consumers as soon as the reduction has read it, so that they wait for a
// late turn only when their next tile is ready too; in deterministic mode the warp then holds the
// block's turn until the addition is complete in global memory, while the next warp already waits
// for the next block's turn (with one warp that completion bounded every step). Returns whether
// this warp holds the buffer once the job is done (it read the last tile, or the job has none: slot 0).
template <typename Traits, int kDqWarps, typename Job>
__device__ bool dq_warp(const BwdParams& p, const Job& job, float* smem_dq, int slot, int handoff_threads) {
    constexpr int kTile = Traits::kBlockM * Traits::kHeadDim;
    const int lane = threadIdx.x % 32;
    const int64_t head = int64_t(job.b) * p.hq + job.h;
    float* dq_accum = p.dq_accum + head * job.m_end * kTile;
    int* const sem = p.dq_semaphore != nullptr ? p.dq_semaphore + head * job.m_end : nullptr;
    if (job.empty()) return slot == 0;
    if (slot == 0) cutlass::arch::NamedBarrier::arrive(handoff_threads, kBwdDqEmptyBarrier);
    for (int m = job.m_first, k = 0; job.valid(m); ++k) {
        const int m_next = job.next(m);
        const bool last = !job.valid(m_next);
        if (k % kDqWarps == slot) {
            if (sem != nullptr) {                                   // while the consumers compute this block's dQ
                const int previous = job.walk.previous_visitor(m);  // the whole warp
                if (lane == 0) wait_dq_turn(sem + m, previous + 1);
            }
            dq_full_sync(handoff_threads, slot);
            if (lane == 0) {
                if (sem != nullptr) asm volatile("fence.proxy.async.global;\n" ::: "memory");  // after the acquire
                bulk_reduce_add(dq_accum + int64_t(m) * kTile, smem_dq, kTile * int(sizeof(float)));
                cute::tma_store_arrive();
                cute::tma_store_wait<0>();  // read out of shared memory
            }
            __syncwarp();
            if (!last) cutlass::arch::NamedBarrier::arrive(handoff_threads, kBwdDqEmptyBarrier);
            if (sem != nullptr && lane == 0) {
                // Complete in global memory (not only read from shared memory) before the turn passes.
                asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
                asm volatile("fence.proxy.async.global;\n" ::: "memory");
                pass_dq_turn(sem + m, job.n_block + 1);
            }
            __syncwarp();
        } else if (last) {
            return false;
        }
        m = m_next;
    }
    return true;
}

// A dQ warp, job after job; the warp that read a job's last tile hands the buffer to dK and dV.
template <typename Traits, typename Job, typename Scheduler>
__forceinline__ __device__ void dq_warp_jobs(const BwdParams& p, const Scheduler& scheduler,
                                             typename Traits::SharedStorage& shared, int slot, int handoff_threads) {
    for (int x = scheduler.first(); scheduler.valid(x); x = scheduler.take_next(shared.next_job)) {
        const Job job(p, scheduler.job(p, x));
        const bool holds = dq_warp<Traits, Traits::kDqWarps>(p, job, shared.dq, slot, handoff_threads);
        if (holds) cutlass::arch::NamedBarrier::arrive(handoff_threads, kBwdDqEmptyBarrier);
    }
}

}  // namespace flashmask::sm90
