// The named barriers of the SM90 forward (CUTLASS user ids 0-7; 0-6 in use). Some belong to
// one consumer warpgroup: with two warpgroups they take turns issuing their GEMMs (pingpong); with
// three (head dim 64, 192-row tiles) they issue freely and their turn barriers are reused.
#pragma once
#include "sm90/barrier_ids.h"

namespace flashmask::sm90 {

template <int kConsumerWarpgroups>
struct FwdBarriers {
    static_assert(kConsumerWarpgroups == 2 || kConsumerWarpgroups == 3);
    static constexpr bool kPingpong = kConsumerWarpgroups == 2;
    // The warpgroup's output buffer (its 128 threads): 1, 2 (, 3).
    __device__ static constexpr int buffers(int wg) { return 1 + wg; }
    // Pingpong only: the turn of warpgroup 0 or 1, which the other one's arrival completes: 3, 4.
    __device__ static constexpr int turn(int wg) { return 3 + wg; }
    // A job published by the producer warp, one per warpgroup (tile_scheduler.h): 5, 0 (, 4).
    __device__ static constexpr int job_full(int wg) { return wg == 0 ? 5 : wg == 1 ? 0 : 4; }
    // Every consumer has read the published job.
    static constexpr int kJobEmpty = 6;
    static_assert(user_barrier_fits(kJobEmpty));
};

}  // namespace flashmask::sm90
