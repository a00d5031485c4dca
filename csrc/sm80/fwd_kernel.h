// FlashAttention-2 forward with FlashMask tile skipping: one CTA per (query tile, head, batch),
// and per key split in split-KV mode; query tiles start in decreasing order of work.
//
// Key blocks are visited from the last visible one down to block 0. A block that the column
// intervals mask entirely for this tile's rows is never loaded nor multiplied: the K prefetch goes
// straight to the next visible block. Blocks the intervals (or the causal diagonal, or the end of
// the keys) cut partly get an element-wise compare against their interval vectors, staged in
// shared memory; all other blocks are plain FlashAttention work.
#pragma once
#include <cute/tensor.hpp>

#include "common/launch_order.h"
#include "common/params.h"
#include "common/softcap.h"
#include "common/softmax.h"
#include "mask/block_walk.h"
#include "mask/element_mask.h"
#include "mask/mask_head.h"
#include "sm80/fwd_epilogue.h"
#include "sm80/kernel_traits.h"
#include "sm80/tile_ops.h"

namespace flashmask::sm80 {
using namespace cute;

// kMaskC: the C of startend_row_indices (0 = no mask), fixed at compile time so that a partial
// tile tests only the intervals its mode has. kSoftcap: the scores are soft-capped (common/softcap.h).
template <typename Traits, bool Is_causal, int kMaskC, bool kSoftcap>
__global__ void __launch_bounds__(Traits::kNThreads) fwd_kernel(const AttnParams p) {
    // Empty on sm_90 in a unit that csrc/instantiations.py builds for older archs only (skips_sm90).
#if !(defined(FLASHMASK_SM80_SKIP_SM90) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900)
    constexpr bool Has_mask = kMaskC > 0;
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;

    extern __shared__ __align__(128) char smem[];
    const int tidx = threadIdx.x;
    // Tiles of rank 0 (the heaviest of each head) start first within each head group. Without a
    // work order the heaviest tiles are the last rows under a causal mask.
    const int m_tiles = gridDim.x / p.hq;
    const JobHead job = job_and_head(blockIdx.x, m_tiles, p.head_group);
    const int rank = job.job;
    const int h = job.head;
    const bool split = p.num_splits > 1;
    const int b = blockIdx.z / p.num_splits;
    const int split_idx = blockIdx.z % p.num_splits;
    const int m_block = Has_mask && p.tile_order != nullptr
                            ? p.tile_order[(int64_t(b) * p.hm + h / p.q_per_mask_head) * m_tiles + rank]
                            : (Is_causal ? m_tiles - 1 - rank : rank);
    const int r0 = m_block * kBlockM;
    const int r1 = min(r0 + kBlockM, p.sq);
    const int kv_h = h / p.q_per_kv_head;

    const MaskHead mask = mask_head(p, b, h);
    KeyBlockWalk<kBlockN, Is_causal, Has_mask> walk{mask.bounds, r0, r1, p.sk, p.sk - p.sq};
    const FwdOutput<Element> output(p, b, h, split_idx);

    int n_end = walk.end();
    if (Has_mask) walk.n_floor = tile_floor(p, b, h, m_block, m_tiles);
    if (split) n_end = walk.take_split(n_end, split_idx, p.num_splits);  // this CTA's share of the key blocks
    BlockBounds bnd = walk.bounds_of(n_end - 1);
    int n_block = walk.visible_at_or_below(n_end - 1, bnd);
    if (n_block < 0) {  // no key (of this split) is visible to any row of this tile
        output.write_empty(r0, r1, tidx, Traits::kNThreads);
        return;
    }

    const Element* q_ptr = reinterpret_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
    const Element* k_ptr = reinterpret_cast<const Element*>(p.k) + b * p.k_batch_stride + kv_h * p.k_head_stride;
    const Element* v_ptr = reinterpret_cast<const Element*>(p.v) + b * p.v_batch_stride + kv_h * p.v_head_stride;

    using TileQ = typename Traits::TileQ;
    using TileK = typename Traits::TileK;
    using TileV = typename Traits::TileV;
    Tensor gQ = make_tensor(make_gmem_ptr(q_ptr + r0 * p.q_row_stride), TileQ{}, make_stride(p.q_row_stride, _1{}));
    auto gK_at = [&](int n) {
        return make_tensor(make_gmem_ptr(k_ptr + int64_t(n) * kBlockN * p.k_row_stride), TileK{},
                           make_stride(p.k_row_stride, _1{}));
    };
    auto gV_at = [&](int n) {
        return make_tensor(make_gmem_ptr(v_ptr + int64_t(n) * kBlockN * p.v_row_stride), TileV{},
                           make_stride(p.v_row_stride, _1{}));
    };

    Element* smem_q = reinterpret_cast<Element*>(smem);
    Element* smem_k = reinterpret_cast<Element*>(smem + Traits::kSmemQBytes);
    Element* smem_v = reinterpret_cast<Element*>(smem + Traits::kSmemQBytes + Traits::kSmemKBytes);
    int* smem_mask = reinterpret_cast<int*>(smem + Traits::kSmemQBytes + Traits::kSmemKBytes + Traits::kSmemVBytes);
    Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutV{});
    Tensor sVt = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutVt{});

    // Global -> shared copies, predicated on the rows that exist and the real head dims (p.d for Q
    // and K, p.d_v for V).
    typename Traits::GmemTiledCopy gmem_copy;
    auto gmem_thr = gmem_copy.get_thread_slice(tidx);
    typename Traits::CopiesV::GmemTiledCopy gmem_copy_v;
    auto gmem_thr_v = gmem_copy_v.get_thread_slice(tidx);
    Tensor tQsQ = gmem_thr.partition_D(sQ);
    Tensor tKsK = gmem_thr.partition_D(sK);
    Tensor tVsV = gmem_thr_v.partition_D(sV);
    Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(TileQ{}));
    Tensor tKcK = gmem_thr.partition_S(make_identity_tensor(TileK{}));
    Tensor tVcV = gmem_thr_v.partition_S(make_identity_tensor(TileV{}));
    auto load_k = [&](int n) {
        copy_zfill(gmem_copy, gmem_thr.partition_S(gK_at(n)), tKsK, tKcK, p.sk - n * kBlockN, p.d);
    };
    auto load_v = [&](int n) {
        copy_zfill(gmem_copy_v, gmem_thr_v.partition_S(gV_at(n)), tVsV, tVcV, p.sk - n * kBlockN, p.d_v);
    };

    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(tidx);
    Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
    Tensor tSrK = thr_mma.partition_fragment_B(sK);
    Tensor tOrVt = thr_mma.partition_fragment_B(sVt);
    Tensor acc_o = partition_fragment_C(tiled_mma, typename Traits::TileO{});

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
    Tensor tScS = thr_mma.partition_C(make_identity_tensor(typename Traits::TileS{}));

    copy_zfill(gmem_copy, gmem_thr.partition_S(gQ), tQsQ, tQcQ, r1 - r0, p.d);
    load_k(n_block);
    cp_async_fence();
    clear(acc_o);

    constexpr int kRowsPerThread = decltype(size<0>(rowcol_layout(acc_o.layout())))::value;
    OnlineSoftmax<kRowsPerThread> softmax;
    const bool fixed_max = softmax.template fix_max<kSoftcap, Element>(p.softcap_max);

    TileCompare compare = walk.compare(n_block, bnd);
    while (n_block >= 0) {
        cp_async_wait<0>();
        __syncthreads();  // K[n] landed; every thread is done with V and the staged mask of the last block
        if (Has_mask && compare.intervals) {
            // The block's mask columns travel with V, so their latency hides behind Q*K^T.
            stage_mask_columns<kBlockN, kMaskC, Traits::kNThreads>(smem_mask, mask.cols, n_block * kBlockN, p.sk, tidx);
        }
        load_v(n_block);
        cp_async_fence();
        bnd = walk.bounds_of(n_block - 1);  // used after Q*K^T, which hides the load

        Tensor acc_s = partition_fragment_C(tiled_mma, typename Traits::TileS{});
        clear(acc_s);
        gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_copy_q, smem_copy_k, smem_thr_q, smem_thr_k);
        const int n_next = walk.visible_at_or_below(n_block - 1, bnd);

        cp_async_wait<0>();
        __syncthreads();  // V[n] and the staged mask landed; every thread is done reading K[n]
        if (n_next >= 0) {
            load_k(n_next);
            cp_async_fence();
        }

        if constexpr (kSoftcap) softcap_scores(acc_s, p.softcap_scale);
        Tensor s_rc = rowcol(acc_s);
        if (compare.any) {
            mask_scores<Is_causal, kMaskC>(s_rc, rowcol(tScS), compare, r0, n_block * kBlockN, p.sk, walk.causal_offset,
                                           smem_mask);
        }
        Tensor o_rc = rowcol(acc_o);
        if (fixed_max) {
            softmax.exp_at_fixed_max(s_rc, p.scale_log2);
        } else {
            softmax.update(s_rc, o_rc, p.scale_log2);
        }

        Tensor rP = convert_to<Element>(acc_s);
        Tensor tOrP = make_tensor(rP.data(), acc_as_a_layout(rP.layout()));
        gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_copy_v, smem_thr_v);
        if (n_next >= 0) compare = walk.compare(n_next, bnd);
        n_block = n_next;
    }

    float lse[kRowsPerThread];
    Tensor o_rc = rowcol(acc_o);
    Tensor cO_rc = rowcol(thr_mma.partition_C(make_identity_tensor(typename Traits::TileO{})));
    // A split's empty row may see keys in other splits: the merge tells hidden rows apart.
    softmax.finalize(o_rc, p.score_scale, lse, output.sink,
                     [&](int mi) { return split || row_hidden(p, b, h, r0 + get<0>(cO_rc(mi, 0))); });
    if (split) {
        output.write_partial(o_rc, cO_rc, lse, r0, r1, tidx);
    } else {
        // Q's buffer is free: every thread finished its last Q*K^T before the loop's final barrier.
        Tensor sO = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutO{});
        write_output<Traits>(output, acc_o, tiled_mma, sO, cO_rc, lse, r0, r1, tidx);
    }
#endif
}

}  // namespace flashmask::sm80
