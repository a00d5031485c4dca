// A block as a producer warp queues it for the consumers of the SM90 kernels: its index and what
// its tile needs, so that the consumers read no bounds themselves. The backward queues query
// blocks, the forward key blocks; both write a block's ticket into a ring slot before they claim
// the block's pipeline stage, whose arrival publishes it.
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

}  // namespace flashmask::sm90
