// The backward's preprocessing: D = rowsum(dO * O) - dLSE (over the value head dim), and where asked LSE * log2(e), the
// zeroing of the dQ accumulator and of the SM90 backward's job counter; rows past Sq (up to
// stats_stride) get D = 0 and LSE * log2(e) = +inf.
//
// A group of kGroup lanes takes one row. Where every row of dO and O starts 16-byte aligned and
// the head dim is a multiple of 8, each lane loads 16-byte pieces (8 lanes cover a D=64 row in one
// load each): this kernel is a pure stream of dO, O and the accumulator, and with one warp per row
// in 2-byte loads it took about a sixth of an SM90 backward. Otherwise a warp per row reads
// element by element.
#include <c10/cuda/CUDAException.h>
#include <cutlass/numeric_types.h>

#include "common/row_kernels.h"

namespace flashmask {
namespace {

constexpr int kThreads = 256;

struct DsumArgs {
    const float* lse;
    const float* dlse;
    float* dsum;
    float* lse_log2;
    float* dq_accum;
    int* job_counter;
    int accum_row, sq, stride, hq, d;  // d: the value head dim, over which D sums
    int64_t do_b, do_s, do_h, o_b, o_s, o_h, rows;
};

template <typename Element, bool kPieces>
__device__ float row_dot(const Element* a, const Element* c, int d, int lane, int group) {
    float acc = 0.f;
    if constexpr (kPieces) {
        constexpr int kPer = 16 / sizeof(Element);
        for (int k = lane * kPer; k < d; k += group * kPer) {
            const uint4 x = *reinterpret_cast<const uint4*>(a + k);
            const uint4 y = *reinterpret_cast<const uint4*>(c + k);
            const Element* xe = reinterpret_cast<const Element*>(&x);
            const Element* ye = reinterpret_cast<const Element*>(&y);
#pragma unroll
            for (int j = 0; j < kPer; ++j) acc += float(xe[j]) * float(ye[j]);
        }
    } else {
        for (int k = lane; k < d; k += group) acc += float(a[k]) * float(c[k]);
    }
    return acc;
}

template <typename Element, int kGroup, bool kPieces>
__global__ void __launch_bounds__(kThreads)
    bwd_dsum_kernel(const Element* __restrict__ dout, const Element* __restrict__ out, DsumArgs g) {
    if (g.job_counter != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *g.job_counter = 0;
    const int64_t row = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / kGroup;
    const int lane = threadIdx.x % kGroup;
    const bool valid = row < g.rows;
    if (valid && g.accum_row > 0) {  // 16-byte stores: accum_row is a head dim, a multiple of 8
        float4* z = reinterpret_cast<float4*>(g.dq_accum + row * g.accum_row);
        for (int k = lane; k < g.accum_row / 4; k += kGroup) z[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const int i = valid ? int(row % g.stride) : 0;  // rows are ordered (b, h, i), like dsum
    const int64_t bh = row / g.stride;
    const bool real = valid && i < g.sq;
    float acc = 0.f;
    if (real) {
        const int h = bh % g.hq;
        const int64_t b = bh / g.hq;
        acc = row_dot<Element, kPieces>(dout + b * g.do_b + i * g.do_s + h * g.do_h,
                                        out + b * g.o_b + i * g.o_s + h * g.o_h, g.d, lane, kGroup);
    }
    // Every lane of the warp takes part (groups never straddle a warp): no early return above.
#pragma unroll
    for (int s = kGroup / 2; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (!valid || lane != 0) return;
    if (!real) {
        g.dsum[row] = 0.f;
        if (g.lse_log2 != nullptr) g.lse_log2[row] = INFINITY;
        return;
    }
    const int64_t in = bh * g.sq + i;  // lse and dlse are [B, Hq, Sq]
    g.dsum[row] = acc - (g.dlse != nullptr ? g.dlse[in] : 0.f);
    if (g.lse_log2 != nullptr) g.lse_log2[row] = g.lse[in] * float(M_LOG2E);
}

template <typename Element, int kGroup, bool kPieces>
void launch(const BwdParams& p, const DsumArgs& g, cudaStream_t stream) {
    const int64_t grid = (g.rows * kGroup + kThreads - 1) / kThreads;
    bwd_dsum_kernel<Element, kGroup, kPieces>
        <<<grid, kThreads, 0, stream>>>(static_cast<const Element*>(p.dout), static_cast<const Element*>(p.o), g);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned16(const void* ptr, int64_t b, int64_t s, int64_t h, int elem) {
    const int64_t piece = 16 / elem;
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && b % piece == 0 && s % piece == 0 && h % piece == 0;
}

template <typename Element>
void run(const BwdParams& p, const float* dlse, cudaStream_t stream) {
    const int d_v = p.d_v;  // the value head dim
    const DsumArgs g{p.lse,
                     dlse,
                     const_cast<float*>(p.dsum),
                     p.lse_log2,
                     p.dq_accum,
                     p.job_counter,
                     p.dq_accum_row,
                     p.sq,
                     p.stats_stride,
                     p.hq,
                     d_v,
                     p.do_batch_stride,
                     p.do_row_stride,
                     p.do_head_stride,
                     p.o_batch_stride,
                     p.o_row_stride,
                     p.o_head_stride,
                     int64_t(p.b) * p.hq * p.stats_stride};
    if (g.rows == 0) return;
    constexpr int kElem = sizeof(Element);
    const bool pieces = d_v % (16 / kElem) == 0 &&
                        aligned16(p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride, kElem) &&
                        aligned16(p.o, p.o_batch_stride, p.o_row_stride, p.o_head_stride, kElem);
    if (!pieces) return launch<Element, 32, false>(p, g, stream);
    const int lanes = d_v / (16 / kElem);  // one piece per lane where the head dim allows
    if (lanes <= 8) return launch<Element, 8, true>(p, g, stream);
    if (lanes <= 16) return launch<Element, 16, true>(p, g, stream);
    launch<Element, 32, true>(p, g, stream);
}

}  // namespace

void run_bwd_dsum_fp16(const BwdParams& p, const float* dlse, cudaStream_t stream) {
    run<cutlass::half_t>(p, dlse, stream);
}
void run_bwd_dsum_bf16(const BwdParams& p, const float* dlse, cudaStream_t stream) {
    run<cutlass::bfloat16_t>(p, dlse, stream);
}

}  // namespace flashmask
