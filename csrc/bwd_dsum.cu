#include "bwd_launch.h"
#include "launch.h"

namespace flashmask {
void run_bwd_dsum_fp16(const BwdParams& p, const float* dlse, cudaStream_t stream) {
    run_bwd_dsum<cutlass::half_t>(p, dlse, stream);
}
void run_bwd_dsum_bf16(const BwdParams& p, const float* dlse, cudaStream_t stream) {
    run_bwd_dsum<cutlass::bfloat16_t>(p, dlse, stream);
}
}  // namespace flashmask
