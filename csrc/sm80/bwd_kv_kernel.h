// FlashAttention-2 backward with FlashMask tile skipping, key/value-stationary: one CTA per (key
// block, query head, batch) holds K, V and the dK, dV accumulators and walks the query blocks that
// can see its keys. The causal bound and the block's interval bounds trim the range, and runs of
// query blocks that one interval masks entirely are jumped. P is recomputed from the saved LSE.
// dQ is either accumulated across CTAs with fp32 atomics, then scaled and cast by
// dq_convert_kernel, or (deterministic) left to bwd_dq_kernel (bwd_dq_kernel.h).
#pragma once
#include <cute/tensor.hpp>

#include "common/launch_order.h"
#include "common/params.h"
#include "mask/block_walk.h"
#include "mask/element_mask.h"
#include "mask/mask_head.h"
#include "sm80/bwd_common.h"
#include "sm80/bwd_traits.h"
#include "sm80/dq_accum.h"
#include "sm80/tile_ops.h"

namespace flashmask::sm80 {
using namespace cute;

// dQ is accumulated with atomics (dq_accum.h) when p.dq_accum is set (a uniform branch: one
// instantiation serves both modes).
// kSoftcap: the scores are soft-capped (common/softcap.h).
template <typename Traits, bool Is_causal, int kMaskC, bool kSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kv_kernel(const BwdParams p) {
    // Empty on sm_90 in a unit that csrc/instantiations.py builds for older archs only (skips_sm90).
#if !(defined(FLASHMASK_SM80_SKIP_SM90) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900)
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr bool Has_mask = kMaskC > 0;
    using TileQ = typename Traits::TileQ;
    using TileKV = typename Traits::TileKV;
    using TileV = typename Traits::TileV;
    using TileS = typename Traits::TileS;

    extern __shared__ __align__(128) char smem[];
    const int tidx = threadIdx.x;
    // Heads vary fastest within a head group, so the CTAs in flight hold the same key blocks of
    // those heads: with a causal mask the low key blocks, which see the most queries, start first
    // (longest job first), and the short ones fill the tail.
    const int n_blocks = gridDim.x / p.hq;
    const JobHead job = job_and_head(blockIdx.x, n_blocks, p.head_group);
    const int n_block = job.job;
    const int h = job.head;
    const int b = blockIdx.z;
    const int c0 = n_block * kBlockN;
    const int m_end = (p.sq + kBlockM - 1) / kBlockM;
    const int causal_offset = p.sk - p.sq;

    Element* smem_k = reinterpret_cast<Element*>(smem);
    Element* smem_v = smem_k + cosize_v<typename Traits::SmemLayoutKV>;
    Element* smem_q = smem_v + cosize_v<typename Traits::SmemLayoutV>;
    Element* smem_do = smem_q + Traits::kQStages * cosize_v<typename Traits::SmemLayoutQ>;
    Element* smem_p = smem_do + Traits::kQStages * cosize_v<typename Traits::SmemLayoutDO>;
    Element* smem_ds = smem_p + cosize_v<typename Traits::SmemLayoutPdS>;
    int* smem_mask = reinterpret_cast<int*>(smem_ds + cosize_v<typename Traits::SmemLayoutPdS>);
    int* smem_bounds = smem_mask + 4 * kBlockN;
    float* smem_rows = reinterpret_cast<float*>(smem_bounds + kNumBounds);

    // The key block's bounds are read from shared memory at each use: held in registers for the
    // whole walk they pushed the GEMMs' accumulators into spills. With a mask, this kernel is
    // launched twice (bwd_launch.h): the key blocks that some interval reaches run in the masked
    // instantiation, the others in the mask-free one, which runs faster at 255 registers per thread.
    const MaskHead mask = mask_head(p, b, h);
    if (mask.bounds != nullptr) {
        if (tidx < kNumBounds) smem_bounds[tidx] = mask.bounds[n_block * kNumBounds + tidx];
        __syncthreads();
        const int first_row = Is_causal ? max(0, c0 - causal_offset) : 0;
        if (classify_tile(smem_bounds, first_row, p.sq).partial != Has_mask) return;
    }
    const QueryBlockWalk<kBlockM, kBlockN, Is_causal, Has_mask> walk{smem_bounds, c0, p.sq, p.sk, causal_offset, m_end};
    Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutV{});
    Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKt{});
    Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutPdS{});
    Tensor sPt = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutPdSt{});
    Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutPdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutPdSt{});

    typename Traits::TiledMmaSdP mma_sdp;
    auto thr_sdp = mma_sdp.get_thread_slice(tidx);
    typename Traits::TiledMmaKV mma_kv;
    auto thr_kv = mma_kv.get_thread_slice(tidx);
    typename Traits::TiledMmaQ mma_q;
    auto thr_q = mma_q.get_thread_slice(tidx);
    Tensor acc_dk = partition_fragment_C(mma_kv, TileKV{});
    Tensor acc_dv = partition_fragment_C(mma_kv, TileV{});
    clear(acc_dk);
    clear(acc_dv);

    int m_block = walk.visible_at_or_above(walk.begin());
    const BwdHead<Element> head(p, b, h);

    if (m_block < m_end) {
        const BwdGmemLoads<Traits> load(head, p, tidx);
        auto sQ_at = [&](int stage) {
            return make_tensor(make_smem_ptr(smem_q + stage * cosize_v<typename Traits::SmemLayoutQ>),
                               typename Traits::SmemLayoutQ{});
        };
        auto sdO_at = [&](int stage) {
            return make_tensor(make_smem_ptr(smem_do + stage * cosize_v<typename Traits::SmemLayoutDO>),
                               typename Traits::SmemLayoutDO{});
        };
        auto load_q_do = [&](int m, int stage) {
            load.q(m * kBlockM, sQ_at(stage), p.sq - m * kBlockM);
            load.dout(m * kBlockM, sdO_at(stage), p.sq - m * kBlockM);
        };
        // LSE and D of query block m (single-buffered: loaded once the previous block's are used).
        auto load_rows = [&](int m) {
            static_assert(2 * kBlockM <= Traits::kNThreads);
            if (tidx < 2 * kBlockM) {
                const int row = m * kBlockM + tidx % kBlockM;
                const bool is_d = tidx >= kBlockM;
                if (row < p.sq)
                    cp_async_4(smem_rows + tidx, (is_d ? head.dsum : head.lse) + row, true);
                else
                    smem_rows[tidx] = is_d ? 0.f : INFINITY;  // P = 0 on rows past the end
            }
        };
        load.k(c0, sK, p.sk - c0);
        load.v(c0, sV, p.sk - c0);
        if (Has_mask) stage_mask_columns<kBlockN, kMaskC, Traits::kNThreads>(smem_mask, mask.cols, c0, p.sk, tidx);
        load_q_do(m_block, 0);
        load_rows(m_block);
        cp_async_fence();

        // Shared -> register copies of every operand.
        const BwdSmemCopies<Traits> cp(tidx);
        auto copy_kv_a = make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, mma_kv);
        auto thr_kv_a = copy_kv_a.get_thread_slice(tidx);
        auto copy_kv_b = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_kv);
        auto thr_kv_b = copy_kv_b.get_thread_slice(tidx);

        Tensor tSsK = cp.thr_sdp_b.partition_S(sK);
        Tensor tSsV = cp.thr_sdp_b.partition_S(sV);
        Tensor tSrK = thr_sdp.partition_fragment_B(sK);
        Tensor tSrV = thr_sdp.partition_fragment_B(sV);
        Tensor tKVsPt = thr_kv_a.partition_S(sPt);
        Tensor tKVsdSt = thr_kv_a.partition_S(sdSt);
        Tensor tKVrA = thr_kv.partition_fragment_A(sPt);
        Tensor tQsdS = cp.thr_q_a.partition_S(sdS);
        Tensor tQsKt = cp.thr_q_b.partition_S(sKt);
        Tensor tQrdS = thr_q.partition_fragment_A(sdS);
        Tensor tQrKt = thr_q.partition_fragment_B(sKt);
        Tensor tPsP = cp.thr_c.partition_D(sP);
        Tensor tPsdS = cp.thr_c.partition_D(sdS);
        Tensor cS = rowcol(thr_sdp.partition_C(make_identity_tensor(TileS{})));
        const SmemRowStats<kBlockM, decltype(cS)> rows{smem_rows, cS};

        int stage = 0;
        while (m_block < m_end) {
            const int m_next = walk.visible_at_or_above(m_block + 1);
            const int r0 = m_block * kBlockM;
            const TileCompare compare = walk.compare(m_block);
            cp_async_wait<0>();
            __syncthreads();  // Q, dO (and K, V, mask) landed; everyone is done with the other stage, P and dS
            if (Traits::kQStages == 2 && m_next < m_end) {
                load_q_do(m_next, stage ^ 1);
                cp_async_fence();
            }
            Tensor sQ = sQ_at(stage);
            Tensor sdO = sdO_at(stage);
            Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQt{});
            Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutDOt{});

            Tensor acc_s = partition_fragment_C(mma_sdp, TileS{});
            clear(acc_s);
            Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
            gemm_ss(acc_s, tSrQ, tSrK, cp.thr_sdp_a.partition_S(sQ), tSsK, mma_sdp, cp.sdp_a, cp.sdp_b, cp.thr_sdp_a,
                    cp.thr_sdp_b);
            if constexpr (kSoftcap) softcap_scores(acc_s, p.softcap_scale);
            Tensor s_rc = rowcol(acc_s);
            if (compare.any) mask_scores<Is_causal, kMaskC>(s_rc, cS, compare, r0, c0, p.sk, causal_offset, smem_mask);
            probs(s_rc, rows, p.scale_log2);
            // P's shared-memory store drains while dP = dO V^T computes.
            Tensor rP = convert_to<Element>(acc_s);
            copy(cp.c, cp.thr_c.retile_S(rP), tPsP);

            Tensor acc_dp = partition_fragment_C(mma_sdp, TileS{});
            clear(acc_dp);
            Tensor tSrdO = thr_sdp.partition_fragment_A(sdO);
            gemm_ss(acc_dp, tSrdO, tSrV, cp.thr_sdp_a.partition_S(sdO), tSsV, mma_sdp, cp.sdp_a, cp.sdp_b, cp.thr_sdp_a,
                    cp.thr_sdp_b);
            Tensor dp_rc = rowcol(acc_dp);
            dscores<kSoftcap>(dp_rc, s_rc, rows, 1.f / p.scale_log2);
            Tensor rdS = convert_to<Element>(acc_dp);
            copy(cp.c, cp.thr_c.retile_S(rdS), tPsdS);
            __syncthreads();  // P and dS are in shared memory; the rows are used
            if (m_next < m_end) {
                load_rows(m_next);
                cp_async_fence();
            }

            Tensor tKVsdOt = thr_kv_b.partition_S(sdOt);
            Tensor tKVrdOt = thr_kv.partition_fragment_B(sdOt);
            gemm_ss(acc_dv, tKVrA, tKVrdOt, tKVsPt, tKVsdOt, mma_kv, copy_kv_a, copy_kv_b, thr_kv_a, thr_kv_b);
            // dQ before dK, so that its atomics are in flight during the dK GEMM.
            if (p.dq_accum != nullptr) {
                Tensor acc_dq = partition_fragment_C(mma_q, TileQ{});
                clear(acc_dq);
                gemm_ss(acc_dq, tQrdS, tQrKt, tQsdS, tQsKt, mma_q, cp.q_a, cp.q_b, cp.thr_q_a, cp.thr_q_b);
                atomic_add_tile<Traits::kNThreads>(dq_accum_tile<Traits>(p, b, h, m_block), acc_dq, tidx);
            }
            Tensor tKVsQt = thr_kv_b.partition_S(sQt);
            Tensor tKVrQt = thr_kv.partition_fragment_B(sQt);
            gemm_ss(acc_dk, tKVrA, tKVrQt, tKVsdSt, tKVsQt, mma_kv, copy_kv_a, copy_kv_b, thr_kv_a, thr_kv_b);

            if (Traits::kQStages == 1 && m_next < m_end) {
                __syncthreads();  // everyone is done with Q and dO
                load_q_do(m_next, 0);
                cp_async_fence();
            }
            m_block = m_next;
            stage ^= Traits::kQStages - 1;
        }
        __syncthreads();  // K and V are free for the epilogue
    }

    // dK (scaled by the softmax scale) and dV, staged through K's and V's shared buffers; a key
    // block that no query sees writes zeros.
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
    Element* dk_ptr =
        reinterpret_cast<Element*>(p.dk) + b * p.dk_batch_stride + h * p.dk_head_stride + int64_t(c0) * p.dk_row_stride;
    Element* dv_ptr =
        reinterpret_cast<Element*>(p.dv) + b * p.dv_batch_stride + h * p.dv_head_stride + int64_t(c0) * p.dv_row_stride;
    Tensor gdK = make_tensor(make_gmem_ptr(dk_ptr), TileKV{}, make_stride(p.dk_row_stride, _1{}));
    Tensor gdV = make_tensor(make_gmem_ptr(dv_ptr), TileV{}, make_stride(p.dv_row_stride, _1{}));
    store_tile<typename Traits::SmemCopyAtomC, typename Traits::GmemTiledCopyOut, Element>(acc_dk, mma_kv, sK, gdK,
                                                                                           p.sk - c0, p.d, tidx);
    store_tile<typename Traits::SmemCopyAtomC, typename Traits::CopiesV::GmemTiledCopyOut, Element>(
        acc_dv, mma_kv, sV, gdV, p.sk - c0, p.d_v, tidx);
#endif
}

}  // namespace flashmask::sm80
