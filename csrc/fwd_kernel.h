// FlashAttention-2 forward with FlashMask tile skipping: one CTA per (query tile, head, batch).
//
// Key blocks are visited from the last visible one down to block 0. A block that the column
// intervals mask entirely for this tile's rows is never loaded nor multiplied: the K prefetch goes
// straight to the next visible block. Blocks the intervals (or the causal diagonal, or the end of
// the keys) cut partly get an element-wise compare against their interval vectors, staged in
// shared memory; all other blocks are plain FlashAttention work.
#pragma once
#include <cute/tensor.hpp>

#include "kernel_traits.h"
#include "mask_bounds.h"
#include "params.h"
#include "softmax.h"
#include "tile_ops.h"

namespace flashmask {
using namespace cute;

// Which key blocks a query tile [r0, r1) needs, from the causal bound and the block bounds.
template <int kBlockN, bool Is_causal, bool Has_mask>
struct KeyBlockWalk {
    struct Compare {
        bool intervals;  // the column intervals cut the tile partly: stage and test them
        bool any;        // some element needs a test (intervals, causal diagonal or end of keys)
    };

    const int* bounds;  // this (batch, mask head)'s [n_key_blocks, 8], or nullptr
    int r0, r1, sk, causal_offset;

    // One past the last key block any row of the tile may see.
    __device__ int end() const {
        int n = (sk + kBlockN - 1) / kBlockN;
        if (Is_causal) {
            const int last_key = r1 - 1 + causal_offset;
            n = last_key < 0 ? 0 : min(n, last_key / kBlockN + 1);
        }
        return n;
    }
    // The largest visible block <= n, or -1.
    __device__ int visible_at_or_below(int n) const {
        if (Has_mask) {
            while (n >= 0 && classify_tile(bounds + n * kNumBounds, r0, r1).fully_masked) --n;
        }
        return n;
    }
    __device__ Compare needs_compare(int n) const {
        const int last_col = (n + 1) * kBlockN - 1;
        Compare c{false, last_col >= sk};  // keys past the end
        if (Is_causal) c.any |= last_col > r0 + causal_offset;  // crosses the diagonal
        if (Has_mask) c.intervals = classify_tile(bounds + n * kNumBounds, r0, r1).partial;
        c.any |= c.intervals;
        return c;
    }
};

// kMaskC: the C of startend_row_indices (0 = no mask), fixed at compile time so that a partial
// tile tests only the intervals its mode has.
template <typename Traits, bool Is_causal, int kMaskC>
__global__ void __launch_bounds__(Traits::kNThreads) fwd_kernel(const AttnParams p) {
    constexpr bool Has_mask = kMaskC > 0;
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;

    extern __shared__ __align__(128) char smem[];
    const int tidx = threadIdx.x;
    // Heavier tiles (later rows under a causal mask) are scheduled first.
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int r0 = m_block * kBlockM;
    const int r1 = min(r0 + kBlockM, p.sq);
    const int kv_h = h / p.q_per_kv_head;

    KeyBlockWalk<kBlockN, Is_causal, Has_mask> walk{nullptr, r0, r1, p.sk, p.sk - p.sq};
    const int* mask_cols = nullptr;
    if (Has_mask) {
        const int64_t mh = int64_t(b) * p.hm + h / p.q_per_mask_head;
        walk.bounds = p.bounds + mh * p.n_key_blocks * kNumBounds;
        mask_cols = p.mask + mh * p.sk * p.mask_c;
    }

    Element* o_ptr = reinterpret_cast<Element*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride;
    float* lse_ptr = p.lse + (int64_t(b) * p.hq + h) * p.sq;

    int n_block = walk.visible_at_or_below(walk.end() - 1);
    if (n_block < 0) {  // no key is visible to any row of this tile
        for (int i = tidx; i < (r1 - r0) * p.d; i += Traits::kNThreads) {
            o_ptr[(r0 + i / p.d) * p.o_row_stride + i % p.d] = Element(0.f);
        }
        for (int r = r0 + tidx; r < r1; r += Traits::kNThreads) lse_ptr[r] = INFINITY;
        return;
    }

    const Element* q_ptr = reinterpret_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
    const Element* k_ptr = reinterpret_cast<const Element*>(p.k) + b * p.k_batch_stride + kv_h * p.k_head_stride;
    const Element* v_ptr = reinterpret_cast<const Element*>(p.v) + b * p.v_batch_stride + kv_h * p.v_head_stride;

    using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
    using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
    Tensor gQ = make_tensor(make_gmem_ptr(q_ptr + r0 * p.q_row_stride), TileQ{}, make_stride(p.q_row_stride, _1{}));
    auto gK_at = [&](int n) {
        return make_tensor(make_gmem_ptr(k_ptr + int64_t(n) * kBlockN * p.k_row_stride), TileKV{},
                           make_stride(p.k_row_stride, _1{}));
    };
    auto gV_at = [&](int n) {
        return make_tensor(make_gmem_ptr(v_ptr + int64_t(n) * kBlockN * p.v_row_stride), TileKV{},
                           make_stride(p.v_row_stride, _1{}));
    };

    Element* smem_q = reinterpret_cast<Element*>(smem);
    Element* smem_k = reinterpret_cast<Element*>(smem + Traits::kSmemQBytes);
    Element* smem_v = reinterpret_cast<Element*>(smem + Traits::kSmemQBytes + Traits::kSmemKVBytes);
    int* smem_mask = reinterpret_cast<int*>(smem + Traits::kSmemQBytes + 2 * Traits::kSmemKVBytes);
    Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutVt{});

    // Global -> shared copies, predicated on the rows that exist and the real head dim.
    typename Traits::GmemTiledCopy gmem_copy;
    auto gmem_thr = gmem_copy.get_thread_slice(tidx);
    Tensor tQsQ = gmem_thr.partition_D(sQ);
    Tensor tKsK = gmem_thr.partition_D(sK);
    Tensor tVsV = gmem_thr.partition_D(sV);
    Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(TileQ{}));
    Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(TileKV{}));
    auto load_k = [&](int n) {
        copy_zfill(gmem_copy, gmem_thr.partition_S(gK_at(n)), tKsK, tKVcKV, p.sk - n * kBlockN, p.d);
    };
    auto load_v = [&](int n) {
        copy_zfill(gmem_copy, gmem_thr.partition_S(gV_at(n)), tVsV, tKVcKV, p.sk - n * kBlockN, p.d);
    };

    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(tidx);
    Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
    Tensor tSrK = thr_mma.partition_fragment_B(sK);
    Tensor tOrVt = thr_mma.partition_fragment_B(sVt);
    Tensor acc_o = partition_fragment_C(tiled_mma, TileQ{});

    auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto smem_thr_q = smem_copy_q.get_thread_slice(tidx);
    Tensor tSsQ = smem_thr_q.partition_S(sQ);
    auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto smem_thr_k = smem_copy_k.get_thread_slice(tidx);
    Tensor tSsK = smem_thr_k.partition_S(sK);
    auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
    auto smem_thr_v = smem_copy_v.get_thread_slice(tidx);
    Tensor tOsVt = smem_thr_v.partition_S(sVt);

    // (row, col) of every score this thread holds, for the element-wise mask.
    Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

    copy_zfill(gmem_copy, gmem_thr.partition_S(gQ), tQsQ, tQcQ, r1 - r0, p.d);
    load_k(n_block);
    cp_async_fence();
    clear(acc_o);

    constexpr int kRowsPerThread = decltype(size<0>(rowcol_layout(acc_o.layout())))::value;
    OnlineSoftmax<kRowsPerThread> softmax;

    while (n_block >= 0) {
        const int n_next = walk.visible_at_or_below(n_block - 1);
        const auto compare = walk.needs_compare(n_block);
        cp_async_wait<0>();
        __syncthreads();  // K[n] landed; every thread is done with V and the staged mask of the last block
        if (Has_mask && compare.intervals) {
            // The block's [BlockN, C] columns travel with V, so their latency hides behind Q*K^T.
            const int* src = mask_cols + int64_t(n_block) * kBlockN * kMaskC;
            const int valid = min(kBlockN, p.sk - n_block * kBlockN) * kMaskC;
            for (int i = tidx; i < kBlockN * kMaskC; i += Traits::kNThreads) {
                cp_async_4(smem_mask + i, i < valid ? src + i : mask_cols, i < valid);
            }
        }
        load_v(n_block);
        cp_async_fence();

        Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
        clear(acc_s);
        gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_copy_q, smem_copy_k, smem_thr_q, smem_thr_k);

        cp_async_wait<0>();
        __syncthreads();  // V[n] and the staged mask landed; every thread is done reading K[n]
        if (n_next >= 0) {
            load_k(n_next);
            cp_async_fence();
        }

        Tensor s_rc = rowcol(acc_s);
        if (compare.any) {
            Tensor c_rc = rowcol(tScS);
            CUTE_UNROLL
            for (int ni = 0; ni < size<1>(s_rc); ++ni) {
                const int c = get<1>(c_rc(0, ni));
                const int col = n_block * kBlockN + c;
                int vals[kMaskC > 0 ? kMaskC : 1] = {};
                if (Has_mask && compare.intervals) {
                    CUTE_UNROLL
                    for (int t = 0; t < kMaskC; ++t) vals[t] = smem_mask[c * kMaskC + t];
                }
                CUTE_UNROLL
                for (int mi = 0; mi < size<0>(s_rc); ++mi) {
                    const int row = r0 + get<0>(c_rc(mi, 0));
                    bool masked = col >= p.sk;
                    if (Is_causal) masked |= col > row + walk.causal_offset;
                    if constexpr (Has_mask) masked |= compare.intervals && row_masked<Is_causal, kMaskC>(vals, row);
                    if (masked) s_rc(mi, ni) = -INFINITY;
                }
            }
        }

        Tensor o_rc = rowcol(acc_o);
        softmax.update(s_rc, o_rc, p.scale_log2);

        Tensor rP = convert_to<Element>(acc_s);
        Tensor tOrP = make_tensor(rP.data(), acc_as_a_layout(rP.layout()));
        gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_copy_v, smem_thr_v);
        n_block = n_next;
    }

    float lse[kRowsPerThread];
    Tensor o_rc = rowcol(acc_o);
    softmax.finalize(o_rc, p.softmax_scale, lse);

    // Epilogue. The output goes through shared memory (Q's buffer: every thread finished its last
    // Q*K^T before the loop's final barrier) so that the global stores are 16-byte and coalesced.
    Tensor sO = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
    auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
    auto smem_thr_o = smem_copy_o.get_thread_slice(tidx);
    Tensor rO = convert_to<Element>(acc_o);
    copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));
    __syncthreads();
    typename Traits::GmemTiledCopyO gmem_copy_o;
    auto gmem_thr_o = gmem_copy_o.get_thread_slice(tidx);
    Tensor gO = make_tensor(make_gmem_ptr(o_ptr + r0 * p.o_row_stride), TileQ{}, make_stride(p.o_row_stride, _1{}));
    Tensor tOsO = gmem_thr_o.partition_S(sO);
    Tensor tOgO = gmem_thr_o.partition_D(gO);
    Tensor tOcO = gmem_thr_o.partition_D(make_identity_tensor(TileQ{}));
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tOgO); ++m) {
        CUTE_UNROLL
        for (int k = 0; k < size<2>(tOgO); ++k) {
            const auto c = tOcO(0, m, k);
            if (get<0>(c) < r1 - r0 && get<1>(c) < p.d) copy(gmem_copy_o, tOsO(_, m, k), tOgO(_, m, k));
        }
    }
    Tensor cO_rc = rowcol(thr_mma.partition_C(make_identity_tensor(TileQ{})));
    if (tidx % 4 == 0) {
        CUTE_UNROLL
        for (int mi = 0; mi < kRowsPerThread; ++mi) {
            const int row = r0 + get<0>(cO_rc(mi, 0));
            if (row < r1) lse_ptr[row] = lse[mi];
        }
    }
}

}  // namespace flashmask
