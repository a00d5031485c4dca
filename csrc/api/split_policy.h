// How many splits a split-KV forward takes (host side, no CUDA: tested on the CPU).
#pragma once
#include <algorithm>
#include <cstdint>

namespace flashmask {

// Split-KV pays off when the (query tile, head, batch) jobs cannot fill the `resident` CTA slots of
// the GPU, typically short queries against long keys. s splits make tiles * s jobs that run in
// ceil(tiles * s / resident) waves of ceil(n_key_blocks / s) key blocks each: the count with the
// fewest block-times, the smallest within 5% of them (every split adds a partial output to merge),
// at most 64 and at least 4 key blocks a split. A count just past a wave (the slots plus a few)
// would leave those few jobs to run alone in a second wave.
inline int split_kv_count(int tiles, int n_key_blocks, int resident) {
    if (tiles <= 0 || tiles >= resident || n_key_blocks < 8) return 1;
    const int most = std::min(64, n_key_blocks / 4);
    auto block_times = [&](int s) {
        return int64_t((int64_t(tiles) * s + resident - 1) / resident) * ((n_key_blocks + s - 1) / s);
    };
    int64_t best = block_times(1);
    for (int s = 2; s <= most; ++s) best = std::min(best, block_times(s));
    for (int s = 1; s <= most; ++s) {
        if (block_times(s) * 100 <= best * 105) return s;
    }
    return 1;
}

}  // namespace flashmask
