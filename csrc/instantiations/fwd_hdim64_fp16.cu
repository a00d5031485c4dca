// One translation unit per (kernel, head dim, dtype) so that the build compiles them in parallel.
#include "fwd_launch.h"
#include "launch.h"

namespace flashmask {
void run_fwd_hdim64_fp16(const AttnParams& p, cudaStream_t stream) { run_fwd<64, cutlass::half_t>(p, stream); }
}  // namespace flashmask
