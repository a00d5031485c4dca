#!/bin/bash
# One H100 call while working on the SM90 backward: build head dims 64 and 128 (sm_90a), the GPU
# backward tests (both kernel families), then the backward of every mask family at D=64 and 128
# (8K, 32K): the SM90 kernel (FLASHMASK_ARCH=90) and FlexAttention in one run, then the SM80
# kernel alone.
set -o pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export FLASHMASK_ARCHS=90 FLASHMASK_HEAD_DIMS=64,128 FLASHMASK_DTYPES=${FLASHMASK_DTYPES:-fp16,bf16}
SEQLENS=${SEQLENS:-8k,32k}; DIMS=${DIMS:-64,128}
TESTS=${TESTS-tests/test_cuda_bwd.py} TEST_TIMEOUT=300 MAXFAIL=10 \
BENCH="FLASHMASK_ARCH=90 timeout 330 python3 benchmarks/bench_kernels.py --seqlens $SEQLENS --head-dims $DIMS --modes bwd --methods flashmask${FLEX-,flex} --quick --out $OUT/bench_sm90; \
FLASHMASK_ARCH=80 timeout 120 python3 benchmarks/bench_kernels.py --seqlens $SEQLENS --head-dims $DIMS --modes bwd --methods flashmask --quick --out $OUT/bench_sm80" \
bash scripts/device_check.sh
python3 - "$OUT" <<'PY'
import csv, sys, os
out = sys.argv[1]
rows = {}
for tag in ("sm90", "sm80"):
    path = os.path.join(out, f"bench_{tag}", "kernels.csv")
    if os.path.exists(path):
        for r in csv.DictReader(open(path)):
            if r["status"] == "ok":
                rows.setdefault((int(r["head_dim"]), r["family"], int(r["seqlen"])), {})[tag if r["method"] == "flashmask" else r["method"]] = float(r["tflops"])
print(f"{'D':>3s} {'bwd':24s} {'S':>6s} {'sm90':>7s} {'sm80':>7s} {'flex':>7s} {'90/80':>6s} {'90/flex':>7s}")
for (hd, f, s), d in sorted(rows.items()):
    a, b, c = d.get("sm90", float("nan")), d.get("sm80", float("nan")), d.get("flex", float("nan"))
    print(f"{hd:3d} {f:24s} {s:6d} {a:7.1f} {b:7.1f} {c:7.1f} {a / b:6.2f} {a / c:7.2f}")
PY
