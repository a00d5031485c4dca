// Tile shapes of the SM90 kernels, readable from plain C++ (the registry) and from the kernels.
#pragma once

namespace flashmask::sm90 {

// Forward: BlockM query rows (64 per consumer warpgroup) against BlockN keys per pipeline stage;
// q_stages Q buffers, so that with two the next job's Q loads while this job still runs (a job
// of a window's few blocks otherwise waits for its Q after the last S of the one before).
struct FwdTile {
    int block_m, block_n, consumer_warpgroups, stages, q_stages, producer_registers, consumer_registers;
    int decode_warp_keys;  // FWD_DECODE_WARP_KEYS: from this Sk the build with a decode warp, 0: none
};
// Head dim 64 runs three consumer warpgroups (192-row tiles, no pingpong): its GEMMs are half as
// long next to the same softmax, and a third warpgroup keeps the tensor cores fed (H100: +10-25%
// on most families at 32K-128K, -10% on global + sliding window; docs/perf_notes.md, version 20).
// Per consumer warpgroup, from the producer's ticket (block_ticket.h), in three-warpgroup builds
// (head dim 64; pingpong builds ignore both): FWD_WG_COMPARE, each warpgroup runs the element
// compare only where its own 64 rows need it; FWD_WG_SKIP, a warpgroup skips the key blocks its
// rows do not see (a 1024-key window's first and last blocks are seen by part of a 192-row tile
// only: computed pairs 0.80 -> 0.89 visible on sliding window, scripts/tile_efficiency.py). Its
// blocks go in runs, each ending with its last P V, so that no wgmma is issued under a condition.
// How the producer tells each warpgroup's sight (GroupTicket::sight): 1 tests every block per
// warpgroup; 2 only blocks the column intervals cut partly; 3 only blocks whose tile needs any
// compare (the same skips as 1, fewer tests). Version 34's skip (1) cost the dense families 2-12%,
// mostly in the producer's per-group tests; with 3, once the producer walked no masked blocks
// (version 36: the tile floor, jobs handed over decoded), H100 head dim 64 with two Q buffers, two
// passes: sliding window +5-7%, global + sliding window +18% (8K, 32K), causal document +2-9%,
// full -1% to -3%, the rest within noise (docs/perf_notes.md, version 36).
#ifndef FLASHMASK_SM90_FWD_WG_COMPARE
#define FLASHMASK_SM90_FWD_WG_COMPARE 1
#endif
#ifndef FLASHMASK_SM90_FWD_WG_SKIP
#define FLASHMASK_SM90_FWD_WG_SKIP 3
#endif
// The element compare of a partial tile by quarters of 32 keys, a warp (16 rows) at a time
// (mask_scores_by_quarter, mask/element_mask.h): keys that the warp's rows all see are skipped and
// keys that they all miss filled, from a ballot over the staged mask columns; for the column
// intervals only where the block's bounds are tight (GroupTicket::tight). H100, both head dims:
// global + sliding window +6-11% (+10-17% with every partial tile classified, which cost random
// eviction 3-13%), the other families within the runs' drift (version 39). 0 compares every score.
#ifndef FLASHMASK_SM90_FWD_QUARTERS
#define FLASHMASK_SM90_FWD_QUARTERS 1
#endif
// The forward producer warpgroup's registers after setmaxnreg: with 24 its block walk spills a
// few words per block (more with the per-warpgroup tickets). At head dim 64, 32 still leaves the
// consumers theirs (128 * 32 + 384 * 160 = 65536) and reads sliding window 1-3% faster at 8K-128K
// on two passes, the other families within the runs' drift (version 39; within noise in version
// 34, before the tile floor and the decoded jobs). At head dim 128 it does not fit (setmaxnreg_fits),
// nor in the two-warpgroup build, whose consumers take 240 each.
#ifndef FLASHMASK_SM90_FWD_PRODUCER_REGS64
#define FLASHMASK_SM90_FWD_PRODUCER_REGS64 32
#endif
#ifndef FLASHMASK_SM90_FWD_PRODUCER_REGS128
#define FLASHMASK_SM90_FWD_PRODUCER_REGS128 24
#endif
// FWD_DECODE_WARP_KEYS64 / 128: from this many keys (0: never, and not built) the forward runs with a
// second producer warp that draws and decodes each job (the atomic draw, the job list, the tile
// floor, the top block's bounds: dependent global loads) while the load warp still issues the loads
// of the job before, and hands it over through shared memory (tile_scheduler.h, JobHandOver). ncu on
// sliding window 32K at D=64 (version 40) had sampled the consumers waiting at each job's start,
// for its Q and then its first K, at about 10% of all stall samples. H100, D=64, the same build
// with and without it, two passes each (version 41): at 128K global + sliding window +10% and
// sliding window +2-3%, the other families -1.5% to +0%; at 32K sliding window +1%, causal document
// and causal blockwise -2%; at 8K nothing gained and causal -6% (its load warp spills more, and a
// CTA holds a job drawn a whole job early while the last wave drains; drawing only near the job's
// end lost the gains). At D=128 2-5% slower on most families. The launch decides by Sk;
// FLASHMASK_SM90_DECODE_WARP=0/1 in the environment forces the choice where it is built (tests).
#ifndef FLASHMASK_SM90_FWD_DECODE_WARP_KEYS64
#define FLASHMASK_SM90_FWD_DECODE_WARP_KEYS64 65536
#endif
#ifndef FLASHMASK_SM90_FWD_DECODE_WARP_KEYS128
#define FLASHMASK_SM90_FWD_DECODE_WARP_KEYS128 0
#endif
// Two Q buffers at head dim 64 (head dim 128 has no room): sliding window +3-6% alone, +2-5% on top
// of FWD_WG_SKIP (versions 36 and 34).
#ifndef FLASHMASK_SM90_FWD_Q_STAGES64
#define FLASHMASK_SM90_FWD_Q_STAGES64 2
#endif
// K/V pipeline stages at head dim 64. With the per-warpgroup skip a job's three warpgroups work
// up to two blocks apart (the top rows' warpgroup starts at the job's first block, the bottom
// rows' one ends at its last), and a stage frees only once all three are done with it: with three
// stages the warpgroup ahead waited for the next job's first K (ncu on sliding window 32K, version
// 42: 6.7% of the stall samples there, 2.9% on its Q). Four (212 KiB of shared memory with two Q
// buffers, against 178): sliding window +4-5% at 8K and 32K, the other families within the runs' drift (H100,
// two passes, docs/perf_notes.md version 43); in version 37, before the quarters, the lazy rescale
// and 32 producer registers, four had lost 1-10%.
#ifndef FLASHMASK_SM90_FWD_STAGES64
#define FLASHMASK_SM90_FWD_STAGES64 4
#endif
// The forward softmax exponentiates each block at the rows' running max, straight into P, without
// the block's max, and takes the max only where a row's partial sum shows a score above it
// (OnlineSoftmax::exp_at_running_max): 64 FMNMX, four shuffles and two exponentials fewer per
// thread and block in the common case. Version 45 took the other blocks through the old softmax, a
// second copy of the exponentials in the loop's code; version 46 raises the max and goes round
// once more, one copy, and the window families no longer lose. H100, head dim 64, two passes
// against the old softmax: level on most families, sliding window +1-2%, prefix-LM document 128K
// +0-7% (in that run version 45's form read 0-8% below the old softmax at 8K and level at 128K; a
// session before, on another machine, +3-12% at 32K-128K). Head dim 128 (pingpong), two passes:
// level, so off there (docs/perf_notes.md, versions 45 and 46).
#ifndef FLASHMASK_SM90_FWD_STALE_MAX64
#define FLASHMASK_SM90_FWD_STALE_MAX64 1
#endif
#ifndef FLASHMASK_SM90_FWD_STALE_MAX128
#define FLASHMASK_SM90_FWD_STALE_MAX128 0
#endif
// setmaxnreg moves registers within the CTA's allocation at launch: its threads times the count
// ptxas gives each under __launch_bounds__(threads, 1), 65536 / threads down to a multiple of 8
// (168 for 384 threads). Asking for more than that in all makes the consumers' setmaxnreg.inc wait
// for ever (a head dim 128 forward with 32 producer registers, 128 * 32 + 256 * 240 = 65536 >
// 384 * 168, hung on the H100 in version 37).
constexpr bool setmaxnreg_fits(int threads, int producer_registers, int consumer_threads, int consumer_registers) {
    return 128 * producer_registers + consumer_threads * consumer_registers <= threads * (65536 / threads / 8 * 8);
}
constexpr FwdTile fwd_tile(int head_dim) {
    return head_dim <= 64 ? FwdTile{192, 128, 3, FLASHMASK_SM90_FWD_STAGES64, FLASHMASK_SM90_FWD_Q_STAGES64,
                                    FLASHMASK_SM90_FWD_PRODUCER_REGS64, 160,
                                    FLASHMASK_SM90_FWD_DECODE_WARP_KEYS64}
                          // a second Q buffer does not fit at head dim 128
                          : FwdTile{128, 128, 2, 2, 1, FLASHMASK_SM90_FWD_PRODUCER_REGS128, 240,
                                    FLASHMASK_SM90_FWD_DECODE_WARP_KEYS128};
}
// Whether the forward's setmaxnreg split fits its CTA at this head dim (FwdTraits asserts it;
// tests/test_tile_config.py checks the switch combinations on the CPU).
constexpr bool fwd_registers_fit(int head_dim) {
    const FwdTile t = fwd_tile(head_dim);
    return setmaxnreg_fits(128 * (t.consumer_warpgroups + 1), t.producer_registers, 128 * t.consumer_warpgroups,
                           t.consumer_registers);
}

// Backward: a CTA owns BlockN keys (64 per consumer warpgroup) and walks query blocks of BlockM rows,
// whose Q and dO go through a pipeline of `stages`. early_dv: dV += P^T dO is issued before dS^T is
// computed, to run alongside; at head dim 64 issuing it with dK was 3-7% faster on every mask
// family (docs/perf_notes.md, version 22).
// persistent: one CTA per SM draws jobs (tile_scheduler.h) instead of one CTA per job; at head dim
// 64 that was 1-9% faster on every family but sliding window (-1%, version 26); at head dim 128 up
// to 6% slower on the causal families then, 2-5% faster on every family once the consumers no
// longer walked the bounds themselves (versions 26 and 29, docs/perf_notes.md).
struct BwdTile {
    int block_m, block_n, consumer_warpgroups, stages;
    bool early_dv;
    int dq_warps;
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
// dq_warps: warps of the producer warpgroup that add dQ tiles to the accumulator, taking a job's
// visible query blocks in turn. In deterministic mode each holds its block's turn until the addition
// is complete in global memory; with one such warp that wait bounded every step. Two: the
// deterministic backward 1.07-1.54x faster (full 32K D=128 328 -> 503 TFLOP/s), the atomic one
// unchanged; three no better at 8K and 32K (version 32). At 128K three are: deterministic D=64 full
// 261 -> 404, prefix-LM causal 283 -> 402, causal 366 -> 399 and 2-8% at 8K and 32K, the atomic
// unchanged; at D=128 three lost 5-9% on four families at 8K and won only random eviction at 128K
// (171 -> 249; docs/perf_notes.md, version 37).
#ifndef FLASHMASK_SM90_BWD_DQ_WARPS64
#define FLASHMASK_SM90_BWD_DQ_WARPS64 3
#endif
#ifndef FLASHMASK_SM90_BWD_DQ_WARPS128
#define FLASHMASK_SM90_BWD_DQ_WARPS128 2
#endif

constexpr BwdTile bwd_tile(int head_dim) {
    return head_dim <= 64 ? BwdTile{FLASHMASK_SM90_BWD_M64, 128, 2, 2, FLASHMASK_SM90_BWD_EARLY_DV64,
                                    FLASHMASK_SM90_BWD_DQ_WARPS64}
                          : BwdTile{64, 128, 2, 2, FLASHMASK_SM90_BWD_EARLY_DV128, FLASHMASK_SM90_BWD_DQ_WARPS128};
}

}  // namespace flashmask::sm90
