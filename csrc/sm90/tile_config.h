// Tile shapes of the SM90 kernels, readable from plain C++ (the registry) and from the kernels.
#pragma once

namespace flashmask::sm90 {

// Forward: BlockM query rows (64 per consumer warpgroup) against BlockN keys per pipeline stage.
struct FwdTile {
    int block_m, block_n, consumer_warpgroups, stages;
};
// Head dim 64 runs three consumer warpgroups (192-row tiles, no pingpong): its GEMMs are half as
// long next to the same softmax, and a third warpgroup keeps the tensor cores fed (H100: +10-25%
// on most families at 32K-128K, -10% on global + sliding window; docs/perf_notes.md, version 20).
// FLASHMASK_SM90_FWD_WG64=2 builds the two-warpgroup pingpong instead (scripts/sweep_variants.sh).
#ifndef FLASHMASK_SM90_FWD_WG64
#define FLASHMASK_SM90_FWD_WG64 3
#endif
constexpr FwdTile fwd_tile(int head_dim) {
    return head_dim <= 64 ? FwdTile{64 * FLASHMASK_SM90_FWD_WG64, 128, FLASHMASK_SM90_FWD_WG64, 3}
                          : FwdTile{128, 128, 2, 2};
}

// Backward: a CTA owns BlockN keys (64 per consumer warpgroup) and walks query blocks of BlockM rows,
// whose Q and dO go through a pipeline of `stages`. early_dv: dV += P^T dO is issued before dS^T is
// computed, to run alongside; at head dim 64 issuing it with dK was 3-7% faster on every mask
// family (docs/perf_notes.md, version 22).
// persistent: one CTA per SM draws jobs (tile_scheduler.h) instead of one CTA per job; at head dim
// 64 that was 1-9% faster on every family but sliding window (-1%, version 26); at head dim 128 up
// to 6% slower on the causal families then, 2-5% faster on every family once the consumers no
// longer walked the bounds themselves (versions 26 and 29, docs/perf_notes.md). One CTA per job
// stays a tuning switch (FLASHMASK_SM90_BWD_PERSISTENT64/128=false).
struct BwdTile {
    int block_m, block_n, consumer_warpgroups, stages;
    bool early_dv, persistent;
};
#ifndef FLASHMASK_SM90_BWD_M64
#define FLASHMASK_SM90_BWD_M64 64
#endif
#ifndef FLASHMASK_SM90_BWD_EARLY_DV64
#define FLASHMASK_SM90_BWD_EARLY_DV64 false
#endif
#ifndef FLASHMASK_SM90_BWD_EARLY_DV128
#define FLASHMASK_SM90_BWD_EARLY_DV128 true
#endif
#ifndef FLASHMASK_SM90_BWD_PERSISTENT64
#define FLASHMASK_SM90_BWD_PERSISTENT64 true
#endif
#ifndef FLASHMASK_SM90_BWD_PERSISTENT128
#define FLASHMASK_SM90_BWD_PERSISTENT128 true
#endif
// Warps of the producer warpgroup that add dQ tiles to the accumulator, taking a job's visible query
// blocks in turn. In deterministic mode each holds its block's turn until the addition is complete in
// global memory; with one such warp that wait bounded every step. Two: the deterministic backward
// 1.07-1.54x faster (full 32K D=128 328 -> 503 TFLOP/s), the atomic one unchanged; three: no better
// (docs/perf_notes.md, version 32).
#ifndef FLASHMASK_SM90_BWD_DQ_WARPS
#define FLASHMASK_SM90_BWD_DQ_WARPS 2
#endif
constexpr int kBwdDqWarps = FLASHMASK_SM90_BWD_DQ_WARPS;
static_assert(kBwdDqWarps >= 1 && kBwdDqWarps <= 3, "the producer warpgroup has three warps besides the producer");

constexpr BwdTile bwd_tile(int head_dim) {
    return head_dim <= 64 ? BwdTile{FLASHMASK_SM90_BWD_M64, 128, 2, 2, FLASHMASK_SM90_BWD_EARLY_DV64,
                                    FLASHMASK_SM90_BWD_PERSISTENT64}
                          : BwdTile{64, 128, 2, 2, FLASHMASK_SM90_BWD_EARLY_DV128, FLASHMASK_SM90_BWD_PERSISTENT128};
}

}  // namespace flashmask::sm90
