#!/bin/bash
# On a GPU machine, after a build: profile one kernel launch of a flashmask step with ncu. Run it
# from the checkout whose build it profiles (e.g. a worktree of tools/sweep_variants.sh):
#
#   bash tools/ncu_profile.sh OUTDIR
#
# Writes OUTDIR/ncu_<tag>.txt (speed of light, warp states, memory and compute workload),
# OUTDIR/src_<tag>.csv (ncu's source page) and OUTDIR/hot_<tag>.txt (the SASS lines with the most
# stall samples, python -m tools.ncu_hot_lines). Settings, from the environment:
#   KERNEL=bwd_kernel FAMILY=causal SEQLEN=16384 HEAD_DIM=128 TOP=60 (the defaults)
#   STEP_ARGS="--mode fwd"   more arguments for python -m tools.profile_step (with KERNEL=fwd_kernel)
#   FLASHMASK_ARCH=90 (default)  PYTHON=python3
set -o pipefail
if [ $# -ne 1 ] || [[ $1 == -* ]]; then
    echo "usage: bash tools/ncu_profile.sh OUTDIR (the header of tools/ncu_profile.sh lists the settings)" >&2
    exit 2
fi
OUTDIR=$1
command -v ncu > /dev/null || { echo "ncu_profile.sh: ncu (Nsight Compute) is not on PATH" >&2; exit 2; }
mkdir -p "$OUTDIR" || exit 2
PY=${PYTHON:-python3}
KERNEL=${KERNEL:-bwd_kernel}; FAMILY=${FAMILY:-causal}; SEQLEN=${SEQLEN:-16384}; HEAD_DIM=${HEAD_DIM:-128}
export FLASHMASK_ARCH=${FLASHMASK_ARCH:-90}
tag=${KERNEL}_${FAMILY}_${SEQLEN}_d${HEAD_DIM}
# shellcheck disable=SC2206  # STEP_ARGS is a list of arguments
step=("$PY" -m tools.profile_step --family "$FAMILY" --seqlen "$SEQLEN" --head-dim "$HEAD_DIM" --steps 2 ${STEP_ARGS:-})
launch=(--kernel-name "regex:^$KERNEL" --launch-skip 1 --launch-count 1)
ncu "${launch[@]}" --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy \
    "${step[@]}" > "$OUTDIR/ncu_$tag.txt" 2>&1 || tail -5 "$OUTDIR/ncu_$tag.txt"
ncu "${launch[@]}" --section SourceCounters --page source --print-source sass --csv \
    "${step[@]}" > "$OUTDIR/src_$tag.csv" 2>/dev/null
"$PY" -m tools.ncu_hot_lines "$OUTDIR/src_$tag.csv" --top "${TOP:-60}" > "$OUTDIR/hot_$tag.txt"
echo "$tag: $(head -1 "$OUTDIR/hot_$tag.txt")"
