#!/bin/bash
# On a GPU machine: install the carried CuTe headers, build the extension, run the GPU tests and
# (optionally) the benchmark. Logs go to $OUT (the device tool's output folder) or ./device_out.
#   FLASHMASK_HEAD_DIMS / FLASHMASK_DTYPES / FLASHMASK_ARCHS   restrict the build (see setup.py)
#   TESTS="tests/test_cuda_fwd.py ..."   BENCH="python3 benchmarks/... args"
set -o pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} FLASHMASK_BUILD_CUDA=1 FLASHMASK_PTXAS_VERBOSE=${FLASHMASK_PTXAS_VERBOSE:-1}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | grep -v "^WARNING" | tail -3
t0=$(date +%s)
if ! python3 -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1; then
    grep -n "error" "$OUT/build.log" | head -40; echo "BUILD FAILED"; exit 1
fi
echo "build: $(( $(date +%s) - t0 )) s for head dims ${FLASHMASK_HEAD_DIMS:-all}, dtypes ${FLASHMASK_DTYPES:-all}, archs ${FLASHMASK_ARCHS:-80;90}"
grep -h "registers\|spill" "$OUT/build.log" | sort | uniq -c | sort -rn | head -20 > "$OUT/ptxas.txt"
# A serialised wgmma (ptxas C7518) costs more than most changes gain (scripts/compile_check.py).
serialized=$(grep -c "C7518" "$OUT/build.log")
[ "$serialized" -gt 0 ] && echo "WARNING: wgmma serialized (ptxas C7518) in $serialized kernels: grep C7518 build.log"
rc=0
if [ -n "${TESTS:-}" ]; then
    timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q --maxfail=${MAXFAIL:-8} -p no:cacheprovider ${TESTS} 2>&1 | tee "$OUT/tests.log" | tail -40
    rc=${PIPESTATUS[0]}
fi
if [ -n "${BENCH:-}" ]; then
    eval "${BENCH}" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
exit $rc
