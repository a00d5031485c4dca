#!/bin/bash
# One H100 call after device_final_h100.sh (the machine still warm: its build is reused, else
# rebuilt): the forward of every mask family at D=64 (8K, 32K, 128K) and D=128 (128K), flashmask
# (SM90) and FlexAttention on the same tensors; then, in the time left, the default build (every
# head dim and dtype, sm_80 and sm_90a) from scratch in a copy, timed.
set -o pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export FLASHMASK_ARCHS=90 FLASHMASK_HEAD_DIMS=64,128 FLASHMASK_DTYPES=fp16,bf16
t0=$(date +%s)
BENCH="timeout 170 python3 benchmarks/bench_kernels.py --seqlens 8k,32k,128k --head-dims 64 --modes fwd --methods flashmask,flex --quick --out $OUT/bench_d64; \
timeout 130 python3 benchmarks/bench_kernels.py --seqlens 128k --head-dims 128 --modes fwd --methods flashmask,flex --quick --out $OUT/bench_128k" \
bash scripts/device_check.sh
left=$(( ${BUDGET_S:-570} - ($(date +%s) - t0) ))
echo "default build: ${left} s left for it"
rm -rf /tmp/fullbuild && mkdir -p /tmp/fullbuild && cp -r setup.py pyproject.toml README.md LICENSE csrc flashmask masks /tmp/fullbuild/
cd /tmp/fullbuild && unset FLASHMASK_ARCHS FLASHMASK_HEAD_DIMS FLASHMASK_DTYPES
b0=$(date +%s)
if FLASHMASK_BUILD_CUDA=1 MAX_JOBS=16 timeout $left python3 setup.py build_ext --inplace > "$OUT/default_build.log" 2>&1; then
    echo "default build (all head dims and dtypes, sm_80 + sm_90a, MAX_JOBS=16): $(( $(date +%s) - b0 )) s"
else
    echo "default build did not finish: stopped after $(( $(date +%s) - b0 )) s ($(grep -c '\.o$\|Building\|nvcc' "$OUT/default_build.log") log lines)"
    tail -3 "$OUT/default_build.log"
fi
