// Split-KV: merges the partial outputs of the splits through their LSEs (one warp per row, over its
// value head dim), with the head's sink, if any, as one more split that carries no value.
#include <c10/cuda/CUDAException.h>
#include <cutlass/numeric_types.h>

#include "common/row_kernels.h"
#include "mask/mask_head.h"

namespace flashmask {
namespace {

template <typename Element>
__global__ void fwd_combine_kernel(const AttnParams p) {
    const int64_t rows = int64_t(p.b) * p.hq * p.sq;
    const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int i = row % p.sq;
    const int h = (row / p.sq) % p.hq;
    const int64_t b = row / (int64_t(p.sq) * p.hq);
    Element* out = reinterpret_cast<Element*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
    const float* lse_s = p.lse_partial + row;  // split s at lse_s[s * rows]
    float m = -INFINITY;
    for (int s = lane; s < p.num_splits; s += 32) m = fmaxf(m, lse_s[s * rows]);
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float sink = p.sinks != nullptr ? p.sinks[h] : -INFINITY;
    m = fmaxf(m, sink);
    if (m == -INFINITY) {
        // No split saw a key and there is no sink: the row is empty, by the mask, or because every
        // score it met was -inf (non-finite inputs: NaN, as softmax gives).
        const bool hidden = row_hidden(p, b, h, i);
        for (int c = lane; c < p.d_v; c += 32) out[c] = Element(hidden ? 0.f : NAN);
        if (lane == 0) p.lse[row] = hidden ? INFINITY : NAN;
        return;
    }
    float sum = 0.f;
    for (int s = lane; s < p.num_splits; s += 32) sum += __expf(lse_s[s * rows] - m);
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    sum += __expf(sink - m);
    const float lse = m + __logf(sum);
    for (int c = lane; c < p.d_v; c += 32) {
        float acc = 0.f;
        for (int s = 0; s < p.num_splits; ++s) {
            acc += __expf(lse_s[s * rows] - lse) * p.o_partial[(s * rows + row) * p.d_v + c];
        }
        out[c] = Element(acc);
    }
    if (lane == 0) p.lse[row] = lse;
}

template <typename Element>
void run(const AttnParams& p, cudaStream_t stream) {
    const int64_t rows = int64_t(p.b) * p.hq * p.sq;
    if (rows == 0) return;
    constexpr int kThreads = 256;
    fwd_combine_kernel<Element><<<(rows * 32 + kThreads - 1) / kThreads, kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void run_fwd_combine_fp16(const AttnParams& p, cudaStream_t stream) { run<cutlass::half_t>(p, stream); }
void run_fwd_combine_bf16(const AttnParams& p, cudaStream_t stream) { run<cutlass::bfloat16_t>(p, stream); }

}  // namespace flashmask
