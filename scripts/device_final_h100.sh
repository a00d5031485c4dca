#!/bin/bash
# One H100 call: build head dims 64 and 128 (fp16, bf16, sm_90a), every GPU test against every
# kernel family, then one packed-SFT step of 1M tokens on one GPU (chunked loss, offloaded checkpoints).
set -o pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export FLASHMASK_ARCHS=90 FLASHMASK_HEAD_DIMS=64,128 FLASHMASK_DTYPES=fp16,bf16
TESTS="tests/test_cuda_fwd.py tests/test_cuda_bwd.py tests/test_cuda_mask_values.py tests/test_cuda_mask_cache.py tests/test_integrations_gpu.py" \
TEST_TIMEOUT=300 MAXFAIL=20 \
BENCH="timeout 200 python3 benchmarks/bench_cp.py train --cp 1 --seqlens 1m --offload on --steps 2 --warmup-steps 1 --out $OUT/cp" \
bash scripts/device_check.sh
