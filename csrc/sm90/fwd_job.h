// What a forward job is: the kernel's argument, and a (query tile, head, batch) job decoded into
// its rows, heads, mask slice and key-block walk; identical in every warp.
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
    int m_block, h, b, r0, r1, kv_h;
    MaskHead mask;

    __device__ TileJob(const AttnParams& p, const FwdJob& job) : m_block(job.m_block), h(job.h), b(job.b) {
        r0 = m_block * Traits::kBlockM;
        r1 = min(r0 + Traits::kBlockM, p.sq);
        kv_h = h / p.q_per_kv_head;
        mask = mask_head(p, b, h);
    }
    __device__ KeyBlockWalk<Traits::kBlockN, Is_causal, Has_mask> walk(const AttnParams& p) const {
        const int m_tiles = (p.sq + Traits::kBlockM - 1) / Traits::kBlockM;
        return {mask.bounds, r0, r1, p.sk, p.sk - p.sq, Has_mask ? tile_floor(p, b, h, m_block, m_tiles) : 0};
    }
    // The highest visible key block, where the downward walk starts, or -1 (nothing to load); bnd
    // is left holding its bounds.
    __device__ int top_block(const AttnParams& p, BlockBounds& bnd) const {
        const auto w = walk(p);
        const int n_last = w.end() - 1;
        bnd = w.bounds_of(n_last);
        return w.visible_at_or_below(n_last, bnd);
    }
};

}  // namespace flashmask::sm90
