// One translation unit per (kernel, head dim, dtype) so that the build compiles them in parallel.
#include "bwd_launch.h"
#include "launch.h"

namespace flashmask {
void run_bwd_dq_hdim128_bf16(const BwdParams& p, cudaStream_t stream) { run_bwd_dq<128, cutlass::bfloat16_t>(p, stream); }
}  // namespace flashmask
