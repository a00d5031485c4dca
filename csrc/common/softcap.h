// Logit soft-capping (Gemma 2): each score s = softmax_scale * q.k becomes softcap * tanh(s / softcap)
// before the mask. The kernels built with it take t = tanh(q.k * softcap_scale), softcap_scale =
// softmax_scale / softcap, as their score and run the softmax at scale softcap (AttnParams).
#pragma once
#include <cute/tensor.hpp>

namespace flashmask {

// One MUFU op; its relative error (2^-11) is below the rounding of bf16 inputs (2^-9).
__forceinline__ __device__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Scores to tanh(scores * softcap_scale), in place (any tensor of floats).
template <typename S>
__forceinline__ __device__ void softcap_scores(S& s, float softcap_scale) {
    CUTE_UNROLL
    for (int i = 0; i < cute::size(s); ++i) s(i) = tanh_approx(s(i) * softcap_scale);
}

// The backward's chain factor d t / d (q.k * softcap_scale) = 1 - t^2, from P = exp2(t * scale_log2 -
// lse_log2) alone: the scores are overwritten by P by then, and a second copy of them would cost a
// register per score. 0 where P is 0 (masked or underflowed), where dS is 0 anyway.
__forceinline__ __device__ float softcap_slope(float p, float lse_log2, float inv_scale_log2) {
    const float t = (__log2f(p) + lse_log2) * inv_scale_log2;
    return p > 0.f ? 1.f - t * t : 0.f;
}

}  // namespace flashmask
