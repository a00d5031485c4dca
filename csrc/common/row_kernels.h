// The per-row kernels around the attention kernels, shared by every architecture (both dtypes are
// always built): the split-KV combine and the backward's D = rowsum(dO * O) - dLSE.
#pragma once
#include <cuda_runtime.h>

#include "common/params.h"

namespace flashmask {

// Split-KV: merges the partial outputs of the splits through their LSEs.
void run_fwd_combine_fp16(const AttnParams&, cudaStream_t);
void run_fwd_combine_bf16(const AttnParams&, cudaStream_t);

// D[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] - dLSE[b, h, i] (d < Dv) into p.dsum (dlse may be null);
// also zeroes p.dq_accum (where p.dq_accum_row > 0) and *p.job_counter (where not null).
void run_bwd_dsum_fp16(const BwdParams&, const float* dlse, cudaStream_t);
void run_bwd_dsum_bf16(const BwdParams&, const float* dlse, cudaStream_t);

}  // namespace flashmask
