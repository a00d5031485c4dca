// Hopper backward with FlashMask skipping: key/value-stationary, TMA loads, wgmma, warp
// specialisation.
//
// (Key block of 128, query head, batch) jobs (tile_scheduler.h) run in the order of the mask's job
// list (heaviest key blocks first, few heads in flight: MaskMeta::jobs; in deterministic mode each
// head's key blocks ascending) or, without one, of job_and_head, one CTA per SM drawing them. The
// producer warpgroup gives its registers away; one
// warp loads each job's K and V once the consumers are done with the last job's, then walks the
// query blocks that can see these keys (QueryBlockWalk: the causal bound, the block's interval
// bounds, jumps over fully masked runs) and loads each one's Q and dO by TMA into a pipeline, with
// the block's LSE and D (bulk copies of the rows the preprocessing padded) and a ticket saying
// which block it is and what its tile needs (block_ticket.h), so that the consumers walk nothing.
// Two consumer warpgroups own 64 keys each: S^T = K Q^T and dP^T = V dO^T leave P^T and dS^T in
// registers as the A operands of dV += P^T dO and dK += dS^T Q; dS also goes to shared memory for
// dQ = dS K, which the warpgroups split by head dim and hand to two more producer warps in turn,
// which add each tile to the fp32 dQ accumulator with one bulk reduction. dK and dV leave by TMA
// store.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/cp_async.h"
#include "common/launch_order.h"
#include "common/params.h"
#include "mask/block_walk.h"
#include "mask/element_mask.h"
#include "mask/mask_head.h"
#include "sm90/block_ticket.h"
#include "sm90/bwd_traits.h"
#include "sm90/tile_scheduler.h"
#include "sm90/wgmma_ops.h"

namespace flashmask::sm90 {
using namespace cute;

template <typename TmaQ, typename TmaDO, typename TmaK, typename TmaV, typename TmaStore>
struct BwdArgs {
    BwdParams p;
    TmaQ tma_q;
    TmaDO tma_do;
    TmaK tma_k;
    TmaV tma_v;
    TmaStore tma_dk, tma_dv;
};

// Named barriers: the consumers' first staging (mask columns, the first block's LSE and D) and dS
// in shared memory; the dQ tile handed from the consumers to a dQ warp (full) and back (empty).
constexpr int kBwdStagedBarrier = 1;
constexpr int kBwdDsBarrier = 2;
constexpr int kBwdDqFullBarrier = 3;
constexpr int kBwdDqEmptyBarrier = 4;
constexpr int kBwdStoreBarrier = 5;    // 5 and 6: each consumer warpgroup's dK and dV buffers
constexpr int kBwdDqFullBarrier2 = 8;  // 8 and 9: the full barriers of the second and third dQ warps

// dst[0, bytes) += src[0, bytes) in fp32, by the TMA unit (a bulk reduction; part of the issuing
// thread's bulk group: cute::tma_store_arrive commits it, cute::tma_store_wait waits for its reads).
__forceinline__ __device__ void bulk_reduce_add(float* dst, const float* src, int bytes) {
    const uint32_t s = cute::cast_smem_ptr_to_uint(src);
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(s),
                 "r"(bytes)
                 : "memory");
}

// Deterministic mode: the key blocks of a (batch, head) that see a query block add their dQ to it in
// increasing order, so that a job only ever waits for jobs drawn before it (job_and_head). The query
// block's semaphore holds one more than the last key block that added to it (0: none yet); a key
// block waits there for the key block below it that sees the query block (QueryBlockWalk::
// previous_visitor) and then writes its own number. Key blocks that do not see a query block never
// touch its semaphore, so that a document's key blocks never wait for another document's jobs.
// Deterministic jobs walk their query blocks downwards where that shortens the waits (KeyJob).
__forceinline__ __device__ void wait_turn(const int* sem, int turn) {
    for (;;) {
        int v;
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(sem) : "memory");
        if (v == turn) return;
        __nanosleep(64);
    }
}
__forceinline__ __device__ void pass_turn(int* sem, int next) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(sem), "r"(next) : "memory");
}

// dQ warp `slot` of kDqWarps: the job's visible query blocks go to the dQ warps in turn, and each
// block's dQ tile goes from shared memory into the fp32 accumulator by one bulk reduction, off the
// consumers' path; with p.dq_semaphore, in turn (above). The buffer goes back to the consumers as
// soon as the reduction has read it, so that they wait for a late turn only when their next tile is
// ready too; in deterministic mode the warp then holds the block's turn until the addition is
// complete in global memory, while the next warp already waits for the next block's turn (with one
// warp that completion bounded every step). Each warp takes its tiles on its own full barrier: one
// shared barrier would let a warp early for its tile complete another's phase. Returns whether this
// warp holds the buffer once the job is done (it read the last tile, or the job has none: slot 0).
__forceinline__ __device__ int dq_full_barrier(int slot) {
    return slot == 0 ? kBwdDqFullBarrier : kBwdDqFullBarrier2 + slot - 1;
}

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
                if (lane == 0) wait_turn(sem + m, previous + 1);
            }
            cutlass::arch::NamedBarrier::sync(handoff_threads, dq_full_barrier(slot));
            if (lane == 0) {
                if (sem != nullptr) asm volatile("fence.proxy.async.global;\n" ::: "memory");  // after the acquire
                bulk_reduce_add(dq_accum + int64_t(m) * kTile, smem_dq, kTile * int(sizeof(float)));
                tma_store_arrive();
                tma_store_wait<0>();  // read out of shared memory
            }
            __syncwarp();
            if (!last) cutlass::arch::NamedBarrier::arrive(handoff_threads, kBwdDqEmptyBarrier);
            if (sem != nullptr && lane == 0) {
                // Complete in global memory (not only read from shared memory) before the turn passes.
                asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
                asm volatile("fence.proxy.async.global;\n" ::: "memory");
                pass_turn(sem + m, job.n_block + 1);
            }
            __syncwarp();
        } else if (last) {
            return false;
        }
        m = m_next;
    }
    return true;
}

// What a job means: its keys, heads and mask slice and the query blocks that see the keys;
// identical in every warp.
template <typename Traits, bool Is_causal, bool Has_mask>
struct KeyJob {
    int n_block, h, b, kv_h, c0, m_end, m_first;
    bool down;  // walks its query blocks downwards (deterministic mode, below)
    MaskHead mask;
    QueryBlockWalk<Traits::kBlockM, Traits::kBlockN, Is_causal, Has_mask> walk;

    __device__ KeyJob(const BwdParams& p, const BwdJob& job)
        : n_block(job.n_block),
          h(job.h),
          b(job.b),
          kv_h(job.h / p.q_per_kv_head),
          c0(job.n_block * Traits::kBlockN),
          m_end((p.sq + Traits::kBlockM - 1) / Traits::kBlockM),
          down(p.dq_semaphore != nullptr),
          mask(mask_head(p, job.b, job.h)),
          walk{Has_mask ? mask.bounds + job.n_block * kNumBounds : nullptr, c0, p.sq, p.sk, p.sk - p.sq, m_end} {
        // The deterministic walk's direction, one per head (jobs of both directions side by side
        // would wait for each other's whole walks). Down: the key block below reaches a query block
        // the two share before or with this one, where walking up it comes two steps later on a
        // band and chains the ends of the head's jobs. But where the last key block sees query
        // block 0 (global tokens, or no mask), every key block shares it, and each job walking down
        // would end waiting there for the one before: such heads walk up, as the atomic backward does.
        if (down) {
            const auto last_walk = walk_of(p, (p.sk - 1) / Traits::kBlockN);
            down = last_walk.visible_at_or_above(last_walk.begin()) != 0;
        }
        m_first = down ? walk.visible_at_or_below(m_end - 1) : walk.visible_at_or_above(walk.begin());
    }
    // The walk of key block n of this job's (batch, head), whose bounds lie next to this block's.
    __device__ decltype(walk) walk_of(const BwdParams& p, int n) const {
        return {Has_mask ? walk.bnd + (n - n_block) * kNumBounds : nullptr,
                n * Traits::kBlockN,
                p.sq,
                p.sk,
                p.sk - p.sq,
                m_end};
    }
    // The visible query block after m in the walk's direction; valid() once past the last.
    __device__ int next(int m) const {
        return down ? walk.visible_at_or_below(m - 1) : walk.visible_at_or_above(m + 1);
    }
    __device__ bool valid(int m) const { return m >= 0 && m < m_end; }
    __device__ bool empty() const { return !valid(m_first); }
};

template <typename Traits, bool Is_causal, int kMaskC, typename Args>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel(const __grid_constant__ Args args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool Has_mask = kMaskC > 0;
    using Element = typename Traits::Element;
    using SharedStorage = typename Traits::SharedStorage;
    using Pipeline = typename Traits::Pipeline;
    using Job = KeyJob<Traits, Is_causal, Has_mask>;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    const BwdParams& p = args.p;

    extern __shared__ __align__(1024) char smem_raw[];
    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem_raw);
    const int warp_group = threadIdx.x / 128;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    constexpr int kDqWarps = Traits::kDqWarps;
    const BwdScheduler<Traits::kConsumerThreads, kDqWarps> scheduler(p, kBlockN);
    const int causal_offset = p.sk - p.sq;

    // Barriers: K and V's (one arrival with its byte count, one phase per job that loads them), the
    // consumers' release of K and V once a job's last GEMM is done (one phase per such job), and
    // the Q/dO pipeline, whose state runs on across jobs.
    if (threadIdx.x == 0) {
        shared.barrier_kv.init(1);
        shared.kv_free.init(Traits::kConsumerThreads);
    }
    typename Pipeline::Params pipe_params;
    pipe_params.transaction_bytes = 2 * Traits::kTmaBytesQ + 2 * Traits::kBytesRows;
    pipe_params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    pipe_params.is_leader = threadIdx.x == 0;
    pipe_params.num_consumers = Traits::kConsumerThreads;
    Pipeline pipeline_q(shared.pipeline_q, pipe_params, Shape<_1, _1, _1>{});
    cutlass::arch::fence_barrier_init();
    __syncthreads();

    constexpr int kDqHandoff = Traits::kConsumerThreads + 32;  // the consumers and one dQ warp
    if (warp_group == 0) {
        cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
        if (warp > kDqWarps) return;
        if (warp >= 1) {
            // A dQ warp, job after job; the warp that read a job's last tile hands the buffer to dK and dV.
            for (int x = scheduler.first(); scheduler.valid(x); x = scheduler.take_next(shared.next_job)) {
                const Job job(p, scheduler.job(p, x));
                const bool holds = dq_warp<Traits, kDqWarps>(p, job, shared.dq, warp - 1, kDqHandoff);
                if (holds) cutlass::arch::NamedBarrier::arrive(kDqHandoff, kBwdDqEmptyBarrier);
            }
            return;
        }
        // The producer warp: each job's K and V once the consumers are done with the last job's, then
        // Q, dO, LSE and D of the query blocks that see the keys, each with its ticket.
        Tensor mQ = args.tma_q.get_tma_tensor(make_shape(p.sq, p.d, p.hq, p.b));
        Tensor mdO = args.tma_do.get_tma_tensor(make_shape(p.sq, p.d, p.hq, p.b));
        Tensor mK = args.tma_k.get_tma_tensor(make_shape(p.sk, p.d, p.hk, p.b));
        Tensor mV = args.tma_v.get_tma_tensor(make_shape(p.sk, p.d, p.hk, p.b));
        Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
        Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutQ{});
        Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
        Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutKV{});
        using BarrierType = cutlass::arch::ClusterTransactionBarrier::ValueType;
        auto state = cutlass::make_producer_start_state<Pipeline>();
        int kv_free_phase = 0;
        bool kv_loaded = false;
        int queued = 0;  // tickets written, over all jobs
        for (int x = scheduler.first(); scheduler.valid(x); x = scheduler.publish_next(p, x, shared.next_job)) {
            const Job job(p, scheduler.job(p, x));
            if (job.empty()) continue;  // the consumers write zeros: nothing to load
            Tensor gQ = local_tile(mQ(_, _, job.h, job.b), typename Traits::TileQ{}, make_coord(_, _0{}));
            Tensor gdO = local_tile(mdO(_, _, job.h, job.b), typename Traits::TileQ{}, make_coord(_, _0{}));
            Tensor gK = local_tile(mK(_, _, job.kv_h, job.b), typename Traits::TileKV{}, make_coord(job.n_block, _0{}));
            Tensor gV = local_tile(mV(_, _, job.kv_h, job.b), typename Traits::TileKV{}, make_coord(job.n_block, _0{}));
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
                shared.barrier_kv.arrive_and_expect_tx(2 * Traits::kTmaBytesKV);
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
        return;
    }

    // Consumers.
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    const int ctid = threadIdx.x - 128;
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmaKV mma_kv;
    typename Traits::TiledMmaQ mma_q;
    auto thr_sdp = mma_sdp.get_thread_slice(ctid);
    auto thr_kv = mma_kv.get_thread_slice(ctid);
    auto thr_q = mma_q.get_thread_slice(ctid);
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutQt{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutKV{});
    Tensor sKt = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKt{});
    Tensor sdS = make_tensor(make_smem_ptr(shared.ds.data()), typename Traits::SmemLayoutDS{});
    // dS^T leaves the registers by stmatrix.trans, 8x8 blocks transposed into dS's key-contiguous
    // rows (an element-wise copy takes a generic 16-bit store, a byte permute and 64-bit address
    // arithmetic per element).
    auto r2s_ds = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, Element>{}, mma_sdp);
    auto thr_r2s_ds = r2s_ds.get_thread_slice(ctid);
    Tensor tDSsdSt =
        thr_r2s_ds.partition_D(make_tensor(make_smem_ptr(shared.ds.data()), typename Traits::SmemLayoutDSt{}));
    Tensor tSrK = thr_sdp.partition_fragment_A(sK);
    Tensor tSrV = thr_sdp.partition_fragment_A(sV);
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);
    Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
    Tensor tKVrQt = thr_kv.partition_fragment_B(sQt);
    Tensor tKVrdOt = thr_kv.partition_fragment_B(sdOt);
    Tensor tQrdS = thr_q.partition_fragment_A(sdS);
    Tensor tQrKt = thr_q.partition_fragment_B(sKt);
    // (key, query) of each score this thread holds.
    Tensor cST = thr_sdp.partition_C(make_identity_tensor(typename Traits::TileST{}));
    Tensor cST_rc = rowcol(cST);
    // Each thread's dQ values go to shared memory four at a time, a warp's 16-byte stores
    // side by side (the row-major tile took 8-way bank conflicts); the accumulator in global
    // memory keeps this order and dq_convert_kernel undoes it.
    float4* const dq_out = reinterpret_cast<float4*>(shared.dq) + ctid;
    cutlass::PipelineState<Traits::kStages> state;
    int kv_phase = 0;
    int taken = 0;  // tickets read, over all jobs

    for (int x = scheduler.first(); scheduler.valid(x); x = scheduler.take_next(shared.next_job)) {
        const Job job(p, scheduler.job(p, x));
        const int c0 = job.c0;
        Tensor acc_dk = partition_fragment_C(mma_kv, typename Traits::TileKV{});
        Tensor acc_dv = partition_fragment_C(mma_kv, typename Traits::TileKV{});
        clear(acc_dk);
        clear(acc_dv);

        if (!job.empty()) {
            // The interval values of this job's keys, for every partial tile. (The last job's
            // readers of them all passed its final dQ hand-over.)
            if constexpr (Has_mask) {
                stage_mask_columns<kBlockN, kMaskC, Traits::kConsumerThreads>(shared.mask_cols, job.mask.cols, c0, p.sk,
                                                                              ctid);
                cp_async_fence();
                cp_async_wait<0>();
                cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kBwdStagedBarrier);
            }

            // (Issuing the next block's S^T and dP^T before this block's dQ leaves would overlap more,
            // but keeping both live across the loop spills at 240 registers.)
            Tensor acc_s = partition_fragment_C(mma_sdp, typename Traits::TileST{});
            Tensor acc_dp = partition_fragment_C(mma_sdp, typename Traits::TileST{});
            shared.barrier_kv.wait(kv_phase);
            kv_phase ^= 1;
            for (int tile = 0, more = true; more; ++tile) {
                pipeline_q.consumer_wait(state);
                const BlockTicket ticket{shared.tickets[taken++ % Traits::kTickets]};
                const int r0 = ticket.block() * kBlockM;
                const TileCompare compare = ticket.compare();
                more = !ticket.last();
                wgmma_gemm</*zero_init=*/true>(mma_sdp, tSrK, tSrQ(_, _, _, state.index()), acc_s);
                wgmma_gemm</*zero_init=*/true>(mma_sdp, tSrV, tSrdO(_, _, _, state.index()), acc_dp);
                // The block's LSE * log2(e) (+inf past the last query: P = 0 there) and D (0 there).
                const float* lse_rows = shared.row_stats[state.index()][0];
                const float* d_rows = shared.row_stats[state.index()][1];
                warpgroup_wait<1>();  // S^T is in; dP^T may still run

                // P^T = exp(S^T scale - LSE), queries as columns; with kEarlyDv, dV += P^T dO runs
                // while dP^T lands and dS^T is computed.
                Tensor st = rowcol(acc_s);
                if (compare.any) {
                    mask_scores<Is_causal, kMaskC, /*kKeyRows=*/true>(st, cST_rc, compare, r0, c0, p.sk, causal_offset,
                                                                      shared.mask_cols);
                }
                CUTE_UNROLL
                for (int ni = 0; ni < size<1>(st); ++ni) {
                    const float lse_log2 = lse_rows[get<1>(cST_rc(0, ni))];
                    CUTE_UNROLL
                    for (int mi = 0; mi < size<0>(st); ++mi) st(mi, ni) = exp2f(st(mi, ni) * p.scale_log2 - lse_log2);
                }
                Tensor rP = make_tensor<Element>(acc_s.layout());
                auto issue_dv = [&]() {
                    Tensor converted = convert_to<Element>(acc_s);
                    CUTE_UNROLL
                    for (int i = 0; i < size(rP); ++i) rP(i) = converted(i);
                    wgmma_gemm</*zero_init=*/false>(mma_kv, make_tensor(rP.data(), acc_as_a_layout(rP.layout())),
                                                    tKVrdOt(_, _, _, state.index()), acc_dv);
                };
                if constexpr (Traits::kEarlyDv) issue_dv();
                warpgroup_wait<Traits::kEarlyDv ? 1 : 0>();  // dP^T is in (an early dV may still run)

                // dS^T = P^T (dP^T - D); dK += dS^T Q.
                Tensor dpt = rowcol(acc_dp);
                CUTE_UNROLL
                for (int ni = 0; ni < size<1>(dpt); ++ni) {
                    const float d = d_rows[get<1>(cST_rc(0, ni))];
                    CUTE_UNROLL
                    for (int mi = 0; mi < size<0>(dpt); ++mi) dpt(mi, ni) = st(mi, ni) * (dpt(mi, ni) - d);
                }
                if constexpr (!Traits::kEarlyDv) issue_dv();
                Tensor rdS = convert_to<Element>(acc_dp);
                wgmma_gemm</*zero_init=*/false>(mma_kv, make_tensor(rdS.data(), acc_as_a_layout(rdS.layout())),
                                                tKVrQt(_, _, _, state.index()), acc_dk);

                // dS into shared memory once both warpgroups are done reading the last block's.
                cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kBwdDsBarrier);
                copy(r2s_ds, thr_r2s_ds.retile_S(rdS), tDSsdSt);
                cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read by wgmma next
                cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kBwdDsBarrier);
                Tensor acc_dq = partition_fragment_C(mma_q, typename Traits::TileQ{});
                wgmma_gemm</*zero_init=*/true>(mma_q, tQrdS, tQrKt, acc_dq);
                warpgroup_wait<0>();
                pipeline_q.consumer_release(state);
                ++state;
                // dQ to the dQ warps' buffer once the last one has been sent.
                cutlass::arch::NamedBarrier::sync(kDqHandoff, kBwdDqEmptyBarrier);
                CUTE_UNROLL
                for (int v = 0; v < size(acc_dq); v += 4) {
                    dq_out[(v / 4) * Traits::kConsumerThreads] =
                        make_float4(acc_dq(v), acc_dq(v + 1), acc_dq(v + 2), acc_dq(v + 3));
                }
                cutlass::arch::fence_view_async_shared();  // read by the bulk reduction (async proxy)
                cutlass::arch::NamedBarrier::arrive(kDqHandoff, dq_full_barrier(tile % kDqWarps));
            }
            // Every GEMM of this job is done: the producer may load the next job's K and V.
            shared.kv_free.arrive();
        }

        // dK (scaled by the softmax scale) and dV of this query head's slice; a key block no query
        // sees writes zeros. One after the other through the dQ buffer, once the dQ warp that read
        // the last dQ tile is done with it; before the buffer takes the next job's dQ, the TMA unit
        // has read dV (each warpgroup waits for its store here, and the next dQ hand-over waits for both).
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
        using Store = typename Traits::KVStore;
        const auto shape = make_shape(p.sk, p.d, p.hq, p.b);
        const int wg_barrier = kBwdStoreBarrier + ctid / 128;
        cutlass::arch::NamedBarrier::sync(kDqHandoff, kBwdDqEmptyBarrier);
        Element* const buffer = reinterpret_cast<Element*>(shared.dq);
        const int row_tile0 = job.n_block * Traits::kConsumerWarpgroups;
        Store::template store<kBlockN>(args.tma_dk, shape, acc_dk, mma_kv, buffer, row_tile0, job.h, job.b, ctid,
                                       wg_barrier);
        Store::template store<kBlockN>(args.tma_dv, shape, acc_dv, mma_kv, buffer, row_tile0, job.h, job.b, ctid,
                                       wg_barrier);
        Store::drain(ctid);
        cutlass::arch::NamedBarrier::sync(128, wg_barrier);
    }
#endif
}

// dQ = softmax_scale * accumulator, cast to the input dtype. The accumulator holds one
// [BlockM, head dim] tile per (batch, head, query block) in the order the kernel stages it: value v
// of consumer thread t at (v / 4) * 4 * kConsumerThreads + 4 * t + v % 4. One CTA per tile, one
// thread per consumer thread: each puts its values where TiledMmaQ's partition says they belong in
// a row-major tile in shared memory, and the CTA writes the tile's rows out in 16-byte pieces (2-byte
// stores scattered by the MMA layout filled a quarter of each 32-byte sector they touched). The
// API guarantees what the pieces need: head dim and dQ's strides multiples of 8, 16-byte aligned.
template <typename Traits>
__global__ void dq_convert_kernel(const BwdParams p) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
    constexpr int kPitch = kHeadDim + 8;  // 16 bytes of padding per row: the row-major stores spread over the banks
    constexpr int kPieces = kHeadDim / 8;
    __shared__ alignas(16) Element tile[kBlockM * kPitch];
    const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    typename Traits::TiledMmaQ mma_q;
    const Tensor coords =
        mma_q.get_thread_slice(threadIdx.x).partition_C(make_identity_tensor(typename Traits::TileQ{}));
    const int64_t index = (int64_t(b) * p.hq + h) * gridDim.x + m;
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum + index * kBlockM * kHeadDim) + threadIdx.x;
    CUTE_UNROLL
    for (int v = 0; v < size(coords); v += 4) {
        const float4 x = src[(v / 4) * Traits::kConsumerThreads];
        const float xs[4] = {x.x, x.y, x.z, x.w};
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) {
            tile[get<0>(coords(v + j)) * kPitch + get<1>(coords(v + j))] = Element(xs[j] * p.softmax_scale);
        }
    }
    __syncthreads();
    Element* dq = static_cast<Element*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride;
    for (int i = threadIdx.x; i < kBlockM * kPieces; i += Traits::kConsumerThreads) {
        const int r = i / kPieces, c = (i % kPieces) * 8, row = m * kBlockM + r;
        if (row < p.sq && c < p.d) {
            *reinterpret_cast<uint4*>(dq + int64_t(row) * p.dq_row_stride + c) =
                *reinterpret_cast<const uint4*>(tile + r * kPitch + c);
        }
    }
}

}  // namespace flashmask::sm90
