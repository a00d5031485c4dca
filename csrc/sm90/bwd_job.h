// What a backward job is: the kernel's argument, and a (key block, query head, batch) job decoded
// into its keys, heads, mask slice and the query blocks that see the keys; identical in every warp.
#pragma once
#include "common/params.h"
#include "mask/block_walk.h"
#include "mask/mask_head.h"
#include "sm90/tile_scheduler.h"

namespace flashmask::sm90 {

template <typename TmaQ, typename TmaDO, typename TmaK, typename TmaV, typename TmaDK, typename TmaDV>
struct BwdArgs {
    BwdParams p;
    TmaQ tma_q;
    TmaDO tma_do;
    TmaK tma_k;
    TmaV tma_v;
    TmaDK tma_dk;
    TmaDV tma_dv;
};

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

}  // namespace flashmask::sm90
