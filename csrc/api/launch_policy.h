// Host-side launch choices of the binding: split-KV, the head grouping of the launch order and the
// SM90 forward's decode warp.
#pragma once
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdint>

#include "api/overrides.h"
#include "api/split_policy.h"

namespace flashmask {

// The split-KV count of a forward (split_policy.h) on this GPU; ctas_per_sm: the forward's resident
// CTAs per SM (SM80 two, the persistent SM90 one).
inline int choose_num_splits(int tiles, int n_key_blocks, int ctas_per_sm) {
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    return split_kv_count(tiles, n_key_blocks, ctas_per_sm * sms);
}

// How many heads the launch interleaves (AttnParams::head_group). Without a mask every head's
// jobs weigh the same, and fewer heads in flight means more CTAs of one head streaming the same
// K/V (forward) or Q/dO (backward) blocks together: the largest divisor of hq whose heads stream
// at most half of L2. A mask makes some jobs far heavier (global tokens, long documents); only
// interleaving all heads starts the heaviest of every head first. The SM90 kernels with a mask
// start their jobs in the order of the mask's job list instead (MaskMeta::jobs: heaviest first,
// then head by head), except the deterministic backward, which from kTurnListKeys keys with a mask
// takes a list in its launch order whose head grouping the mask decides (compute_turn_jobs in
// mask_cache.cpp). Overrides::head_group pins the choice, and the deterministic backward then
// takes no list (tests).
inline bool head_group_forced() { return overrides().head_group > 0; }
inline int choose_head_group(int hq, int64_t bytes_per_head, bool masked) {
    if (head_group_forced()) {
        int g = std::min(hq, overrides().head_group);
        while (hq % g) --g;
        return g;
    }
    if (masked) return hq;
    const int64_t budget = at::cuda::getCurrentDeviceProperties()->l2CacheSize / 2;
    int g = hq;
    while (g > 1 && (hq % g != 0 || g * bytes_per_head > budget)) --g;
    return g;
}

// Whether the SM90 forward runs its build with a decode warp (FwdTile::decode_warp_keys): from `keys`
// keys, never where `keys` is 0 (not built). Overrides::decode_warp pins it where it is built (tests).
inline bool use_decode_warp(int sk, int keys) {
    if (keys <= 0) return false;
    if (overrides().decode_warp >= 0) return overrides().decode_warp == 1;
    return sk >= keys;
}

// The SM90 deterministic backward's job list in turn (Jobs::key_blocks_in_turn): from this many
// keys, heads whose key blocks see on average at least 1 / kTurnDenseShare of the query rows are
// interleaved kTurnFewHeads at a time (their walks are long: fewer heads in flight keep their Q,
// dO and dQ in L2), the others all at once (their walks are short chains: global + sliding window
// and causal document need every head's chains in flight). Below it every head at once, as without
// the list. Fitted at head dim 128, 32K and 128K keys.
constexpr int kTurnListKeys = 32768;
constexpr int kTurnDenseShare = 6;
constexpr int kTurnFewHeads = 4;

}  // namespace flashmask
