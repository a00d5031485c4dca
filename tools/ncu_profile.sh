#!/bin/bash
# On a GPU machine, after a build (scripts/device_check.sh): profile one kernel launch of a
# flashmask step with ncu. Writes $OUT/ncu_<tag>.txt (speed of light, warp states, memory and
# compute workload) and $OUT/hot_<tag>.txt (the SASS lines with the most stall samples,
# scripts/ncu_hot_lines.py).
#   KERNEL=bwd_kernel FAMILY=causal SEQLEN=16384 HEAD_DIM=128 TOP=60 (the defaults)
#   STEP_ARGS="--mode fwd"   more arguments for scripts/profile_step.py (the forward kernel: KERNEL=fwd_kernel)
set -o pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
KERNEL=${KERNEL:-bwd_kernel}; FAMILY=${FAMILY:-causal}; SEQLEN=${SEQLEN:-16384}; HEAD_DIM=${HEAD_DIM:-128}
tag=${KERNEL}_${FAMILY}_${SEQLEN}_d${HEAD_DIM}
step=(python3 scripts/profile_step.py --family "$FAMILY" --seqlen "$SEQLEN" --head-dim "$HEAD_DIM" --steps 2 ${STEP_ARGS:-})
launch=(--kernel-name "regex:^$KERNEL" --launch-skip 1 --launch-count 1)
FLASHMASK_ARCH=${FLASHMASK_ARCH:-90} ncu "${launch[@]}" --section SpeedOfLight --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy \
    "${step[@]}" > "$OUT/ncu_$tag.txt" 2>&1 || tail -5 "$OUT/ncu_$tag.txt"
FLASHMASK_ARCH=${FLASHMASK_ARCH:-90} ncu "${launch[@]}" --section SourceCounters --page source --print-source sass --csv \
    "${step[@]}" > "/tmp/src_$tag.csv" 2>/dev/null
python3 scripts/ncu_hot_lines.py "/tmp/src_$tag.csv" --top "${TOP:-60}" > "$OUT/hot_$tag.txt"
echo "$tag: $(head -1 "$OUT/hot_$tag.txt")"
