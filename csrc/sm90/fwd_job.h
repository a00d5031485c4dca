// What a forward job is: the kernel's argument, and a (query tile, head, batch[, split]) job decoded
// into its rows, heads, mask slice and key-block walk; identical in every warp.
#pragma once
#include <cute/tensor.hpp>

#include "common/launch_order.h"
#include "common/params.h"
#include "mask/block_walk.h"
#include "mask/mask_head.h"
#include "sm90/tile_scheduler.h"

namespace flashmask::sm90 {

// The kernel's argument: the common parameters and the TMA descriptors of Q, K, V and O (which
// must live in parameter space, hence __grid_constant__).
template <typename TmaQ, typename TmaK, typename TmaV, typename TmaO>
struct FwdArgs {
    AttnParams p;
    TmaQ tma_q;
    TmaK tma_k;
    TmaV tma_v;
    TmaO tma_o;
};

template <typename Traits, bool Is_causal, bool Has_mask>
struct TileJob {
    int m_block, h, b, split, r0, r1, kv_h;
    MaskHead mask;

    __device__ TileJob(const AttnParams& p, const FwdJob& job)
        : m_block(job.m_block), h(job.h), b(job.b), split(job.split) {
        r0 = m_block * Traits::kBlockM;
        r1 = min(r0 + Traits::kBlockM, p.sq);
        kv_h = h / p.q_per_kv_head;
        mask = mask_head(p, b, h);
    }
    using Walk = KeyBlockWalk<Traits::kBlockN, Is_causal, Has_mask>;
    // The job's walk; n_end: one past the last key block it may visit. A split walks its share of
    // the tile's blocks.
    __device__ Walk walk(const AttnParams& p, int& n_end) const {
        const int m_tiles = (p.sq + Traits::kBlockM - 1) / Traits::kBlockM;
        Walk w{mask.bounds, r0, r1, p.sk, p.sk - p.sq, Has_mask ? tile_floor(p, b, h, m_block, m_tiles) : 0};
        n_end = w.end();
        if (p.num_splits > 1) n_end = w.take_split(n_end, split, p.num_splits);
        return w;
    }
    __device__ Walk walk(const AttnParams& p) const {
        int n_end;
        return walk(p, n_end);
    }
    // The highest visible key block, where the downward walk starts, or -1 (nothing to load); bnd
    // is left holding its bounds.
    __device__ int top_block(const AttnParams& p, BlockBounds& bnd) const {
        int n_end;
        const Walk w = walk(p, n_end);
        const int n_last = n_end - 1;
        bnd = w.bounds_of(n_last);
        return w.visible_at_or_below(n_last, bnd);
    }
};

}  // namespace flashmask::sm90
