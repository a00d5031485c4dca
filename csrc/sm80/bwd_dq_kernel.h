// Deterministic dQ of the FlashAttention-2 backward: query-stationary, so that each dQ tile is
// summed in registers over its visible key blocks in a fixed order (no atomics).
#pragma once
#include <cute/tensor.hpp>

#include "common/params.h"
#include "mask/block_walk.h"
#include "mask/element_mask.h"
#include "mask/mask_head.h"
#include "sm80/bwd_common.h"
#include "sm80/bwd_traits.h"
#include "sm80/tile_ops.h"

namespace flashmask::sm80 {
using namespace cute;

// Deterministic dQ: one CTA per (query block, head, batch) walks its visible key blocks in a fixed
// order and accumulates dQ = dS K in registers.
// kSoftcap: the scores are soft-capped (common/softcap.h).
template <typename Traits, bool Is_causal, int kMaskC, bool kSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_dq_kernel(const BwdParams p) {
    // Empty on sm_90 in a unit that csrc/instantiations.py builds for older archs only (skips_sm90).
#if !(defined(FLASHMASK_SM80_SKIP_SM90) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900)
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr bool Has_mask = kMaskC > 0;
    using TileQ = typename Traits::TileQ;
    using TileS = typename Traits::TileS;

    extern __shared__ __align__(128) char smem[];
    const int tidx = threadIdx.x;
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int r0 = m_block * kBlockM;
    const int r1 = min(r0 + kBlockM, p.sq);

    const MaskHead mask = mask_head(p, b, h);
    const KeyBlockWalk<kBlockN, Is_causal, Has_mask> walk{mask.bounds, r0, r1, p.sk, p.sk - p.sq};

    Element* smem_k = reinterpret_cast<Element*>(smem);
    Element* smem_v = smem_k + cosize_v<typename Traits::SmemLayoutKV>;
    Element* smem_q = smem_v + cosize_v<typename Traits::SmemLayoutV>;
    Element* smem_do = smem_q + cosize_v<typename Traits::SmemLayoutQ>;
    Element* smem_ds = smem_do + cosize_v<typename Traits::SmemLayoutDO>;
    int* smem_mask = reinterpret_cast<int*>(smem_ds + cosize_v<typename Traits::SmemLayoutPdS>);
    Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutV{});
    Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKt{});
    Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutDO{});
    Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutPdS{});

    typename Traits::TiledMmaSdP mma_sdp;
    auto thr_sdp = mma_sdp.get_thread_slice(tidx);
    typename Traits::TiledMmaQ mma_q;
    auto thr_q = mma_q.get_thread_slice(tidx);
    Tensor acc_dq = partition_fragment_C(mma_q, TileQ{});
    clear(acc_dq);

    const BwdHead<Element> head(p, b, h);

    BlockBounds bnd = walk.bounds_of(walk.end() - 1);
    int n_block = walk.visible_at_or_below(walk.end() - 1, bnd);
    if (n_block >= 0) {
        const BwdGmemLoads<Traits> load(head, p, tidx);
        load.q(r0, sQ, r1 - r0);
        load.dout(r0, sdO, r1 - r0);

        const BwdSmemCopies<Traits> cp(tidx);
        Tensor tSsQ = cp.thr_sdp_a.partition_S(sQ);
        Tensor tSsdO = cp.thr_sdp_a.partition_S(sdO);
        Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
        Tensor tSrdO = thr_sdp.partition_fragment_A(sdO);
        Tensor tSsK = cp.thr_sdp_b.partition_S(sK);
        Tensor tSsV = cp.thr_sdp_b.partition_S(sV);
        Tensor tSrK = thr_sdp.partition_fragment_B(sK);
        Tensor tSrV = thr_sdp.partition_fragment_B(sV);
        Tensor tQsdS = cp.thr_q_a.partition_S(sdS);
        Tensor tQsKt = cp.thr_q_b.partition_S(sKt);
        Tensor tQrdS = thr_q.partition_fragment_A(sdS);
        Tensor tQrKt = thr_q.partition_fragment_B(sKt);
        Tensor tPsdS = cp.thr_c.partition_D(sdS);
        Tensor cS = rowcol(thr_sdp.partition_C(make_identity_tensor(TileS{})));
        const RowStats<decltype(size<0>(cS))::value> rows(cS, head.lse, head.dsum, r0, p.sq);

        while (n_block >= 0) {
            const int c0 = n_block * kBlockN;
            const TileCompare compare = walk.compare(n_block, bnd);
            bnd = walk.bounds_of(n_block - 1);  // used after the GEMMs, which hide the load
            load.k(c0, sK, p.sk - c0);
            load.v(c0, sV, p.sk - c0);
            if (Has_mask && compare.intervals) {
                stage_mask_columns<kBlockN, kMaskC, Traits::kNThreads>(smem_mask, mask.cols, c0, p.sk, tidx);
            }
            cp_async_fence();
            cp_async_wait<0>();
            __syncthreads();  // K, V (and Q, dO, mask) landed

            Tensor acc_s = partition_fragment_C(mma_sdp, TileS{});
            Tensor acc_dp = partition_fragment_C(mma_sdp, TileS{});
            clear(acc_s);
            clear(acc_dp);
            gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, mma_sdp, cp.sdp_a, cp.sdp_b, cp.thr_sdp_a, cp.thr_sdp_b);
            gemm_ss(acc_dp, tSrdO, tSrV, tSsdO, tSsV, mma_sdp, cp.sdp_a, cp.sdp_b, cp.thr_sdp_a, cp.thr_sdp_b);
            if constexpr (kSoftcap) softcap_scores(acc_s, p.softcap_scale);
            Tensor s_rc = rowcol(acc_s);
            Tensor dp_rc = rowcol(acc_dp);
            if (compare.any)
                mask_scores<Is_causal, kMaskC>(s_rc, cS, compare, r0, c0, p.sk, walk.causal_offset, smem_mask);
            probs(s_rc, rows, p.scale_log2);
            dscores<kSoftcap>(dp_rc, s_rc, rows, 1.f / p.scale_log2);
            Tensor rdS = convert_to<Element>(acc_dp);
            copy(cp.c, cp.thr_c.retile_S(rdS), tPsdS);
            __syncthreads();  // dS is in shared memory
            gemm_ss(acc_dq, tQrdS, tQrKt, tQsdS, tQsKt, mma_q, cp.q_a, cp.q_b, cp.thr_q_a, cp.thr_q_b);
            __syncthreads();  // everyone is done with K, V, dS before the next block loads
            n_block = walk.visible_at_or_below(n_block - 1, bnd);
        }
    }

    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); ++i) acc_dq(i) *= p.softmax_scale;
    Element* dq_ptr =
        reinterpret_cast<Element*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride + int64_t(r0) * p.dq_row_stride;
    Tensor gdQ = make_tensor(make_gmem_ptr(dq_ptr), TileQ{}, make_stride(p.dq_row_stride, _1{}));
    store_tile<typename Traits::SmemCopyAtomC, typename Traits::GmemTiledCopyOut, Element>(acc_dq, mma_q, sQ, gdQ,
                                                                                           r1 - r0, p.d, tidx);
#endif
}

}  // namespace flashmask::sm80
