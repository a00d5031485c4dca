// Kernel parameters shared by the launch layer and the kernels (plain data, passed by value).
#pragma once
#include <cstdint>

namespace flashmask {

struct AttnParams {
    // Tensors q [B, Sq, Hq, D], k/v [B, Sk, Hk, D], o [B, Sq, Hq, D]; last dim contiguous.
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;  // [B, Hq, Sq], contiguous
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int b, sq, sk, hq, hk, d;
    int q_per_kv_head;  // Hq / Hk
    float softmax_scale, scale_log2;

    // FlashMask column intervals [B, Hm, Sk, C] int32 contiguous (nullptr: no mask) and their
    // per-key-block bounds [B, Hm, n_key_blocks, 8] (see mask_bounds.h).
    const int* mask;
    const int* bounds;
    int mask_c, hm, q_per_mask_head;  // q_per_mask_head = Hq / Hm
    int n_key_blocks;
    bool causal;
};

}  // namespace flashmask
