#!/bin/bash
# One device call for the SM90 forward: build head dims 64 and 128 (both dtypes, sm_90a), run the
# GPU forward/backward tests against every kernel family, then time the forward of every mask
# family: flashmask (SM90), flashmask_sm80 and FlexAttention on the same tensors.
set -o pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export FLASHMASK_ARCHS=${FLASHMASK_ARCHS:-90} FLASHMASK_HEAD_DIMS=${FLASHMASK_HEAD_DIMS:-64,128}
export FLASHMASK_DTYPES=${FLASHMASK_DTYPES:-fp16,bf16}
TESTS=${TESTS:-"tests/test_cuda_fwd.py tests/test_cuda_bwd.py tests/test_cuda_mask_values.py"} \
TEST_TIMEOUT=${TEST_TIMEOUT:-420} \
BENCH=${BENCH:-"python3 benchmarks/bench_kernels.py --seqlens 8k,32k --modes fwd --methods flashmask,flashmask_sm80,flex --out $OUT/bench"} \
bash scripts/device_check.sh
