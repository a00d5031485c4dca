// The SM90 backward's consumer mainloop: two consumer warpgroups own 64 keys each of a job's key
// block and take its query blocks as the producer queued them. S^T = K Q^T and dP^T = V dO^T leave
// P^T and dS^T in registers as the A operands of dV += P^T dO and dK += dS^T Q; dS also goes to
// shared memory for dQ = dS K, which the warpgroups split by head dim and hand to the dQ warps in
// turn (bwd_dq_warps.h). Above head dim 128 (Traits::kSplitHeadDim) the warpgroups share 64 keys:
// one computes S^T and P^T, the other dP^T and dS^T (scores_by_role), and each dK and dV for half the
// head dim, with P^T and dS^T from shared memory. The element mask (mask/element_mask.h) runs only
// where a block's ticket says the tile needs a compare.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/cp_async.h"
#include "common/params.h"
#include "common/softcap.h"
#include "mask/element_mask.h"
#include "sm90/block_ticket.h"
#include "sm90/bwd_barriers.h"
#include "sm90/bwd_job.h"
#include "sm90/wgmma_ops.h"

namespace flashmask::sm90 {
using namespace cute;

// kSoftcap: the scores are soft-capped (common/softcap.h).
template <typename Traits, bool Is_causal, int kMaskC, bool kSoftcap>
struct BwdMainloop {
    static constexpr bool Has_mask = kMaskC > 0;
    static constexpr int kBlockM = Traits::kBlockM;
    static constexpr int kBlockN = Traits::kBlockN;
    static constexpr int kDqHandoff = Traits::kConsumerThreads + 32;      // the consumers and one dQ warp
    static constexpr int kDqCols = Traits::kHeadDim / Traits::kDqSlices;  // the head-dim columns of a dQ slice
    using Element = typename Traits::Element;
    using SharedStorage = typename Traits::SharedStorage;
    using Pipeline = typename Traits::Pipeline;
    using Job = KeyJob<Traits, Is_causal, Has_mask>;
    using AccK = decltype(partition_fragment_C(std::declval<typename Traits::TiledMmaK&>(), typename Traits::TileK{}));
    using AccV = decltype(partition_fragment_C(std::declval<typename Traits::TiledMmaV&>(), typename Traits::TileV{}));

    SharedStorage& shared;
    Pipeline& pipeline_q;
    const int ctid;  // this thread among the consumers
    // The Q/dO pipeline's state, K and V's barrier phase and the ring position run on across jobs.
    cutlass::PipelineState<Traits::kStages> state;
    int kv_phase = 0;
    int taken = 0;  // tickets read, over all jobs

    __forceinline__ __device__ BwdMainloop(SharedStorage& shared_, Pipeline& q, int ctid_)
        : shared(shared_), pipeline_q(q), ctid(ctid_) {}

    // The shared-memory tiles, in the layouts the GEMMs read them (t: transposed).
    template <typename Layout, typename Buffer>
    static __forceinline__ __device__ auto view(Buffer& buffer) {
        return make_tensor(make_smem_ptr(buffer.data()), Layout{});
    }
    __forceinline__ __device__ auto s_q() { return view<typename Traits::SmemLayoutQ>(shared.q); }
    __forceinline__ __device__ auto s_qt() { return view<typename Traits::SmemLayoutQt>(shared.q); }
    __forceinline__ __device__ auto s_do() { return view<typename Traits::SmemLayoutDO>(shared.dout); }
    __forceinline__ __device__ auto s_dot() { return view<typename Traits::SmemLayoutDOt>(shared.dout); }
    __forceinline__ __device__ auto s_k() { return view<typename Traits::SmemLayoutK>(shared.k); }
    __forceinline__ __device__ auto s_kt() { return view<typename Traits::SmemLayoutKt>(shared.k); }
    __forceinline__ __device__ auto s_v() { return view<typename Traits::SmemLayoutV>(shared.v); }
    __forceinline__ __device__ auto s_ds() { return view<typename Traits::SmemLayoutDS>(shared.ds); }
    __forceinline__ __device__ auto s_dst() { return view<typename Traits::SmemLayoutDSt>(shared.ds); }
    __forceinline__ __device__ auto s_pt() { return view<typename Traits::SmemLayoutDSt>(shared.p); }  // split only

    // P^T = exp2(S^T scale - LSE) of a tile with the keys as rows: in the input dtype into rp where
    // kKeepP, else into st. With the cap st takes P^T times the cap's slope 1 - t^2 for dS while t is
    // at hand (a masked t is -inf: clamped to the slope's zero).
    template <bool kKeepP, typename ST, typename RP, typename Coords>
    static __forceinline__ __device__ void probabilities(ST& st, RP& rp, const Coords& cST, const float* lse_rows,
                                                         float scale_log2) {
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(st); ++ni) {
            const float lse_log2 = lse_rows[get<1>(cST(0, ni))];
            CUTE_UNROLL
            for (int mi = 0; mi < size<0>(st); ++mi) {
                const float pr = exp2f(st(mi, ni) * scale_log2 - lse_log2);
                if constexpr (kKeepP) rp(mi, ni) = static_cast<Element>(pr);
                if constexpr (kSoftcap) {
                    const float t = fmaxf(st(mi, ni), -1.f);
                    st(mi, ni) = pr * (1.f - t * t);
                } else if constexpr (!kKeepP) {
                    st(mi, ni) = pr;
                }
            }
        }
    }

    // Every query block that sees the job's keys: accumulates dK (unscaled) and dV of this query
    // head's slice and hands each block's dQ tile to the dQ warps.
    __forceinline__ __device__ void run(const BwdParams& p, const Job& job, AccK& acc_dk, AccV& acc_dv) {
        typename Traits::TiledMmaSdP mma_sdp;
        typename Traits::TiledMmaK mma_k;
        typename Traits::TiledMmaV mma_v;
        typename Traits::TiledMmaQ mma_q;
        auto thr_sdp = mma_sdp.get_thread_slice(ctid);
        auto thr_k = mma_k.get_thread_slice(ctid);
        auto thr_v = mma_v.get_thread_slice(ctid);
        auto thr_q = mma_q.get_thread_slice(ctid);
        // dS^T leaves the registers by stmatrix.trans, 8x8 blocks transposed into dS's key-contiguous
        // rows (an element-wise copy takes a generic 16-bit store, a byte permute and 64-bit address
        // arithmetic per element).
        auto r2s_ds = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, Element>{}, mma_sdp);
        auto thr_r2s_ds = r2s_ds.get_thread_slice(ctid);
        Tensor tDSsdSt = thr_r2s_ds.partition_D(s_dst());
        Tensor tSrK = thr_sdp.partition_fragment_A(s_k());
        Tensor tSrV = thr_sdp.partition_fragment_A(s_v());
        Tensor tSrQ = thr_sdp.partition_fragment_B(s_q());
        Tensor tSrdO = thr_sdp.partition_fragment_B(s_do());
        Tensor tKVrQt = thr_k.partition_fragment_B(s_qt());
        Tensor tKVrdOt = thr_v.partition_fragment_B(s_dot());
        Tensor tQrdS = thr_q.partition_fragment_A(s_ds());
        // (key, query) of each score this thread holds.
        Tensor cST_rc = rowcol(thr_sdp.partition_C(make_identity_tensor(typename Traits::TileST{})));
        // Each thread's dQ values go to shared memory four at a time, a warp's 16-byte stores
        // side by side (the row-major tile took 8-way bank conflicts); the accumulator in global
        // memory keeps this order and dq_convert_kernel undoes it.
        float4* const dq_out = reinterpret_cast<float4*>(shared.dq) + ctid;
        const int c0 = job.c0;

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
            // The block's LSE * log2(e) (+inf past the last query: P = 0 there) and D (0 there).
            const float* lse_rows = shared.row_stats[state.index()][0];
            const float* d_rows = shared.row_stats[state.index()][1];
            if constexpr (Traits::kSplitHeadDim) {
                scores_by_role(p, r0, c0, compare, lse_rows, d_rows, acc_dk, acc_dv);
            } else {
                wgmma_gemm</*zero_init=*/true>(mma_sdp, tSrK, tSrQ(_, _, _, state.index()), acc_s);
                wgmma_gemm</*zero_init=*/true>(mma_sdp, tSrV, tSrdO(_, _, _, state.index()), acc_dp);
                warpgroup_wait<1>();  // S^T is in; dP^T may still run

                // P^T = exp(S^T scale - LSE), queries as columns; with kEarlyDv, dV += P^T dO runs
                // while dP^T lands and dS^T is computed.
                if constexpr (kSoftcap) softcap_scores(acc_s, p.softcap_scale);
                Tensor st = rowcol(acc_s);
                if (compare.any) {
                    mask_scores<Is_causal, kMaskC, /*kKeyRows=*/true>(st, cST_rc, compare, r0, c0, p.sk, p.sk - p.sq,
                                                                      shared.mask_cols);
                }
                Tensor rP = make_tensor<Element>(acc_s.layout());
                Tensor rp = rowcol(rP);
                // Without the cap P^T stays in st and becomes the dV operand at issue_dv.
                probabilities</*kKeepP=*/kSoftcap>(st, rp, cST_rc, lse_rows, p.scale_log2);
                auto issue_dv = [&]() {
                    if constexpr (!kSoftcap) {
                        Tensor converted = convert_to<Element>(acc_s);
                        CUTE_UNROLL
                        for (int i = 0; i < size(rP); ++i) rP(i) = converted(i);
                    }
                    wgmma_gemm</*zero_init=*/false>(mma_v, make_tensor(rP.data(), acc_as_a_layout(rP.layout())),
                                                    tKVrdOt(_, _, _, state.index()), acc_dv);
                };
                if constexpr (Traits::kEarlyDv) issue_dv();
                warpgroup_wait<Traits::kEarlyDv ? 1 : 0>();  // dP^T is in (an early dV may still run)

                // dS^T = P^T (dP^T - D) (with the cap, st holds P^T times its slope); dK += dS^T Q.
                Tensor dpt = rowcol(acc_dp);
                CUTE_UNROLL
                for (int ni = 0; ni < size<1>(dpt); ++ni) {
                    const float d = d_rows[get<1>(cST_rc(0, ni))];
                    CUTE_UNROLL
                    for (int mi = 0; mi < size<0>(dpt); ++mi) dpt(mi, ni) = st(mi, ni) * (dpt(mi, ni) - d);
                }
                if constexpr (!Traits::kEarlyDv) issue_dv();
                Tensor rdS = convert_to<Element>(acc_dp);
                wgmma_gemm</*zero_init=*/false>(mma_k, make_tensor(rdS.data(), acc_as_a_layout(rdS.layout())),
                                                tKVrQt(_, _, _, state.index()), acc_dk);
                // dS into shared memory once both warpgroups are done reading the last block's.
                cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kBwdDsBarrier);
                copy(r2s_ds, thr_r2s_ds.retile_S(rdS), tDSsdSt);
                cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read by wgmma next
                cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kBwdDsBarrier);
            }
            // dQ slice by slice into the dQ warps' buffer, the first once the last tile has been sent.
            CUTE_UNROLL
            for (int slice = 0; slice < Traits::kDqSlices; ++slice) {
                Tensor acc_dq = partition_fragment_C(mma_q, typename Traits::TileDq{});
                Tensor sKt_slice = local_tile(s_kt(), Shape<Int<kDqCols>, Int<kBlockN>>{}, make_coord(slice, _0{}));
                wgmma_gemm</*zero_init=*/true>(mma_q, tQrdS, thr_q.partition_fragment_B(sKt_slice), acc_dq);
                warpgroup_wait<0>();
                if (slice == 0) {
                    pipeline_q.consumer_release(state);  // dK and dV, the last readers of Q and dO, are done
                    ++state;
                    cutlass::arch::NamedBarrier::sync(kDqHandoff, kBwdDqEmptyBarrier);
                }
                CUTE_UNROLL
                for (int v = 0; v < size(acc_dq); v += 4) {
                    dq_out[(slice * size(acc_dq) + v) / 4 * Traits::kConsumerThreads] =
                        make_float4(acc_dq(v), acc_dq(v + 1), acc_dq(v + 2), acc_dq(v + 3));
                }
            }
            cutlass::arch::fence_view_async_shared();  // read by the bulk reduction (async proxy)
            dq_full_arrive(kDqHandoff, tile % Traits::kDqWarps);
        }
        // Every GEMM of this job is done: the producer may load the next job's K and V.
        shared.kv_free.arrive();
    }

    // Split head dim, one block: warpgroup 0 computes S^T = K Q^T for all its queries and leaves P^T in
    // shared memory; warpgroup 1 computes dP^T = V dO^T, then dS^T = P^T (dP^T - D) from that P^T.
    // One n64 GEMM each, K and V read once, where splitting the queries instead would take two n32
    // GEMMs a warpgroup and read K and V twice. Then both issue dV and dK for their half of the head dim.
    __forceinline__ __device__ void scores_by_role(const BwdParams& p, int r0, int c0, const TileCompare& compare,
                                                   const float* lse_rows, const float* d_rows, AccK& acc_dk,
                                                   AccV& acc_dv) {
        typename Traits::TiledMmaRole mma_role;
        typename Traits::TiledMmaK mma_k;
        typename Traits::TiledMmaV mma_v;
        const int wtid = ctid % 128;
        const bool scores = __shfl_sync(0xffffffffu, ctid / 128, 0) == 0;  // warp-uniform for ptxas
        auto thr_role = mma_role.get_thread_slice(wtid);
        auto thr_k = mma_k.get_thread_slice(ctid);
        auto thr_v = mma_v.get_thread_slice(ctid);
        Tensor sdSt = s_dst();
        Tensor sPt = s_pt();
        Tensor tKVrQt = thr_k.partition_fragment_B(s_qt());
        Tensor tKVrdOt = thr_v.partition_fragment_B(s_dot());
        auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, Element>{}, mma_role);
        auto thr_r2s = r2s.get_thread_slice(wtid);
        Tensor acc = partition_fragment_C(mma_role, typename Traits::TileST{});
        Tensor st = rowcol(acc);
        Tensor cST = rowcol(thr_role.partition_C(make_identity_tensor(typename Traits::TileST{})));
        const int stage = state.index();
        if (scores) {
            wgmma_gemm</*zero_init=*/true>(mma_role, thr_role.partition_fragment_A(s_k()),
                                           thr_role.partition_fragment_B(s_q())(_, _, _, stage), acc);
        } else {
            wgmma_gemm</*zero_init=*/true>(mma_role, thr_role.partition_fragment_A(s_v()),
                                           thr_role.partition_fragment_B(s_do())(_, _, _, stage), acc);
        }
        warpgroup_wait<0>();
        Tensor rP = make_tensor<Element>(acc.layout());
        if (scores) {
            if constexpr (kSoftcap) softcap_scores(acc, p.softcap_scale);
            if (compare.any) {
                mask_scores<Is_causal, kMaskC, /*kKeyRows=*/true>(st, cST, compare, r0, c0, p.sk, p.sk - p.sq,
                                                                  shared.mask_cols);
            }
            Tensor rp = rowcol(rP);
            probabilities</*kKeepP=*/true>(st, rp, cST, lse_rows, p.scale_log2);
        }
        // Both warpgroups are done with the last block's P^T and dS^T (each waited for its GEMMs).
        cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kBwdDsBarrier);
        if (scores) {
            copy(r2s, thr_r2s.retile_S(rP), thr_r2s.partition_D(sPt));
            // With the cap dS takes P times its slope: handed over where dS^T goes next.
            if constexpr (kSoftcap) copy(r2s, thr_r2s.retile_S(convert_to<Element>(acc)), thr_r2s.partition_D(sdSt));
            cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read by wgmma next
        }
        cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kBwdDsBarrier);  // P^T is in
        wgmma_gemm</*zero_init=*/false>(mma_v, thr_v.partition_fragment_A(sPt), tKVrdOt(_, _, _, stage), acc_dv);
        if (!scores) {
            // P^T (times the slope) back in this thread's accumulator layout, by ldmatrix.trans.
            auto s2r = make_tiled_copy_C(Copy_Atom<SM75_U16x8_LDSM_T, Element>{}, mma_role);
            auto thr_s2r = s2r.get_thread_slice(wtid);
            copy(s2r, thr_s2r.partition_S(kSoftcap ? sdSt : sPt), thr_s2r.retile_D(rP));
            Tensor rp = rowcol(rP);
            CUTE_UNROLL
            for (int ni = 0; ni < size<1>(st); ++ni) {
                const float d = d_rows[get<1>(cST(0, ni))];
                CUTE_UNROLL
                for (int mi = 0; mi < size<0>(st); ++mi) st(mi, ni) = float(rp(mi, ni)) * (st(mi, ni) - d);
            }
            copy(r2s, thr_r2s.retile_S(convert_to<Element>(acc)), thr_r2s.partition_D(sdSt));
            cutlass::arch::fence_view_async_shared();
        }
        cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kBwdDsBarrier);  // dS^T is in
        wgmma_gemm</*zero_init=*/false>(mma_k, thr_k.partition_fragment_A(sdSt), tKVrQt(_, _, _, stage), acc_dk);
    }
};

}  // namespace flashmask::sm90
