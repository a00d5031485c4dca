// The SM90 forward's persistent tile scheduler: one CTA per SM, each taking (query tile, head,
// batch) jobs, or (query tile, head, batch, split) jobs in split-KV mode, until none is left. CTA x
// starts with job x; after that the producer warp draws the next job from an atomic counter as soon
// as it has issued the loads of the current one, and hands it, decoded, to the consumer warpgroups
// through shared memory. Drawing instead of striding keeps the list schedule of the job order
// (heaviest first): a CTA that finishes early takes the next job.
#pragma once
#include <cutlass/arch/barrier.h>

#include "common/launch_order.h"
#include "common/params.h"
#include "sm90/fwd_barriers.h"

namespace flashmask::sm90 {

// Job x of a launch over (tile, head, batch), `tiles` tiles per head: entry x of the job list
// (masks), or else the launch order of the SM80 kernels (heads in groups of p.head_group), tiles
// descending where `reverse`.
__device__ __forceinline__ ListedJob ordered_job(const AttnParams& p, int x, int tiles, bool reverse) {
    if (p.job_list != nullptr) return listed_job(p.job_list[x], tiles, p.hq);
    const int per_batch = tiles * p.hq;
    const int b = x / per_batch;
    const JobHead jh = job_and_head(x - b * per_batch, tiles, p.head_group);
    return {reverse ? tiles - 1 - jh.job : jh.job, jh.head, b};
}

struct FwdJob {
    int m_block, h, b;
    int split;  // split-KV: this job's share of the tile's key blocks (0 without splits)
};

// What the producer hands to the consumers: the next job's index and, decoded, the job and whether
// it has a visible key block, so that a consumer starts a job with no global load (the job list's
// entry and then the tile's bounds were two dependent loads at every job's start).
struct FwdSlot {
    int x;
    FwdJob job;
    int visible;
};

// A slot goes between warps through shared memory field by field, volatile: CUTLASS's named
// barriers and mbarrier waits carry no memory clobber, so plain accesses could move across them.
__device__ __forceinline__ void store_slot(volatile FwdSlot& to, const FwdSlot& s) {
    to.x = s.x;
    to.job.m_block = s.job.m_block;
    to.job.h = s.job.h;
    to.job.b = s.job.b;
    to.job.split = s.job.split;
    to.visible = s.visible;
}
__device__ __forceinline__ FwdSlot load_slot(const volatile FwdSlot& from) {
    return {from.x, {from.job.m_block, from.job.h, from.job.b, from.job.split}, from.visible};
}

// FwdTile::decode_warp_keys (tile_config.h): the producer's decode warp draws and decodes each job one ahead
// of its load warp and passes it on through a one-job slot guarded by two mbarriers of one
// arrival each: `full` (a job is in) and `empty` (the load warp has read it).
struct JobHandOver {
    FwdSlot slot;
    int n_top;            // the job's highest visible key block, -1: none
    uint32_t take_phase;  // the load warp's phase of `full`, kept here: its registers are few
    uint64_t full, empty;

    __device__ void init() {  // one thread, before the CTA's first __syncthreads
        cutlass::arch::ClusterBarrier::init(&full, 1);
        cutlass::arch::ClusterBarrier::init(&empty, 1);
        take_phase = 0;
    }
    // Decode warp, before it draws each job: waits until the load warp has taken the one before,
    // so that a CTA holds at most one job it has not started (a job drawn earlier could wait there
    // while another SM idles at the end of the run). phase starts at 1: a fresh barrier's previous
    // phase counts as complete, so the first wait returns at once.
    __device__ void wait_free(uint32_t& phase) {
        cutlass::arch::ClusterBarrier::wait(&empty, phase);
        phase ^= 1;
    }
    __device__ void put(const FwdSlot& next, int top) {
        if (threadIdx.x % 32 == 0) {
            volatile JobHandOver& h = *this;
            store_slot(h.slot, next);
            h.n_top = top;
            cutlass::arch::ClusterBarrier::arrive(&full);  // releases the writes above (.release.cta)
        }
        __syncwarp();
    }
    // Load warp: the next job and its top block.
    __device__ FwdSlot take(int& top) {
        volatile JobHandOver& h = *this;
        const uint32_t phase = h.take_phase;
        cutlass::arch::ClusterBarrier::wait(&full, phase);
        const FwdSlot next = load_slot(h.slot);
        top = h.n_top;
        __syncwarp();  // every lane has read the slot and the phase before they change
        if (threadIdx.x % 32 == 0) {
            h.take_phase = phase ^ 1;
            cutlass::arch::ClusterBarrier::arrive(&empty);
        }
        __syncwarp();
        return next;
    }
};

// The hand-over: the producer warp publishes into a one-job slot that every consumer has read.
// Each consumer warpgroup waits for the publication on its own barrier, so that one can start the
// next job while another, half a block behind in the pingpong, still finishes this one.
template <int kConsumerWarpgroups>
struct FwdScheduler {
    using Barriers = FwdBarriers<kConsumerWarpgroups>;
    static constexpr int kEmptyThreads = 32 + 128 * kConsumerWarpgroups, kFullThreads = 32 + 128;
    int m_tiles, num_jobs;

    __device__ FwdScheduler(const AttnParams& p, int block_m)
        : m_tiles((p.sq + block_m - 1) / block_m), num_jobs(m_tiles * p.hq * p.b * p.num_splits) {}

    __device__ int first() const { return blockIdx.x; }
    __device__ bool valid(int x) const { return x < num_jobs; }

    // Job x of the order (ordered_job); without a job list, causal tiles longest (last) first. The
    // splits of a tile are consecutive jobs, so the heaviest tiles' splits still start first.
    template <bool Is_causal>
    __device__ FwdJob job(const AttnParams& p, int x) const {
        int split = 0;
        if (p.num_splits > 1) {
            split = x % p.num_splits;
            x /= p.num_splits;
        }
        const ListedJob j = ordered_job(p, x, m_tiles, Is_causal);
        return {j.tile, j.head, j.batch, split};
    }

    // Producer warp, after issuing a job's loads: the index of its next job.
    __device__ int draw(const AttnParams& p) const {
        int next = 0;
        if (threadIdx.x % 32 == 0) next = gridDim.x + atomicAdd(p.job_counter, 1);
        return __shfl_sync(0xffffffffu, next, 0);
    }

    // Producer warp: publishes a CTA's first job, then each next one after issuing the loads of
    // the one before. The first publication has nothing to wait for; each later one waits until the
    // consumers have read the previous one.
    __device__ void publish(const FwdSlot& next, FwdSlot& slot, bool after_first) const {
        if (after_first) cutlass::arch::NamedBarrier::sync(kEmptyThreads, Barriers::kJobEmpty);
        if (threadIdx.x % 32 == 0) store_slot(slot, next);
        for (int wg = 0; wg < kConsumerWarpgroups; ++wg)
            cutlass::arch::NamedBarrier::arrive(kFullThreads, Barriers::job_full(wg));
    }

    // Consumers, before their first job and after each: the next one. The slot is released only if
    // the producer will publish again, i.e. if the job is a real one (no barrier arrival is left
    // pending at exit).
    __device__ FwdSlot take_next(const FwdSlot& slot, int consumer_warpgroup) const {
        cutlass::arch::NamedBarrier::sync(kFullThreads, Barriers::job_full(consumer_warpgroup));
        const FwdSlot next = load_slot(slot);
        if (valid(next.x)) cutlass::arch::NamedBarrier::arrive(kEmptyThreads, Barriers::kJobEmpty);
        return next;
    }
};

struct BwdJob {
    int n_block, h, b;
};

// The SM90 backward's scheduler: (key block, head, batch) jobs in the order of the mask's job list
// (MaskMeta::jobs: heaviest first, head by head within a bucket; in deterministic mode each head's
// key blocks ascending) or, without one (no mask, or deterministic mode below 32K keys), of the
// SM80 backward's grid (launch_order.h: heads in groups of p.head_group, key blocks ascending, so
// that causal key blocks, which see the most queries, come first). One CTA per SM draws them like
// the forward's, and the producer warp publishes each next job into a one-job slot that the
// consumer warpgroups and the dQ warps all read.
template <int kConsumerThreads, int kDqWarps>
struct BwdScheduler {
    static constexpr int kThreads = 32 + kConsumerThreads + 32 * kDqWarps;  // producer, consumers, dQ warps
    static constexpr int kJobFull = 7, kJobEmpty = 0;  // named barriers (bwd_barriers.h uses 1, 2, 4-6)
    static_assert(user_barrier_fits(kJobFull));
    int n_blocks, num_jobs;

    __device__ BwdScheduler(const BwdParams& p, int block_n)
        : n_blocks((p.sk + block_n - 1) / block_n), num_jobs(n_blocks * p.hq * p.b) {}

    __device__ int first() const { return blockIdx.x; }
    __device__ bool valid(int x) const { return x < num_jobs; }

    __device__ BwdJob job(const BwdParams& p, int x) const {
        const ListedJob j = ordered_job(p, x, n_blocks, /*reverse=*/false);
        return {j.tile, j.head, j.batch};
    }

    // Producer warp, after issuing job `x`'s loads: draws the next job and publishes it once every
    // reader has read the previous publication.
    __device__ int publish_next(const BwdParams& p, int x, int& slot) const {
        int next = 0;
        if (threadIdx.x % 32 == 0) next = gridDim.x + atomicAdd(p.job_counter, 1);
        next = __shfl_sync(0xffffffffu, next, 0);
        if (x != first()) cutlass::arch::NamedBarrier::sync(kThreads, kJobEmpty);
        if (threadIdx.x % 32 == 0) *static_cast<volatile int*>(&slot) = next;
        cutlass::arch::NamedBarrier::arrive(kThreads, kJobFull);
        return next;
    }

    // Consumers and the dQ warps, after finishing a job: the next one (the slot is released only if
    // the producer will publish again).
    __device__ int take_next(const int& slot) const {
        cutlass::arch::NamedBarrier::sync(kThreads, kJobFull);
        const int next = *static_cast<const volatile int*>(&slot);
        if (valid(next)) cutlass::arch::NamedBarrier::arrive(kThreads, kJobEmpty);
        return next;
    }
};

}  // namespace flashmask::sm90
