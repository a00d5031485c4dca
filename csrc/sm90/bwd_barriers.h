// The named barriers of the SM90 backward. CUTLASS's user ids 0-7 are hardware barriers 8-15; the
// scheduler's job hand-over uses 7 (full) and 0 (empty), tile_scheduler.h.
#pragma once
#include <cutlass/arch/barrier.h>

#include "sm90/barrier_ids.h"

namespace flashmask::sm90 {

// The consumers' first staging (mask columns) before their first tile of a job.
constexpr int kBwdStagedBarrier = 1;
// dS in shared memory: written once both warpgroups are done reading the last block's, read after.
constexpr int kBwdDsBarrier = 2;
// The dQ tile handed from the consumers to a dQ warp (full, dq_full_*) and back (empty).
constexpr int kBwdDqEmptyBarrier = 4;
constexpr int kBwdStoreBarrier = 5;  // 5 and 6: the dK and dV buffer of each 64-key row tile
static_assert(user_barrier_fits(kBwdStoreBarrier + 1));

// The full barrier of dQ warp `slot` (up to three): each warp takes its tiles on its own, since one
// shared barrier would let a warp early for its tile complete another's phase. User ids run out,
// so these take hardware barriers 1-3, which CUTLASS reserves for collectives these kernels do not
// use (hardware ids stop at 15).
__forceinline__ __device__ cutlass::arch::ReservedNamedBarriers dq_full_barrier(int slot) {
    return static_cast<cutlass::arch::ReservedNamedBarriers>(1 + slot);
}
static_assert(static_cast<int>(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier) > 3, "dQ full barriers");

__forceinline__ __device__ void dq_full_sync(int threads, int slot) {
    cutlass::arch::NamedBarrier::sync(threads, dq_full_barrier(slot));
}
__forceinline__ __device__ void dq_full_arrive(int threads, int slot) {
    cutlass::arch::NamedBarrier::arrive(threads, dq_full_barrier(slot));
}

}  // namespace flashmask::sm90
