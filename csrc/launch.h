// Entry points of the per-(head dim, dtype) translation units, as plain C++ for the binding.
#pragma once
#include <cuda_runtime.h>

#include "params.h"

namespace flashmask {

#define FLASHMASK_DECLARE(HDIM, DTYPE)                                        \
    void run_fwd_hdim##HDIM##_##DTYPE(const AttnParams&, cudaStream_t);       \
    void run_bwd_kv_hdim##HDIM##_##DTYPE(const BwdParams&, cudaStream_t);     \
    void run_bwd_dq_hdim##HDIM##_##DTYPE(const BwdParams&, cudaStream_t);
#define FLASHMASK_FOR_ALL(X) X(32, fp16) X(32, bf16) X(64, fp16) X(64, bf16) X(96, fp16) X(96, bf16) \
    X(128, fp16) X(128, bf16) X(192, fp16) X(192, bf16) X(256, fp16) X(256, bf16)
FLASHMASK_FOR_ALL(FLASHMASK_DECLARE)
#undef FLASHMASK_DECLARE

// Split-KV: merges the partial outputs (both dtypes are always built).
void run_fwd_combine_fp16(const AttnParams&, cudaStream_t);
void run_fwd_combine_bf16(const AttnParams&, cudaStream_t);

// D = rowsum(dO * O) - dLSE, the backward's preprocessing (both dtypes are always built).
void run_bwd_dsum_fp16(const BwdParams&, const float* dlse, cudaStream_t);
void run_bwd_dsum_bf16(const BwdParams&, const float* dlse, cudaStream_t);

}  // namespace flashmask
