// FlashAttention-2 backward with FlashMask tile skipping.
//
// bwd_kv_kernel: one CTA per (key block, query head, batch) holds K, V and the dK, dV accumulators
// and walks the query blocks that can see its keys: the causal bound and the block's interval
// bounds trim the range, and runs of query blocks that one interval masks entirely are jumped.
// P is recomputed from the saved LSE. dQ is either accumulated across CTAs with fp32 atomics, then
// scaled and cast by dq_convert_kernel, or (deterministic) left to bwd_dq_kernel, which walks key
// blocks per query tile in a fixed order.
#pragma once
#include <cute/tensor.hpp>

#include "block_walk.h"
#include "bwd_traits.h"
#include "dq_accum.h"
#include "launch_order.h"
#include "mask_bounds.h"
#include "params.h"
#include "tile_ops.h"

namespace flashmask {
using namespace cute;

// D[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] - dLSE[b, h, i]: one warp per row.
template <typename Element>
__global__ void bwd_dsum_kernel(const Element* __restrict__ dout, const Element* __restrict__ out,
                                const float* __restrict__ dlse, float* __restrict__ dsum, int sq, int hq, int d,
                                int64_t do_b, int64_t do_s, int64_t do_h, int64_t o_b, int64_t o_s, int64_t o_h,
                                int64_t rows) {
    const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int i = row % sq;  // rows are ordered (b, h, i), like dsum
    const int h = (row / sq) % hq;
    const int64_t b = row / (int64_t(sq) * hq);
    const Element* a = dout + b * do_b + i * do_s + h * do_h;
    const Element* c = out + b * o_b + i * o_s + h * o_h;
    float acc = 0.f;
    for (int k = lane; k < d; k += 32) acc += float(a[k]) * float(c[k]);
    for (int s = 16; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (lane == 0) dsum[row] = acc - (dlse != nullptr ? dlse[row] : 0.f);
}

// The LSE (in log2 units) and D of the rows a thread holds in a score tile, in registers; rows
// past the end of the queries get LSE = +inf (so P = 0). Loaded before the GEMMs that precede
// their use.
template <int kRows>
struct RowStats {
    float lse_log2_[kRows];
    float dsum_[kRows];

    template <typename Coords>
    __forceinline__ __device__ RowStats(Coords const& coords, const float* lse, const float* d, int r0, int sq) {
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
            const int row = r0 + get<0>(coords(mi, 0));
            const bool in = row < sq;
            lse_log2_[mi] = in ? lse[row] * float(M_LOG2E) : INFINITY;
            dsum_[mi] = in ? d[row] : 0.f;
        }
    }
    __forceinline__ __device__ float lse_log2(int mi) const { return lse_log2_[mi]; }
    __forceinline__ __device__ float dsum(int mi) const { return dsum_[mi]; }
};

// The same, read at each use from a query block's rows staged in shared memory (LSE at
// [0, BlockM), D at [BlockM, 2 BlockM)): the key-block walk cannot spare the registers.
template <int kBlockM, typename Coords>
struct SmemRowStats {
    const float* rows;
    Coords const& coords;
    __forceinline__ __device__ float lse_log2(int mi) const { return rows[get<0>(coords(mi, 0))] * float(M_LOG2E); }
    __forceinline__ __device__ float dsum(int mi) const { return rows[kBlockM + get<0>(coords(mi, 0))]; }
};

// P = exp(S * scale - LSE), in place on the (rows, cols) view of a score tile.
template <typename S, typename Rows>
__forceinline__ __device__ void probs(S& s, Rows const& rows, float scale_log2) {
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(s); ++mi) {
        const float lse = rows.lse_log2(mi);
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(s); ++ni) s(mi, ni) = exp2f(s(mi, ni) * scale_log2 - lse);
    }
}

// dS = P * (dP - D), in place on dP.
template <typename DP, typename P, typename Rows>
__forceinline__ __device__ void dscores(DP& dp, P const& pr, Rows const& rows) {
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(dp); ++mi) {
        const float d = rows.dsum(mi);
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(dp); ++ni) dp(mi, ni) = pr(mi, ni) * (dp(mi, ni) - d);
    }
}

// dQ is accumulated with atomics (dq_accum.h) when p.dq_accum is set (a uniform branch: one
// instantiation serves both modes).
template <typename Traits, bool Is_causal, int kMaskC>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kv_kernel(const BwdParams p) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr bool Has_mask = kMaskC > 0;
    using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
    using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
    using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;

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
    const int kv_h = h / p.q_per_kv_head;
    const int c0 = n_block * kBlockN;
    const int m_end = (p.sq + kBlockM - 1) / kBlockM;
    const int causal_offset = p.sk - p.sq;

    Element* smem_k = reinterpret_cast<Element*>(smem);
    Element* smem_v = smem_k + cosize_v<typename Traits::SmemLayoutKV>;
    Element* smem_q = smem_v + cosize_v<typename Traits::SmemLayoutKV>;
    Element* smem_do = smem_q + Traits::kQStages * cosize_v<typename Traits::SmemLayoutQ>;
    Element* smem_p = smem_do + Traits::kQStages * cosize_v<typename Traits::SmemLayoutQ>;
    Element* smem_ds = smem_p + cosize_v<typename Traits::SmemLayoutPdS>;
    int* smem_mask = reinterpret_cast<int*>(smem_ds + cosize_v<typename Traits::SmemLayoutPdS>);
    int* smem_bounds = smem_mask + 4 * kBlockN;
    float* smem_rows = reinterpret_cast<float*>(smem_bounds + kNumBounds);

    // The key block's bounds are read from shared memory at each use: held in registers for the
    // whole walk they pushed the GEMMs' accumulators into spills. With a mask, this kernel is
    // launched twice (bwd_launch.h): the key blocks that some interval reaches run in the masked
    // instantiation, the others in the mask-free one, which at 255 registers per thread runs faster
    // (H100, causal 32K with a C=1 mask that reaches no key: 35.4 -> 32.8 ms).
    const int* mask_cols = nullptr;
    if (p.bounds != nullptr) {
        const int64_t mh = int64_t(b) * p.hm + h / p.q_per_mask_head;
        if (tidx < kNumBounds) smem_bounds[tidx] = p.bounds[(mh * p.n_key_blocks + n_block) * kNumBounds + tidx];
        __syncthreads();
        const int first_row = Is_causal ? max(0, c0 - causal_offset) : 0;
        if (classify_tile(smem_bounds, first_row, p.sq).partial != Has_mask) return;
        if (Has_mask) mask_cols = p.mask + mh * p.sk * p.mask_c;
    }
    const QueryBlockWalk<kBlockM, kBlockN, Is_causal, Has_mask> walk{smem_bounds, c0, p.sq, p.sk, causal_offset, m_end};
    Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
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
    Tensor acc_dv = partition_fragment_C(mma_kv, TileKV{});
    clear(acc_dk);
    clear(acc_dv);

    int m_block = walk.visible_at_or_above(walk.begin());
    const Element* k_ptr = reinterpret_cast<const Element*>(p.k) + b * p.k_batch_stride + kv_h * p.k_head_stride +
                           int64_t(c0) * p.k_row_stride;
    const Element* v_ptr = reinterpret_cast<const Element*>(p.v) + b * p.v_batch_stride + kv_h * p.v_head_stride +
                           int64_t(c0) * p.v_row_stride;
    const Element* q_ptr = reinterpret_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
    const Element* do_ptr = reinterpret_cast<const Element*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride;
    const float* lse = p.lse + (int64_t(b) * p.hq + h) * p.sq;
    const float* dsum = p.dsum + (int64_t(b) * p.hq + h) * p.sq;

    if (m_block < m_end) {
        typename Traits::GmemTiledCopy gmem_copy;
        auto gmem_thr = gmem_copy.get_thread_slice(tidx);
        Tensor tKVc = gmem_thr.partition_S(make_identity_tensor(TileKV{}));
        Tensor tQc = gmem_thr.partition_S(make_identity_tensor(TileQ{}));
        auto gQ_at = [&](const Element* base, int64_t row_stride, int m) {
            return make_tensor(make_gmem_ptr(base + int64_t(m) * kBlockM * row_stride), TileQ{}, make_stride(row_stride, _1{}));
        };
        auto sQ_at = [&](Element* base, int stage) {
            return make_tensor(make_smem_ptr(base + stage * cosize_v<typename Traits::SmemLayoutQ>), typename Traits::SmemLayoutQ{});
        };
        auto load_q_do = [&](int m, int stage) {
            const int rows = p.sq - m * kBlockM;
            copy_zfill(gmem_copy, gmem_thr.partition_S(gQ_at(q_ptr, p.q_row_stride, m)),
                       gmem_thr.partition_D(sQ_at(smem_q, stage)), tQc, rows, p.d);
            copy_zfill(gmem_copy, gmem_thr.partition_S(gQ_at(do_ptr, p.do_row_stride, m)),
                       gmem_thr.partition_D(sQ_at(smem_do, stage)), tQc, rows, p.d);
        };
        // LSE and D of query block m (single-buffered: loaded once the previous block's are used).
        auto load_rows = [&](int m) {
            static_assert(2 * kBlockM <= Traits::kNThreads);
            if (tidx < 2 * kBlockM) {
                const int row = m * kBlockM + tidx % kBlockM;
                const bool is_d = tidx >= kBlockM;
                if (row < p.sq) cp_async_4(smem_rows + tidx, (is_d ? dsum : lse) + row, true);
                else smem_rows[tidx] = is_d ? 0.f : INFINITY;  // P = 0 on rows past the end
            }
        };
        const int n_valid = p.sk - c0;
        copy_zfill(gmem_copy, gmem_thr.partition_S(make_tensor(make_gmem_ptr(k_ptr), TileKV{}, make_stride(p.k_row_stride, _1{}))),
                   gmem_thr.partition_D(sK), tKVc, n_valid, p.d);
        copy_zfill(gmem_copy, gmem_thr.partition_S(make_tensor(make_gmem_ptr(v_ptr), TileKV{}, make_stride(p.v_row_stride, _1{}))),
                   gmem_thr.partition_D(sV), tKVc, n_valid, p.d);
        if (Has_mask) stage_mask_columns<kBlockN, kMaskC, Traits::kNThreads>(smem_mask, mask_cols, c0, p.sk, tidx);
        load_q_do(m_block, 0);
        load_rows(m_block);
        cp_async_fence();

        // Shared -> register copies of every operand.
        auto copy_sdp_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_sdp);
        auto thr_sdp_a = copy_sdp_a.get_thread_slice(tidx);
        auto copy_sdp_b = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma_sdp);
        auto thr_sdp_b = copy_sdp_b.get_thread_slice(tidx);
        auto copy_kv_a = make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, mma_kv);
        auto thr_kv_a = copy_kv_a.get_thread_slice(tidx);
        auto copy_kv_b = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_kv);
        auto thr_kv_b = copy_kv_b.get_thread_slice(tidx);
        auto copy_q_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_q);
        auto thr_q_a = copy_q_a.get_thread_slice(tidx);
        auto copy_q_b = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_q);
        auto thr_q_b = copy_q_b.get_thread_slice(tidx);
        auto copy_c = make_tiled_copy_C(typename Traits::SmemCopyAtomC{}, mma_sdp);
        auto thr_c = copy_c.get_thread_slice(tidx);

        Tensor tSsK = thr_sdp_b.partition_S(sK);
        Tensor tSsV = thr_sdp_b.partition_S(sV);
        Tensor tSrK = thr_sdp.partition_fragment_B(sK);
        Tensor tSrV = thr_sdp.partition_fragment_B(sV);
        Tensor tKVsPt = thr_kv_a.partition_S(sPt);
        Tensor tKVsdSt = thr_kv_a.partition_S(sdSt);
        Tensor tKVrA = thr_kv.partition_fragment_A(sPt);
        Tensor tQsdS = thr_q_a.partition_S(sdS);
        Tensor tQsKt = thr_q_b.partition_S(sKt);
        Tensor tQrdS = thr_q.partition_fragment_A(sdS);
        Tensor tQrKt = thr_q.partition_fragment_B(sKt);
        Tensor tPsP = thr_c.partition_D(sP);
        Tensor tPsdS = thr_c.partition_D(sdS);
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
            Tensor sQ = sQ_at(smem_q, stage);
            Tensor sdO = sQ_at(smem_do, stage);
            Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQt{});
            Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutQt{});

            Tensor acc_s = partition_fragment_C(mma_sdp, TileS{});
            clear(acc_s);
            Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
            gemm_ss(acc_s, tSrQ, tSrK, thr_sdp_a.partition_S(sQ), tSsK, mma_sdp, copy_sdp_a, copy_sdp_b, thr_sdp_a, thr_sdp_b);
            Tensor s_rc = rowcol(acc_s);
            if (compare.any) mask_scores<Is_causal, kMaskC>(s_rc, cS, compare, r0, c0, p.sk, causal_offset, smem_mask);
            probs(s_rc, rows, p.scale_log2);
            // P's shared-memory store drains while dP = dO V^T computes.
            Tensor rP = convert_to<Element>(acc_s);
            copy(copy_c, thr_c.retile_S(rP), tPsP);

            Tensor acc_dp = partition_fragment_C(mma_sdp, TileS{});
            clear(acc_dp);
            Tensor tSrdO = thr_sdp.partition_fragment_A(sdO);
            gemm_ss(acc_dp, tSrdO, tSrV, thr_sdp_a.partition_S(sdO), tSsV, mma_sdp, copy_sdp_a, copy_sdp_b, thr_sdp_a, thr_sdp_b);
            Tensor dp_rc = rowcol(acc_dp);
            dscores(dp_rc, s_rc, rows);
            Tensor rdS = convert_to<Element>(acc_dp);
            copy(copy_c, thr_c.retile_S(rdS), tPsdS);
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
                gemm_ss(acc_dq, tQrdS, tQrKt, tQsdS, tQsKt, mma_q, copy_q_a, copy_q_b, thr_q_a, thr_q_b);
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
    Element* dk_ptr = reinterpret_cast<Element*>(p.dk) + b * p.dk_batch_stride + h * p.dk_head_stride + int64_t(c0) * p.dk_row_stride;
    Element* dv_ptr = reinterpret_cast<Element*>(p.dv) + b * p.dv_batch_stride + h * p.dv_head_stride + int64_t(c0) * p.dv_row_stride;
    Tensor gdK = make_tensor(make_gmem_ptr(dk_ptr), TileKV{}, make_stride(p.dk_row_stride, _1{}));
    Tensor gdV = make_tensor(make_gmem_ptr(dv_ptr), TileKV{}, make_stride(p.dv_row_stride, _1{}));
    store_tile<typename Traits::SmemCopyAtomC, typename Traits::GmemTiledCopyOut, Element>(acc_dk, mma_kv, sK, gdK,
                                                                                        p.sk - c0, p.d, tidx);
    store_tile<typename Traits::SmemCopyAtomC, typename Traits::GmemTiledCopyOut, Element>(acc_dv, mma_kv, sV, gdV,
                                                                                        p.sk - c0, p.d, tidx);
}

// Deterministic dQ: one CTA per (query block, head, batch) walks its visible key blocks in a fixed
// order and accumulates dQ = dS K in registers.
template <typename Traits, bool Is_causal, int kMaskC>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_dq_kernel(const BwdParams p) {
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr bool Has_mask = kMaskC > 0;
    using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
    using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
    using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;

    extern __shared__ __align__(128) char smem[];
    const int tidx = threadIdx.x;
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int kv_h = h / p.q_per_kv_head;
    const int r0 = m_block * kBlockM;
    const int r1 = min(r0 + kBlockM, p.sq);

    KeyBlockWalk<kBlockN, Is_causal, Has_mask> walk{nullptr, r0, r1, p.sk, p.sk - p.sq};
    const int* mask_cols = nullptr;
    if (Has_mask) {
        const int64_t mh = int64_t(b) * p.hm + h / p.q_per_mask_head;
        walk.bounds = p.bounds + mh * p.n_key_blocks * kNumBounds;
        mask_cols = p.mask + mh * p.sk * p.mask_c;
    }

    Element* smem_k = reinterpret_cast<Element*>(smem);
    Element* smem_v = smem_k + cosize_v<typename Traits::SmemLayoutKV>;
    Element* smem_q = smem_v + cosize_v<typename Traits::SmemLayoutKV>;
    Element* smem_do = smem_q + cosize_v<typename Traits::SmemLayoutQ>;
    Element* smem_ds = smem_do + cosize_v<typename Traits::SmemLayoutQ>;
    int* smem_mask = reinterpret_cast<int*>(smem_ds + cosize_v<typename Traits::SmemLayoutPdS>);
    Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
    Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKt{});
    Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutQ{});
    Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutPdS{});

    typename Traits::TiledMmaSdP mma_sdp;
    auto thr_sdp = mma_sdp.get_thread_slice(tidx);
    typename Traits::TiledMmaQ mma_q;
    auto thr_q = mma_q.get_thread_slice(tidx);
    Tensor acc_dq = partition_fragment_C(mma_q, TileQ{});
    clear(acc_dq);

    const Element* q_ptr = reinterpret_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
    const Element* do_ptr = reinterpret_cast<const Element*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride;
    const Element* k_ptr = reinterpret_cast<const Element*>(p.k) + b * p.k_batch_stride + kv_h * p.k_head_stride;
    const Element* v_ptr = reinterpret_cast<const Element*>(p.v) + b * p.v_batch_stride + kv_h * p.v_head_stride;
    const float* lse = p.lse + (int64_t(b) * p.hq + h) * p.sq;
    const float* dsum = p.dsum + (int64_t(b) * p.hq + h) * p.sq;

    BlockBounds bnd = walk.bounds_of(walk.end() - 1);
    int n_block = walk.visible_at_or_below(walk.end() - 1, bnd);
    if (n_block >= 0) {
        typename Traits::GmemTiledCopy gmem_copy;
        auto gmem_thr = gmem_copy.get_thread_slice(tidx);
        Tensor tKVc = gmem_thr.partition_S(make_identity_tensor(TileKV{}));
        Tensor tQc = gmem_thr.partition_S(make_identity_tensor(TileQ{}));
        auto rows_at = [&](const Element* base, int64_t stride, int row0, auto tile) {
            return make_tensor(make_gmem_ptr(base + int64_t(row0) * stride), tile, make_stride(stride, _1{}));
        };
        copy_zfill(gmem_copy, gmem_thr.partition_S(rows_at(q_ptr, p.q_row_stride, r0, TileQ{})), gmem_thr.partition_D(sQ),
                   tQc, r1 - r0, p.d);
        copy_zfill(gmem_copy, gmem_thr.partition_S(rows_at(do_ptr, p.do_row_stride, r0, TileQ{})), gmem_thr.partition_D(sdO),
                   tQc, r1 - r0, p.d);

        auto copy_sdp_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_sdp);
        auto thr_sdp_a = copy_sdp_a.get_thread_slice(tidx);
        auto copy_sdp_b = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma_sdp);
        auto thr_sdp_b = copy_sdp_b.get_thread_slice(tidx);
        auto copy_q_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_q);
        auto thr_q_a = copy_q_a.get_thread_slice(tidx);
        auto copy_q_b = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_q);
        auto thr_q_b = copy_q_b.get_thread_slice(tidx);
        auto copy_c = make_tiled_copy_C(typename Traits::SmemCopyAtomC{}, mma_sdp);
        auto thr_c = copy_c.get_thread_slice(tidx);

        Tensor tSsQ = thr_sdp_a.partition_S(sQ);
        Tensor tSsdO = thr_sdp_a.partition_S(sdO);
        Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
        Tensor tSrdO = thr_sdp.partition_fragment_A(sdO);
        Tensor tSsK = thr_sdp_b.partition_S(sK);
        Tensor tSsV = thr_sdp_b.partition_S(sV);
        Tensor tSrK = thr_sdp.partition_fragment_B(sK);
        Tensor tSrV = thr_sdp.partition_fragment_B(sV);
        Tensor tQsdS = thr_q_a.partition_S(sdS);
        Tensor tQsKt = thr_q_b.partition_S(sKt);
        Tensor tQrdS = thr_q.partition_fragment_A(sdS);
        Tensor tQrKt = thr_q.partition_fragment_B(sKt);
        Tensor tPsdS = thr_c.partition_D(sdS);
        Tensor cS = rowcol(thr_sdp.partition_C(make_identity_tensor(TileS{})));
        const RowStats<decltype(size<0>(cS))::value> rows(cS, lse, dsum, r0, p.sq);

        while (n_block >= 0) {
            const int c0 = n_block * kBlockN;
            const TileCompare compare = walk.compare(n_block, bnd);
            bnd = walk.bounds_of(n_block - 1);  // used after the GEMMs, which hide the load
            copy_zfill(gmem_copy, gmem_thr.partition_S(rows_at(k_ptr, p.k_row_stride, c0, TileKV{})),
                       gmem_thr.partition_D(sK), tKVc, p.sk - c0, p.d);
            copy_zfill(gmem_copy, gmem_thr.partition_S(rows_at(v_ptr, p.v_row_stride, c0, TileKV{})),
                       gmem_thr.partition_D(sV), tKVc, p.sk - c0, p.d);
            if (Has_mask && compare.intervals) {
                stage_mask_columns<kBlockN, kMaskC, Traits::kNThreads>(smem_mask, mask_cols, c0, p.sk, tidx);
            }
            cp_async_fence();
            cp_async_wait<0>();
            __syncthreads();  // K, V (and Q, dO, mask) landed

            Tensor acc_s = partition_fragment_C(mma_sdp, TileS{});
            Tensor acc_dp = partition_fragment_C(mma_sdp, TileS{});
            clear(acc_s);
            clear(acc_dp);
            gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, mma_sdp, copy_sdp_a, copy_sdp_b, thr_sdp_a, thr_sdp_b);
            gemm_ss(acc_dp, tSrdO, tSrV, tSsdO, tSsV, mma_sdp, copy_sdp_a, copy_sdp_b, thr_sdp_a, thr_sdp_b);
            Tensor s_rc = rowcol(acc_s);
            Tensor dp_rc = rowcol(acc_dp);
            if (compare.any) mask_scores<Is_causal, kMaskC>(s_rc, cS, compare, r0, c0, p.sk, walk.causal_offset, smem_mask);
            probs(s_rc, rows, p.scale_log2);
            dscores(dp_rc, s_rc, rows);
            Tensor rdS = convert_to<Element>(acc_dp);
            copy(copy_c, thr_c.retile_S(rdS), tPsdS);
            __syncthreads();  // dS is in shared memory
            gemm_ss(acc_dq, tQrdS, tQrKt, tQsdS, tQsKt, mma_q, copy_q_a, copy_q_b, thr_q_a, thr_q_b);
            __syncthreads();  // everyone is done with K, V, dS before the next block loads
            n_block = walk.visible_at_or_below(n_block - 1, bnd);
        }
    }

    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); ++i) acc_dq(i) *= p.softmax_scale;
    Element* dq_ptr = reinterpret_cast<Element*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride + int64_t(r0) * p.dq_row_stride;
    Tensor gdQ = make_tensor(make_gmem_ptr(dq_ptr), TileQ{}, make_stride(p.dq_row_stride, _1{}));
    store_tile<typename Traits::SmemCopyAtomC, typename Traits::GmemTiledCopyOut, Element>(acc_dq, mma_q, sQ, gdQ,
                                                                                        r1 - r0, p.d, tidx);
}

}  // namespace flashmask
