// Tile shapes and tuning choices of the SM90 kernels, readable from plain C++ (the registry, a CPU
// test) and from the kernels.
#pragma once

namespace flashmask::sm90 {

// Forward: block_m query rows (64 per consumer warpgroup) against block_n keys per pipeline stage.
struct FwdTile {
    int block_m, block_n, consumer_warpgroups;
    int stages;    // K/V pipeline stages
    int q_stages;  // Q buffers: with two, the next job's Q loads while this job still runs
    int producer_registers, consumer_registers;  // the setmaxnreg split
    int decode_warp_keys;  // from this Sk the build with a decode warp runs (tile_scheduler.h); 0: not built
    // Each consumer warpgroup compares only what its own rows need and skips the key blocks they do
    // not see (GroupTicket).
    bool group_sight;
    // A partial tile's compare by quarters of 32 keys, a warp at a time (mask_scores_by_quarter).
    bool compare_by_quarters;
    // The softmax exponentiates at the rows' running max without the block's max, raising the max
    // only where a row's sum shows a score above it (OnlineSoftmax::exp_at_running_max).
    bool stale_max;
};

// setmaxnreg moves registers within the CTA's allocation at launch: its threads times the count ptxas
// gives each under __launch_bounds__(threads, 1), 65536 / threads down to a multiple of 8. Asking for
// more than that in all makes the consumers' setmaxnreg.inc wait for ever.
constexpr bool setmaxnreg_fits(int threads, int producer_registers, int consumer_threads, int consumer_registers) {
    return 128 * producer_registers + consumer_threads * consumer_registers <= threads * (65536 / threads / 8 * 8);
}

// head_dim: of Q and K; head_dim_v: of V and O (MLA's (192, 128)).
constexpr FwdTile fwd_tile(int head_dim, int head_dim_v) {
    FwdTile t{};
    t.block_n = 128;
    t.compare_by_quarters = true;  // skipping the keys a warp's rows all see or all miss pays on window edges
    if (head_dim_v > 128 || head_dim > 192) {
        // Two stages of 128-key K and V blocks do not fit beside Q at these head dims (the output
        // then leaves from the registers). (192, 128) fits them, and its accumulators are head dim
        // 128's: it takes 128's tile below. At 192 96-key blocks fit: faster on dense masks, slower
        // on narrow windows, whose edge blocks waste more keys. At 256 64-key blocks.
        t.consumer_warpgroups = 2;
        t.block_m = 128;
        t.block_n = head_dim <= 192 ? 96 : 64;
        t.compare_by_quarters = false;  // the quarters are those of a 128-key block
        t.stages = 2;
        t.q_stages = 1;
        t.producer_registers = 24;
        t.consumer_registers = 240;
        t.decode_warp_keys = 0;
        t.group_sight = false;  // pingpong
        t.stale_max = false;
    } else if (head_dim <= 64) {
        // GEMMs half as long next to the same softmax: a third warpgroup keeps the tensor cores fed.
        t.consumer_warpgroups = 3;
        t.block_m = 192;
        t.stages = 4;               // the three warpgroups work up to two blocks apart; a stage frees once all are done
        t.q_stages = 2;             // short jobs (a window's few blocks) do not wait for their Q
        t.producer_registers = 32;  // 24 made the block walk spill; 128 * 32 + 384 * 160 still fits
        t.consumer_registers = 160;
        t.decode_warp_keys = 65536;  // hides each job's dependent loads, which only long keys expose
        t.group_sight = true;        // a window's edge blocks are seen by part of a 192-row tile only
        t.stale_max = true;          // no block max: fewer FMNMX, shuffles and exponentials per block
    } else {
        // Head dims 96, 128 and (192, 128). The pingpong: one warpgroup's softmax runs under the other's GEMMs.
        t.consumer_warpgroups = 2;
        t.block_m = 128;
        t.stages = 2;               // no shared memory for more at head dim 128 (96 takes 128's choices)
        t.q_stages = 1;             // nor for a second Q buffer
        t.producer_registers = 24;  // 32 does not fit beside two warpgroups of 240
        t.consumer_registers = 240;
        t.decode_warp_keys = 0;  // slower at this head dim
        t.group_sight = false;   // pingpong turns must pair up: no warpgroup may skip a block
        t.stale_max = false;     // level with the block max here
    }
    return t;
}

constexpr FwdTile fwd_tile(int head_dim) { return fwd_tile(head_dim, head_dim); }

// Whether the forward's setmaxnreg split fits its CTA at these head dims (FwdTraits asserts it;
// tests/cpu/test_tile_config.py checks it on the CPU).
constexpr bool fwd_registers_fit(int head_dim, int head_dim_v) {
    const FwdTile t = fwd_tile(head_dim, head_dim_v);
    return setmaxnreg_fits(128 * (t.consumer_warpgroups + 1), t.producer_registers, 128 * t.consumer_warpgroups,
                           t.consumer_registers);
}
constexpr bool fwd_registers_fit(int head_dim) { return fwd_registers_fit(head_dim, head_dim); }

// Backward: a CTA owns block_n keys and walks query blocks of block_m rows, whose Q and dO go
// through a pipeline of `stages`. One CTA per SM draws the jobs.
struct BwdTile {
    int block_m, block_n, consumer_warpgroups, stages;
    bool early_dv;  // dV += P^T dO issued before dS^T is computed, to run alongside it
    // Producer warps that add dQ tiles to the accumulator, taking a job's query blocks in turn; in
    // deterministic mode each holds its block's turn until the addition is complete in global memory.
    int dq_warps;
    // false: each consumer warpgroup owns 64 of the keys, its dK and dV rows in registers, P^T and
    // dS^T the register A operands of their GEMMs. true: the warpgroups share 64 keys and split the
    // head dim of dK and dV (whose whole rows do not fit in registers above head dim 128); P^T and
    // dS^T then go through shared memory.
    bool split_head_dim;
    int dq_slices;  // dQ = dS K in this many head-dim slices, one slice's accumulator live at a time
};

constexpr BwdTile bwd_tile(int head_dim) {
    BwdTile t{};
    t.block_m = 64;
    t.block_n = 128;
    t.consumer_warpgroups = 2;
    t.stages = 2;
    t.split_head_dim = false;
    t.dq_slices = 1;
    if (head_dim <= 64) {
        t.early_dv = false;  // issued with dK it ran faster at this head dim
        t.dq_warps = 3;      // the deterministic turns of long sequences come faster than two warps complete them
    } else if (head_dim <= 128) {
        t.early_dv = true;
        t.dq_warps = 2;  // a third warp lost more at 8K than it won at 128K
    } else {
        t.block_n = 64;
        t.split_head_dim = true;
        t.early_dv = true;  // P^T is in shared memory before dS^T is computed
        t.dq_warps = 2;
        // Shared memory (16-bit, 64-row blocks): Q and dO stages, K, V, P, dS and the fp32 dQ tile
        // take 208 KB with two stages at 192 and with one at 256.
        t.stages = head_dim <= 192 ? 2 : 1;
        t.dq_slices = head_dim <= 192 ? 1 : 2;  // at 256 a whole dQ tile beside dK and dV would spill
    }
    return t;
}

// A pair of head dims (q/k, v) takes the tiles of its wider one.
constexpr BwdTile bwd_tile(int head_dim, int head_dim_v) {
    return bwd_tile(head_dim > head_dim_v ? head_dim : head_dim_v);
}

}  // namespace flashmask::sm90
