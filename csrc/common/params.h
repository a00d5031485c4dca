// Kernel parameters shared by the launch layer and the kernels (plain data, passed by value).
#pragma once
#include <cstdint>

namespace flashmask {

struct AttnParams {
    // Tensors q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv], o [B, Sq, Hq, Dv]; last dim
    // contiguous. D is the head dim of q and k, Dv that of v and the output (== D but for an unequal pair).
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;  // [B, Hq, Sq], contiguous
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int b, sq, sk, hq, hk, d, d_v;
    int q_per_kv_head;  // Hq / Hk
    float softmax_scale, scale_log2;
    // Soft-capping: the kernels built for it score tanh(q.k * softcap_scale) (common/softcap.h);
    // scale_log2 and score_scale are then those of the softmax over those scores: softcap * log2(e) and
    // softcap. Without it softcap_scale is 0 and score_scale == softmax_scale. The backward scales dQ
    // and dK by softmax_scale in either case.
    float softcap_scale, score_scale;
    // Soft-capped bf16: the rows' max held fixed at this score (common/softcap_max.h); negative: tracked.
    float softcap_max;
    // Attention sinks: float32 [Hq], one logit per query head in every row's softmax denominator
    // (in the units of score_scale), or nullptr. Only the forward reads them: the backward's P comes
    // from the LSE, which holds them.
    const float* sinks;

    // FlashMask column intervals [B, Hm, Sk, C] int32 contiguous (nullptr: no mask) and their
    // per-key-block bounds [B, Hm, n_key_blocks, 8] (see mask_bounds.h).
    const int* mask;
    const int* bounds;
    // How many keys each query row may attend, [B, Hm, Sq] int32 (the forward; nullptr without a
    // mask): a row that ends empty though it sees keys met only -inf scores (mask_head.h: row_hidden).
    const int* keys_seen;
    int mask_c, hm, q_per_mask_head;  // q_per_mask_head = Hq / Hm
    int n_key_blocks;
    bool causal;
    bool decode_warp;  // the SM90 forward runs its build with a decode warp, where built (the binding decides)

    // Split-KV (Flash-Decoding): with num_splits > 1 the key blocks of a query tile are shared out
    // among num_splits CTAs, each writing a normalised partial output and its LSE (-inf where
    // it saw nothing); a combine kernel merges them. [num_splits, B, Hq, Sq, Dv] and [num_splits, B, Hq, Sq].
    int num_splits;
    float* o_partial;
    float* lse_partial;

    // Forward launch order: query tiles of each (batch, mask head) by decreasing work
    // ([B, Hm, m_tiles]), so that long tiles start first; nullptr: reversed for causal.
    const int* tile_order;
    // The lowest key block each of those tiles sees ([B, Hm, m_tiles], n_key_blocks if none): the
    // forward's downward walk stops there instead of classifying every masked block below a window
    // or a document (at 128K, 32 blocks a dependent load: 16 loads a job). nullptr: 0.
    const int* tile_floor;

    // Launch order over heads: CTA x is (head group, job, head in the group) with the group's
    // heads interleaved (job_and_head). Interleaving every head runs the heaviest causal jobs of
    // all heads first; a smaller group keeps what its heads stream (K and V in the forward, Q and
    // dO in the backward) within L2. head_group divides Hq (choose_head_group in the binding).
    int head_group;

    // The SM90 kernels: the jobs in the order of job_list (MaskMeta::jobs), or of the launch order
    // above where it is nullptr; job_counter (zero at launch) hands them out to their persistent CTAs.
    const int* job_list;
    int* job_counter;
};

// The backward adds dO, the row sums D = rowsum(dO * O) - dLSE (over Dv), and the gradients.
struct BwdParams : AttnParams {
    const void* dout;  // [B, Sq, Hq, Dv], last dim contiguous
    int64_t do_batch_stride, do_row_stride, do_head_stride;
    // D per (batch, head) row of stats_stride entries: Sq, or for the SM90 kernel Sq rounded up to its
    // query block, the padding 0, so that a block's values load as one aligned bulk copy; there also
    // lse_log2 = LSE * log2(e) in the same layout, +inf in the padding (those rows get P = 0).
    const float* dsum;
    float* lse_log2;  // nullptr where unused (SM80)
    int stats_stride;
    float* dq_accum;   // zeroed float32 [B, Hq, query blocks, BlockM * head dim] (dq_accum.h): dS*K over key blocks
    int dq_accum_row;  // > 0: the D kernel zeroes dq_accum, this many floats per padded row (stats_stride rows)
    // Deterministic SM90 backward: zeroed int32 [B, Hq, query blocks], one more than the last key
    // block that added to each query block's dQ (they add in order: sm90/bwd_dq_warps.h); nullptr otherwise.
    int* dq_semaphore;
    // dK [B, Sk, Hq, D], dV [B, Sk, Hq, Dv]: one slice per query head (a GQA group is summed afterwards).
    void* dk;
    void* dv;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
    void* dq;  // [B, Sq, Hq, D]
    int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
};

}  // namespace flashmask
