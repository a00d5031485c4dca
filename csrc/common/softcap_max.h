// Where a soft-capped softmax may run at a fixed max (plain C++: the binding and a CPU test read it).
// A capped score t * softcap lies in [-softcap, softcap], so in bf16 (fp32's exponent range) the
// softmax needs no running max: with C = softcap * log2(e) it takes exp2(t * C - shift), between
// 2^-(C + shift) and 2^(C - shift). shift keeps the top at most 2^kFixedMaxTop (sums over millions of
// keys, and O, stay far below fp32's 2^128) and the bottom a normal float (2^-126: nothing flushes
// to zero), which holds up to C = 95 (softcap 65.8). fp16 P (at most 65504) needs the running max.
#pragma once

namespace flashmask {

constexpr float kFixedMaxTop = 64.f;
constexpr float kFixedMaxBottom = 126.f;

// The fixed max in the units of t (OnlineSoftmax::fix_max) for scale_log2 = C, or -1 where the cap
// is too wide for one.
constexpr float softcap_fixed_max(float scale_log2) {
    const float shift = scale_log2 > kFixedMaxTop ? scale_log2 - kFixedMaxTop : 0.f;
    return scale_log2 + shift <= kFixedMaxBottom ? shift / scale_log2 : -1.f;
}

}  // namespace flashmask
