#!/bin/bash
# One GPU (an H100 call of 600 s): build as device_check.sh does (sm_90a, head dim 64, bf16: all the
# 0.5b model needs), then packed SFT of one 1M-token row on the one GPU (offloaded checkpoints, the
# MLPs in 64K-token chunks by default with --offload), then the cost of the MLP chunking at 256K:
# --mlp-chunk 0 (off) vs the default (65536 under --offload on), both with offloaded checkpoints so
# that the chunking is the only difference. Every run is guarded by timeout so that the script ends
# within ~560 s with a ~2 min build; the rows go to $OUT/cp/train.csv (appended, one table), the
# output to $OUT/bench.log (and build.log, gpu.txt, ptxas.txt).
set -o pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export FLASHMASK_ARCHS=90 FLASHMASK_HEAD_DIMS=64 FLASHMASK_DTYPES=bf16 MAX_JOBS=${MAX_JOBS:-16}
export PYTHONWARNINGS=ignore PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
TRAIN="python3 benchmarks/bench_cp.py train --cp 1 --offload on --out $OUT/cp"
export BENCH="echo '== 1M, one GPU, offload on, MLP chunk default'; timeout 200 $TRAIN --seqlens 1m --steps 2 --warmup-steps 1; echo \"[exit \$?]\"; \
echo '== 256K, offload on, MLP chunk 0 (off)'; timeout 95 $TRAIN --seqlens 256k --steps 3 --warmup-steps 1 --mlp-chunk 0; echo \"[exit \$?]\"; \
echo '== 256K, offload on, MLP chunk default'; timeout 95 $TRAIN --seqlens 256k --steps 3 --warmup-steps 1; echo \"[exit \$?]\""
bash scripts/device_check.sh
