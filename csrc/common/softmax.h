// Online softmax over key blocks with deferred normalisation (FlashAttention-2): each thread keeps
// the running max and its partial row sums; the quad sum and the division happen once at the end.
// Both architectures' accumulators (mma.sync m16n8 and wgmma m64nN) spread a row over the four
// lanes of a quad, so one implementation serves both, on (rows, cols) views.
#pragma once
#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace flashmask {

// The four lanes of a quad share a row of the accumulator.
__forceinline__ __device__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__forceinline__ __device__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Lazy rescaling: a row keeps its running max while a block's max exceeds it by at most this much in
// the base-2 exponent, so that exp(S - max) stays below 2^8 (well inside fp16 and bf16 P and fp32
// sums), and O is rescaled only where some row of the warp took a new max: after the first few
// blocks of a row, seldom (FlashAttention-4 skips the rescale on Blackwell in the same way).
constexpr int kRescaleSlack = 8;

template <int kRows>
struct OnlineSoftmax {
    static constexpr int kRowCount = kRows;  // rows of the accumulator each thread holds
    float row_max[kRows];
    float row_sum[kRows];

    __forceinline__ __device__ OnlineSoftmax() {
        CUTE_UNROLL
        for (int i = 0; i < kRows; ++i) {
            row_max[i] = -INFINITY;
            row_sum[i] = 0.f;
        }
    }

    // Row mi's running max taken together with the block's scores, over the row's quad.
    template <typename S>
    __forceinline__ __device__ float max_with_block(S const& s, int mi) const {
        float m = row_max[mi];
        CUTE_UNROLL
        for (int ni = 0; ni < cute::size<1>(s); ++ni) m = fmaxf(m, s(mi, ni));
        return quad_max(m);
    }
    // The exponent offset of a row whose max is m: a row with nothing visible yet keeps max -inf,
    // and offset 0 keeps exp2(-inf - 0) = 0, not NaN.
    __forceinline__ __device__ static float offset_of(float m, float scale_log2) {
        return m == -INFINITY ? 0.f : m * scale_log2;
    }

    // s: scores of this block as (rows, cols), overwritten by exp(s - max); o: output accumulator
    // as (rows, cols), rescaled to the new max.
    template <typename S, typename O>
    __forceinline__ __device__ void update(S& s, O& o, float scale_log2) {
        float correction[kRows];
        if (update_scores(s, scale_log2, correction)) rescale(o, correction);
    }

    // update() in two steps, for a caller whose output accumulator an asynchronous GEMM is still
    // writing: exponentiate s and keep each row's rescale factor, then rescale o once it is free.
    // Returns whether o needs the rescale, the same in every lane of the warp.
    template <typename S>
    __forceinline__ __device__ bool update_scores(S& s, float scale_log2, float (&correction)[kRows]) {
        bool moved = false;
        CUTE_UNROLL
        for (int mi = 0; mi < cute::size<0>(s); ++mi) {
            float m = max_with_block(s, mi);
            if (row_max[mi] != -INFINITY && (m - row_max[mi]) * scale_log2 <= float(kRescaleSlack)) {
                m = row_max[mi];
            }
            moved |= m != row_max[mi];
            const float m_scaled = offset_of(m, scale_log2);
            correction[mi] = exp2f(row_max[mi] * scale_log2 - m_scaled);
            row_max[mi] = m;
            float sum = 0.f;
            CUTE_UNROLL
            for (int ni = 0; ni < cute::size<1>(s); ++ni) {
                s(mi, ni) = exp2f(s(mi, ni) * scale_log2 - m_scaled);
                sum += s(mi, ni);
            }
            row_sum[mi] = row_sum[mi] * correction[mi] + sum;
        }
        return __any_sync(0xffffffffu, moved);
    }

    // update_scores and the conversion to P without the block's max (the SM90 forward's
    // FwdTile::stale_max): exponentiate at each row's running max as it stands, into p (16-bit, s's
    // rows x cols), and keep the block where every thread's partial row sum stays within 2^slack, so
    // that no element of P exceeds what the lazy rescale allows; O needs no rescale then. Returns
    // whether it kept the block, the same in every lane of the warp. If not (a row of the warp has
    // seen nothing yet, or some score rose above its row's max), s is untouched: the caller raises
    // the max (raise_max) and calls again with force, which keeps the block whatever its sums (they
    // are at most 32 then, or NaN from NaN scores, which the output then carries as the reference's).
    template <typename S, typename P>
    __forceinline__ __device__ bool exp_at_running_max(S const& s, P& p, float scale_log2, bool force) {
        using Element = typename P::value_type;
        // Two neighbouring columns share a 32-bit register of P.
        static_assert(decltype(p.layout()){}(0, 1) == decltype(p.layout()){}(0, 0) + 1);
        bool fresh = false;
        CUTE_UNROLL
        for (int mi = 0; mi < cute::size<0>(s); ++mi) fresh |= row_max[mi] == -INFINITY;
        if (!force && __any_sync(0xffffffffu, fresh)) return false;
        float sum[kRows];
        bool within = true;
        CUTE_UNROLL
        for (int mi = 0; mi < cute::size<0>(s); ++mi) {
            const float m_scaled = offset_of(row_max[mi], scale_log2);  // -inf only when forced
            sum[mi] = 0.f;
            CUTE_UNROLL
            for (int ni = 0; ni < cute::size<1>(s); ni += 2) {
                cutlass::Array<float, 2> e;
                e[0] = exp2f(s(mi, ni) * scale_log2 - m_scaled);
                e[1] = exp2f(s(mi, ni + 1) * scale_log2 - m_scaled);
                sum[mi] += e[0];
                sum[mi] += e[1];
                *reinterpret_cast<cutlass::Array<Element, 2>*>(&p(mi, ni)) =
                    cutlass::NumericArrayConverter<Element, float, 2>{}(e);
            }
            within &= sum[mi] <= float(1 << kRescaleSlack);  // false for NaN
        }
        if (!force && !__all_sync(0xffffffffu, within)) return false;
        CUTE_UNROLL
        for (int mi = 0; mi < cute::size<0>(s); ++mi) row_sum[mi] += sum[mi];
        return true;
    }

    // Where exp_at_running_max did not keep a block: each row's max raised to the block's (no
    // slack, so that the next try's sums stay within 32), the row sums rescaled, and O's factors in
    // correction. Returns whether O needs them, the same in every lane of the warp.
    template <typename S>
    __forceinline__ __device__ bool raise_max(S const& s, float scale_log2, float (&correction)[kRows]) {
        bool moved = false;
        CUTE_UNROLL
        for (int mi = 0; mi < cute::size<0>(s); ++mi) {
            const float m = max_with_block(s, mi);
            moved |= m != row_max[mi];
            correction[mi] = exp2f(row_max[mi] * scale_log2 - offset_of(m, scale_log2));
            row_sum[mi] *= correction[mi];
            row_max[mi] = m;
        }
        return __any_sync(0xffffffffu, moved);
    }

    // A softmax whose rows' max is known before any score: soft-capped bf16 scores where the launch
    // chose one (AttnParams::softcap_max >= 0, common/softcap_max.h; fp16 P needs the running max).
    // Sets every row's max to it and says whether it did; then exp_at_fixed_max for each block, with
    // no block max, no shuffles and no rescale of O.
    template <bool kSoftcap, typename Element>
    __forceinline__ __device__ bool fix_max(float softcap_max) {
        constexpr bool kMay = kSoftcap && std::is_same_v<Element, cutlass::bfloat16_t>;
        const bool fixed = kMay && softcap_max >= 0.f;
        if (fixed) {
            CUTE_UNROLL
            for (int i = 0; i < kRows; ++i) row_max[i] = softcap_max;
        }
        return fixed;
    }
    // exp(s - max) in place, and the row sums.
    template <typename S>
    __forceinline__ __device__ void exp_at_fixed_max(S& s, float scale_log2) {
        CUTE_UNROLL
        for (int mi = 0; mi < cute::size<0>(s); ++mi) {
            const float m_scaled = row_max[mi] * scale_log2;
            CUTE_UNROLL
            for (int ni = 0; ni < cute::size<1>(s); ++ni) {
                s(mi, ni) = exp2f(s(mi, ni) * scale_log2 - m_scaled);
                row_sum[mi] += s(mi, ni);
            }
        }
    }

    template <typename O>
    __forceinline__ __device__ static void rescale(O& o, const float (&correction)[kRows]) {
        CUTE_UNROLL
        for (int mi = 0; mi < cute::size<0>(o); ++mi) {
            CUTE_UNROLL
            for (int di = 0; di < cute::size<1>(o); ++di) o(mi, di) *= correction[mi];
        }
    }

    // Normalises o and returns each row's log-sum-exp (natural log, +inf for rows nothing attends).
    // score_scale turns the kept max into the softmax's units; sink (-inf: none) is a logit in those
    // units that joins every row's denominator and carries no value: a row nothing attends then gets
    // LSE = sink. The sum is taken at max(max, sink) so that a large sink cannot overflow it.
    // hidden(mi), asked only of a row that ends with nothing (and no sink), tells whether the mask
    // hides it; if not, every score it met was -inf (non-finite inputs) and it gets NaN, as softmax
    // gives, where a hidden row gets 0 and +inf.
    template <typename O, typename Hidden>
    __forceinline__ __device__ void finalize(O& o, float score_scale, float (&lse)[kRows], float sink,
                                             Hidden const& hidden) {
        CUTE_UNROLL
        for (int mi = 0; mi < cute::size<0>(o); ++mi) {
            const float sum = quad_sum(row_sum[mi]);
            float inv, row_lse;
            if (sink == -INFINITY) {
                const bool empty = sum == 0.f;
                const bool blown = empty && !hidden(mi);
                inv = empty ? (blown ? NAN : 0.f) : 1.f / sum;
                row_lse = empty ? (blown ? NAN : INFINITY) : row_max[mi] * score_scale + __logf(sum);
            } else {
                // A row that kept nothing weighs its max 0, whether it never had one or it was fixed.
                const float m = sum == 0.f ? -INFINITY : row_max[mi] * score_scale;
                const float top = fmaxf(m, sink);
                const float kept = __expf(m - top);
                const float total = sum * kept + __expf(sink - top);
                inv = kept / total;
                row_lse = top + __logf(total);
            }
            lse[mi] = row_lse;
            CUTE_UNROLL
            for (int di = 0; di < cute::size<1>(o); ++di) o(mi, di) *= inv;
        }
    }
};

}  // namespace flashmask
