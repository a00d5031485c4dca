// The order in which CTAs of a (job, head) grid start: see AttnParams::head_group.
#pragma once

namespace flashmask {

struct JobHead {
    int job;   // the forward's query-tile rank or the backward's key block
    int head;  // query head
};

// CTA x of a launch with `jobs` jobs per head: heads are taken `group` at a time, and within a
// group the heads vary fastest.
__device__ __forceinline__ JobHead job_and_head(int x, int jobs, int group) {
    const int per_group = jobs * group;
    const int g = x / per_group;
    const int r = x - g * per_group;
    return {r / group, g * group + r % group};
}

// Entry j of a job list (MaskMeta::jobs, (b * Hq + h) * tiles + tile): the tile (the forward's
// query tile or the backward's key block), its query head and batch.
struct ListedJob {
    int tile, head, batch;
};
__device__ __forceinline__ ListedJob listed_job(int j, int tiles, int hq) {
    const int bh = j / tiles;
    return {j - bh * tiles, bh % hq, bh / hq};
}

}  // namespace flashmask
