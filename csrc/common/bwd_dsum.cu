// The backward's preprocessing: D = rowsum(dO * O) - dLSE, one warp per row, and where asked
// LSE * log2(e) and the zeroing of the dQ accumulator; rows past Sq (up to stats_stride) get D = 0
// and LSE * log2(e) = +inf.
#include <c10/cuda/CUDAException.h>
#include <cutlass/numeric_types.h>

#include "common/row_kernels.h"

namespace flashmask {
namespace {

template <typename Element>
__global__ void bwd_dsum_kernel(const Element* __restrict__ dout, const Element* __restrict__ out,
                                const float* __restrict__ lse, const float* __restrict__ dlse,
                                float* __restrict__ dsum, float* __restrict__ lse_log2, float* __restrict__ dq_accum,
                                int accum_row, int sq, int stride, int hq, int d, int64_t do_b, int64_t do_s,
                                int64_t do_h, int64_t o_b, int64_t o_s, int64_t o_h, int64_t rows) {
    const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    if (accum_row > 0) {  // 16-byte stores: accum_row is a head dim, a multiple of 8
        float4* z = reinterpret_cast<float4*>(dq_accum + row * accum_row);
        for (int k = lane; k < accum_row / 4; k += 32) z[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const int i = row % stride;  // rows are ordered (b, h, i), like dsum
    const int64_t bh = row / stride;
    if (i >= sq) {
        if (lane == 0) {
            dsum[row] = 0.f;
            if (lse_log2 != nullptr) lse_log2[row] = INFINITY;
        }
        return;
    }
    const int h = bh % hq;
    const int64_t b = bh / hq;
    const Element* a = dout + b * do_b + i * do_s + h * do_h;
    const Element* c = out + b * o_b + i * o_s + h * o_h;
    float acc = 0.f;
    for (int k = lane; k < d; k += 32) acc += float(a[k]) * float(c[k]);
    for (int s = 16; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (lane == 0) {
        const int64_t in = bh * sq + i;  // lse and dlse are [B, Hq, Sq]
        dsum[row] = acc - (dlse != nullptr ? dlse[in] : 0.f);
        if (lse_log2 != nullptr) lse_log2[row] = lse[in] * float(M_LOG2E);
    }
}

template <typename Element>
void run(const BwdParams& p, const float* dlse, cudaStream_t stream) {
    const int64_t rows = int64_t(p.b) * p.hq * p.stats_stride;
    if (rows == 0) return;
    constexpr int kThreads = 256;
    const int64_t grid = (rows * 32 + kThreads - 1) / kThreads;
    bwd_dsum_kernel<Element><<<grid, kThreads, 0, stream>>>(
        static_cast<const Element*>(p.dout), static_cast<const Element*>(p.o), p.lse, dlse, const_cast<float*>(p.dsum),
        p.lse_log2, p.dq_accum, p.dq_accum_row, p.sq, p.stats_stride, p.hq, p.d, p.do_batch_stride, p.do_row_stride,
        p.do_head_stride, p.o_batch_stride, p.o_row_stride, p.o_head_stride, rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void run_bwd_dsum_fp16(const BwdParams& p, const float* dlse, cudaStream_t stream) {
    run<cutlass::half_t>(p, dlse, stream);
}
void run_bwd_dsum_bf16(const BwdParams& p, const float* dlse, cudaStream_t stream) {
    run<cutlass::bfloat16_t>(p, dlse, stream);
}

}  // namespace flashmask
