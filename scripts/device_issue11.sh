#!/bin/bash
# One device call: full sm_90 build, every GPU test, and the flashmask rows of the kernel benchmark
# compared with the stored H100 results (same speed after the kernel-layout refactor).
set -o pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export FLASHMASK_ARCHS=${FLASHMASK_ARCHS:-90}
TESTS="tests/test_cuda_fwd.py tests/test_cuda_bwd.py tests/test_cuda_mask_values.py tests/test_integrations_gpu.py" \
TEST_TIMEOUT=${TEST_TIMEOUT:-420} \
BENCH="python3 benchmarks/bench_kernels.py --seqlens 8k,32k --modes fwd,bwd,fwdbwd --methods flashmask,sdpa_flash --out $OUT/bench && python3 scripts/compare_kernels.py benchmarks/results_h100/kernels.csv $OUT/bench/kernels.csv" \
bash scripts/device_check.sh
