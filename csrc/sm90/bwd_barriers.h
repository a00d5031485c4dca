// The named barriers of the SM90 backward (CUTLASS user ids 0-9). The scheduler's job hand-over
// uses 7 (full) and 0 (empty), tile_scheduler.h.
#pragma once

namespace flashmask::sm90 {

// The consumers' first staging (mask columns) before their first tile of a job.
constexpr int kBwdStagedBarrier = 1;
// dS in shared memory: written once both warpgroups are done reading the last block's, read after.
constexpr int kBwdDsBarrier = 2;
// The dQ tile handed from the consumers to a dQ warp (full) and back (empty).
constexpr int kBwdDqFullBarrier = 3;
constexpr int kBwdDqEmptyBarrier = 4;
constexpr int kBwdStoreBarrier = 5;    // 5 and 6: the dK and dV buffer of each 64-key row tile
constexpr int kBwdDqFullBarrier2 = 8;  // 8 and 9: the full barriers of the second and third dQ warps

// The full barrier of dQ warp `slot`: each warp takes its tiles on its own, since one shared
// barrier would let a warp early for its tile complete another's phase.
__forceinline__ __device__ int dq_full_barrier(int slot) {
    return slot == 0 ? kBwdDqFullBarrier : kBwdDqFullBarrier2 + slot - 1;
}

}  // namespace flashmask::sm90
