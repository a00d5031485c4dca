#!/bin/bash
# One H100 call: build head dims 64 and 128 (fp16, bf16, sm_90a), every GPU test against every
# kernel family, then the forward of every mask family at D=128, 8K and 32K: flashmask (SM90) and
# FlexAttention on the same tensors.
set -o pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export FLASHMASK_ARCHS=90 FLASHMASK_HEAD_DIMS=64,128 FLASHMASK_DTYPES=fp16,bf16
TESTS="tests/test_cuda_fwd.py tests/test_cuda_bwd.py tests/test_cuda_mask_values.py tests/test_cuda_mask_cache.py tests/test_integrations_gpu.py" \
TEST_TIMEOUT=330 MAXFAIL=20 \
BENCH="timeout 120 python3 benchmarks/bench_kernels.py --seqlens 8k,32k --modes fwd --methods flashmask,flex --out $OUT/bench" \
bash scripts/device_check.sh
