// One translation unit per (head dim, dtype) so that the build compiles them in parallel.
#include "bwd_launch.h"
#include "launch.h"

namespace flashmask {
void run_bwd_hdim32_fp16(const BwdParams& p, bool deterministic, cudaStream_t stream) {
    run_bwd<32, cutlass::half_t>(p, deterministic, stream);
}
}  // namespace flashmask
