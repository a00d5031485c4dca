// A block as a producer warp queues it for the consumers of the SM90 kernels: its index and what
// its tile needs, so that the consumers read no bounds themselves. The backward queues query
// blocks (BlockTicket), the forward key blocks (GroupTicket); both write a block's ticket into a
// ring slot before they claim the block's pipeline stage, whose arrival publishes it.
#pragma once
#include "mask/block_walk.h"

namespace flashmask::sm90 {

// block << 3 | last << 2 | edges << 1 | intervals (last: the job's last block).
struct BlockTicket {
    int bits;
    __device__ static BlockTicket make(int block, const TileCompare& t, bool last) {
        return {block << 3 | int(last) << 2 | int(t.edges) << 1 | int(t.intervals)};
    }
    __device__ int block() const { return bits >> 3; }
    __device__ bool last() const { return (bits & 4) != 0; }
    __device__ TileCompare compare() const {
        const bool intervals = (bits & 1) != 0, edges = (bits & 2) != 0;
        return {intervals, edges, intervals || edges};
    }
};

// The forward's ticket: a key block as each of kGroups consumer warpgroups (64 query rows each)
// meets it. Per group: whether its rows see the block at all (a group may then skip it), whether
// they see the job's next block (so that a group knows where its run of blocks ends without
// reading the next ticket before it issues that block's GEMMs), and what its own compare needs,
// which is often less than the whole tile's.
// block << kBlockShift | tight << kTightBit | last << 4 * kGroups | per group g, at bit 4g:
//   sees_next << 3 | sees << 2 | edges << 1 | intervals.
// tight: the column intervals' ends move by at most kTightRows across the block (bounds_tight),
// so that the consumers' compare by quarters pays there (mask_scores).
template <int kGroups>
struct GroupTicket {
    static_assert(kGroups >= 1 && kGroups <= 3);
    static constexpr int kLastBit = 4 * kGroups, kTightBit = kLastBit + 1, kBlockShift = kTightBit + 1;
    static constexpr int kTightRows = 256;
    static constexpr int kMaxBlocks = 1 << (31 - kBlockShift);  // fwd_launch.h checks Sk against it
    int bits;

    // The groups whose rows see block b (bit g): without kPerGroup every group; with it each group's
    // own test, made only where the tile needs some compare (elsewhere every row sees the whole block).
    template <bool kPerGroup, typename Walk>
    __device__ static int sight(const Walk& walk, int block, const BlockBounds& b) {
        constexpr int kEvery = (1 << kGroups) - 1;
        if (!kPerGroup) return kEvery;
        if (!walk.compare(block, b).any) return kEvery;
        int s = 0;
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
            s |= int(walk.rows_see(block, b, walk.r0 + 64 * g, walk.r0 + 64 * g + 64)) << g;
        }
        return s;
    }
    // kPerGroupCompare: each group's own compare; otherwise the tile's for every group.
    template <bool kPerGroupCompare, typename Walk>
    __device__ static GroupTicket make(const Walk& walk, int block, const BlockBounds& b, int sight) {
        int bits = block << kBlockShift | int(bounds_tight(b.v, kTightRows)) << kTightBit;
        const TileCompare tile = walk.compare(block, b);
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
            const int g0 = walk.r0 + 64 * g;
            const TileCompare t = kPerGroupCompare ? walk.rows_compare(block, b, g0, g0 + 64) : tile;
            bits |= ((sight >> g & 1) << 2 | int(t.edges) << 1 | int(t.intervals)) << (4 * g);
        }
        return {bits};
    }
    // What the walk found below the block: the next block's sight, or that this is the job's last.
    __device__ void set_next(int next_sight, bool last) {
#pragma unroll
        for (int g = 0; g < kGroups; ++g) bits |= (next_sight >> g & 1) << (4 * g + 3);
        bits |= int(last) << kLastBit;
    }
    __device__ int block() const { return bits >> kBlockShift; }
    __device__ bool last() const { return (bits >> kLastBit & 1) != 0; }
    __device__ bool tight() const { return (bits >> kTightBit & 1) != 0; }
    __device__ bool sees(int g) const { return (bits >> (4 * g + 2) & 1) != 0; }
    // Group g's run goes on into the next block.
    __device__ bool run_continues(int g) const { return (bits >> (4 * g + 3) & 1) != 0; }
    __device__ TileCompare compare(int g) const {
        const bool intervals = (bits >> (4 * g) & 1) != 0, edges = (bits >> (4 * g + 1) & 1) != 0;
        return {intervals, edges, intervals || edges};
    }
    // Some group tests the column intervals: the block's mask columns go into its ring slot.
    __device__ bool any_intervals() const {
        int any = 0;
#pragma unroll
        for (int g = 0; g < kGroups; ++g) any |= bits >> (4 * g);
        return (any & 1) != 0;
    }
};

}  // namespace flashmask::sm90
