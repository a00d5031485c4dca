#!/bin/bash
# On a GPU machine: build several git revisions of the kernels side by side and time the flashmask
# forward (MODES=fwd) or backward (MODES=bwd) of every mask family with each, in one table.
#
#   bash tools/sweep_variants.sh OUTDIR [NAME=]REV ...
#
# REV is a branch, tag or commit of this checkout, or `.` for its working tree as it is (changes to
# tracked files included; commit new files first). NAME (letters, digits, _) heads the variant's
# column; default: REV with every other character as _ (`.`: worktree). Each variant is checked out as a git
# worktree in SCRATCH/NAME and built there; a later sweep reuses the worktree and its build, so an
# unchanged revision rebuilds quickly (`git worktree remove SCRATCH/NAME` drops one).
#
# Settings, from the environment:
#   HEAD_DIM=64 (or 64,128) DTYPE=bf16 ARCHS=90 (or 80,90)   what to build
#   SEQLENS=8k,32k,128k MODES=fwd METHODS=flashmask          what to time (flashmask_det: a column <name>_det)
#   FAMILIES=all (or a comma list)   the mask families to time
#   PASSES=1 (or 2)                  2: time the variants again in reverse order (columns <name>_2),
#                                    to tell a change from the drift between quick runs
#   BENCH_HEAD_DIMS=64               time only these head dims (default: HEAD_DIM)
#   KV_HEADS=2                       time with that many key/value heads (GQA, 16 query heads)
#   SOFTCAP=50                       time with logit soft-capping (bench_kernels --softcap)
#   TESTS="tests/gpu/test_bwd.py"   run these tests in each variant before the timings
#   TEST_VARIANTS="a b"  BENCH_VARIANTS="a b"   test / time only these variants (default: every one)
#   AFTER="command"                  run after the timings, with V_<name> set to each variant's
#                                    worktree, e.g. `cd $V_main && bash tools/ncu_profile.sh $OUTDIR/ncu`
#   SCRATCH (default: $TMPDIR or /tmp, /flashmask_sweep)  PYTHON (python3)  MAX_JOBS (all cores, shared)
#   TEST_TIMEOUT=200 BENCH_TIMEOUT=150   seconds per variant
#
# Writes OUTDIR/build_<name>.log, sass_<name>.txt, tests_<name>.log, <column>/kernels.csv and
# bench_<column>.log, and prints one line per (head dim, family, seqlen, mode) with each column's
# TFLOP/s (tools/sweep_table.py, also OUTDIR/sweep.csv). Before any timing it warns of what makes a
# kernel slow without an error: wgmma serialised (ptxas C7518), runtime traps, out-of-line functions
# in the attention kernels and wgmma waited for one at a time (python -m tools.compile_check --sass).
set -o pipefail

fail_usage() {
    echo "sweep_variants.sh: $1" >&2
    echo "usage: bash tools/sweep_variants.sh OUTDIR [NAME=]REV ... (the header of tools/sweep_variants.sh lists the settings)" >&2
    exit 2
}

[ $# -ge 2 ] || fail_usage "expected OUTDIR and at least one revision, got $# argument(s)"
OUTDIR=$1; shift
[ ! -e "$OUTDIR" ] || [ -d "$OUTDIR" ] || fail_usage "OUTDIR '$OUTDIR' exists and is not a folder"
SCRATCH=${SCRATCH:-${TMPDIR:-/tmp}/flashmask_sweep}
[[ $OUTDIR == /* ]] || OUTDIR=$PWD/$OUTDIR  # both relative to the caller's folder, not the checkout's
[[ $SCRATCH == /* ]] || SCRATCH=$PWD/$SCRATCH
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
git rev-parse --git-dir > /dev/null 2>&1 || fail_usage "$ROOT is not a git checkout"

NAMES=() SHAS=()
for arg in "$@"; do
    if [[ $arg == *=* ]]; then
        name=${arg%%=*}; rev=${arg#*=}
    else
        rev=$arg; name=${arg//[^A-Za-z0-9_]/_}
        [ "$rev" = . ] && name=worktree
        [[ $name =~ ^[0-9] ]] && name=r$name  # a commit hash
    fi
    [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || fail_usage "variant name '$name' (from '$arg'): expected letters, digits and _"
    [[ " ${NAMES[*]} " == *" $name "* ]] && fail_usage "variant name '$name' given twice"
    if [ "$rev" = . ]; then
        ident=()  # the stash commit is never kept: any identity will do where none is configured
        git config user.email > /dev/null || ident=(-c user.name=sweep_variants -c user.email=sweep_variants@localhost)
        sha=$(git "${ident[@]}" stash create) || fail_usage "'.': git stash create failed"
        [ -n "$sha" ] || sha=$(git rev-parse HEAD)
    else
        sha=$(git rev-parse --verify --quiet "$rev^{commit}") || fail_usage "'$rev' (variant $name) is no revision of this checkout"
    fi
    NAMES+=("$name"); SHAS+=("$sha")
done

mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd) || fail_usage "OUTDIR '$OUTDIR' cannot be created"
export OUTDIR
mkdir -p "$SCRATCH" && SCRATCH=$(cd "$SCRATCH" && pwd -P) || fail_usage "SCRATCH '$SCRATCH' cannot be created"
PY=${PYTHON:-python3}
HEAD_DIM=${HEAD_DIM:-64}; DTYPE=${DTYPE:-bf16}; SEQLENS=${SEQLENS:-8k,32k,128k}; MODES=${MODES:-fwd}; ARCHS=${ARCHS:-90}
n=${#NAMES[@]}
jobs=$(( ${MAX_JOBS:-$(nproc)} / n )); [ $jobs -lt 2 ] && jobs=2

git worktree prune  # worktrees whose folder is gone
t0=$(date +%s)
for i in "${!NAMES[@]}"; do
    name=${NAMES[i]}; sha=${SHAS[i]}; dir=$SCRATCH/$name
    if git worktree list --porcelain | grep -qx "worktree $dir"; then
        git -C "$dir" checkout -q --detach --force "$sha" || { echo "CHECKOUT FAILED: $name" >&2; exit 1; }
    elif [ -e "$dir" ]; then
        echo "sweep_variants.sh: $dir exists and is no worktree of this checkout; remove it or set SCRATCH" >&2
        exit 2
    else
        git worktree add -q --detach "$dir" "$sha" || { echo "CHECKOUT FAILED: $name" >&2; exit 1; }
    fi
    echo "$name: $(git log -1 --format='%h %s' "$sha" | cut -c1-100)"
    export "V_$name=$dir"
done
for name in "${NAMES[@]}"; do
    ( cd "$SCRATCH/$name" && FLASHMASK_BUILD_CUDA=1 FLASHMASK_PTXAS_VERBOSE=1 FLASHMASK_ARCHS=$ARCHS FLASHMASK_HEAD_DIMS=$HEAD_DIM \
        FLASHMASK_DTYPES=$DTYPE MAX_JOBS=$jobs "$PY" setup.py build_ext --inplace > "$OUTDIR/build_$name.log" 2>&1 \
        || echo "BUILD FAILED: $name (build_$name.log)" ) &
done
wait
echo "built $n variants in $(( $(date +%s) - t0 )) s"

for name in "${NAMES[@]}"; do  # what explains a loss before any timing does
    c=$(grep -c C7518 "$OUTDIR/build_$name.log" 2>/dev/null)
    [ "${c:-0}" -gt 0 ] && echo "WARNING: $name: wgmma serialised (ptxas C7518) in $c kernels"
    so=$(ls "$SCRATCH/$name"/flashmask/_C*.so 2>/dev/null | head -1)
    [ -n "$so" ] || continue
    "$PY" -m tools.compile_check --sass "$so" > "$OUTDIR/sass_$name.txt" 2>&1
    case $? in
        0) ;;
        1) echo "WARNING: $name: $(tail -1 "$OUTDIR/sass_$name.txt") (sass_$name.txt)" ;;
        *) echo "$name: SASS not checked: $(tail -1 "$OUTDIR/sass_$name.txt")" ;;
    esac
done

if [ -n "${TESTS:-}" ]; then
    for name in "${NAMES[@]}"; do
        [[ -n "${TEST_VARIANTS:-}" && " $TEST_VARIANTS " != *" $name "* ]] && continue
        # shellcheck disable=SC2086  # TESTS is a list of paths
        ( cd "$SCRATCH/$name" && timeout "${TEST_TIMEOUT:-200}" "$PY" -m pytest -q -x -p no:cacheprovider $TESTS \
            > "$OUTDIR/tests_$name.log" 2>&1; echo "tests $name: $(tail -1 "$OUTDIR/tests_$name.log")" )
    done
fi

columns=()
timed=()
for name in "${NAMES[@]}"; do
    [[ -n "${BENCH_VARIANTS:-}" && " $BENCH_VARIANTS " != *" $name "* ]] || timed+=("$name")
done
bench() {  # bench <variant> <column>
    ( cd "$SCRATCH/$1" && timeout "${BENCH_TIMEOUT:-150}" "$PY" -m benchmarks.bench_kernels --seqlens "$SEQLENS" \
        --families "${FAMILIES:-all}" --head-dims "${BENCH_HEAD_DIMS:-$HEAD_DIM}" --modes "$MODES" \
        --methods "${METHODS:-flashmask}" ${KV_HEADS:+--kv-heads "$KV_HEADS"} ${SOFTCAP:+--softcap "$SOFTCAP"} --quick \
        --out "$OUTDIR/$2" > "$OUTDIR/bench_$2.log" 2>&1 || { echo "BENCH FAILED: $2"; tail -5 "$OUTDIR/bench_$2.log"; } )
    columns+=("$2")
}
for name in "${timed[@]}"; do bench "$name" "$name"; done
if [ "${PASSES:-1}" -ge 2 ]; then
    for (( i=${#timed[@]}-1; i>=0; i-- )); do bench "${timed[i]}" "${timed[i]}_2"; done
fi
[ -n "${AFTER:-}" ] && ( eval "$AFTER" )
"$PY" -m tools.sweep_table "$OUTDIR" "${columns[@]}"
