// One translation unit per (kernel, head dim, dtype) so that the build compiles them in parallel.
#include "bwd_launch.h"
#include "launch.h"

namespace flashmask {
void run_bwd_kv_hdim96_fp16(const BwdParams& p, cudaStream_t stream) { run_bwd_kv<96, cutlass::half_t>(p, stream); }
}  // namespace flashmask
