// What csrc/'s device code needs on the host, for the CPU tests (tests/cxx.py): the qualifiers
// defined away, threadIdx per host thread and __ballot_sync over 32 host threads in lockstep (so
// that the warp-wide searches run unchanged), and the key blocks' bounds the mask_bounds_kernel
// computes. Include before the csrc/ headers under test.
#pragma once
#define __host__
#define __device__
#define __forceinline__ inline
#include <algorithm>
#include <atomic>
#include <barrier>
#include <climits>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>
using std::max;
using std::min;
struct int4 {
    int x, y, z, w;
};
struct ThreadIndex {
    unsigned x;
};
inline thread_local ThreadIndex threadIdx;
// A warp as 32 host threads: a ballot is one round of a barrier, its votes in one of three words
// (lane 0 clears the next round's word before this round's barrier; nobody reads it until after).
inline std::barrier<>* warp_barrier;
inline std::atomic<unsigned> votes[3];
inline thread_local int ballot_round = 0;
inline unsigned __ballot_sync(unsigned, bool pred) {
    const int r = ballot_round++ % 3;
    if (threadIdx.x == 0) votes[(r + 1) % 3] = 0;
    if (pred) votes[r].fetch_or(1u << threadIdx.x);
    warp_barrier->arrive_and_wait();
    return votes[r].load();
}
inline int __ffs(unsigned x) { return x == 0 ? 0 : __builtin_ctz(x) + 1; }

// Every lane runs fn(lane) in lockstep with the others.
inline void as_warp(const std::function<void(int)>& fn) {
    std::barrier<> bar(32);
    warp_barrier = &bar;
    for (auto& v : votes) v = 0;
    std::vector<std::thread> lanes;
    for (int lane = 0; lane < 32; ++lane)
        lanes.emplace_back([&, lane] {
            threadIdx.x = lane;
            ballot_round = 0;
            fn(lane);
        });
    for (auto& t : lanes) t.join();
}

#include "mask/intervals.h"

// A (batch, mask head) slice's [n_blocks, 8] bounds: the min and max of each interval end over each
// key block's columns ([Sk, C] values in `col`).
inline std::vector<int> block_bounds(const std::vector<int>& col, int sq, int sk, int c, bool causal, int block_n) {
    using namespace flashmask;
    const int n_blocks = (sk + block_n - 1) / block_n;
    std::vector<int> bounds(size_t(n_blocks) * kNumBounds);
    for (int n = 0; n < n_blocks; ++n) {
        int* b = bounds.data() + n * kNumBounds;
        for (int t = 0; t < 4; ++t) b[2 * t] = INT_MAX, b[2 * t + 1] = INT_MIN;
        for (int j = n * block_n; j < min((n + 1) * block_n, sk); ++j) {
            const ColumnIntervals iv = read_column(col.data(), j, c, causal, sq);
            const int v[4] = {iv.lts, iv.lte, iv.uts, iv.ute};
            for (int t = 0; t < 4; ++t) b[2 * t] = min(b[2 * t], v[t]), b[2 * t + 1] = max(b[2 * t + 1], v[t]);
        }
    }
    return bounds;
}
