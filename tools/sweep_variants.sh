#!/bin/bash
# On a GPU machine: build several compile-time variants of the kernels side by side (copies under
# /tmp, built in parallel), then time the flashmask forward (MODES=fwd) or backward (MODES=bwd) of
# every mask family with each.
#   VARIANTS="base= wg2=FWD_WG64=2"  name=settings: each K=V defines FLASHMASK_SM90_K as V on top
#                                    of csrc/sm90/tile_config.h (its tuning macros)
#   VARIANTS="main= new=@.ab/new"    name=@folder: build the source tree in that folder instead (a
#                                    branch, taken here by `git archive BRANCH | tar -x -C .ab/new`;
#                                    .ab/ is not ignored, so it travels with the working tree)
#   TESTS="tests/test_cuda_bwd.py"   run these GPU tests in each variant before the timings
#   TEST_VARIANTS="next lead"        only in these variants (default: every one)
#   BENCH_VARIANTS="main next"       time only these variants (default: every one), e.g. to leave out
#                                    one built only for its tests
#   HEAD_DIM=64 (or 64,128) DTYPE=bf16 SEQLENS=8k,32k,128k  what to build and time
#   BENCH_HEAD_DIMS=64               time only these head dims (default: HEAD_DIM), e.g. where a
#                                    variant differs from main at one head dim only
#   KV_HEADS=2                       time with that many key/value heads (GQA, 16 query heads)
#   ARCHS=90 (or 80,90: the SM80 kernels too, e.g. for their GPU tests)
#   METHODS=flashmask,flashmask_det  what to time (flashmask_det gets a column <name>_det)
#   FAMILIES=all (or a comma list)  the mask families to time
#   PASSES=1 (or 2)                  2: time the variants again in reverse order (columns <name>_2),
#                                    to tell a change from the drift of a quick run (3-6%)
#   AFTER="command"                  run after the timings, with V_<name> set to each variant's
#                                    folder (e.g. ncu: `cd $V_main && KERNEL=fwd_kernel ... bash
#                                    scripts/ncu_profile.sh`, which profiles that folder's build)
# Prints one line per (head dim, family, seqlen, mode) with each variant's TFLOP/s (scripts/sweep_table.py),
# also written to $OUT/sweep.csv (each variant's own CSV stays under $OUT/<name>/).
set -o pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
HEAD_DIM=${HEAD_DIM:-64}; DTYPE=${DTYPE:-bf16}; SEQLENS=${SEQLENS:-8k,32k,128k}; MODES=${MODES:-fwd}; ARCHS=${ARCHS:-90}
read -r -a VARS <<< "${VARIANTS:?VARIANTS=\"name=flags ...\"}"
python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | grep -v "^WARNING" | tail -3
jobs=$(( 16 / ${#VARS[@]} )); [ $jobs -lt 2 ] && jobs=2
t0=$(date +%s)
for v in "${VARS[@]}"; do
    name=${v%%=*}; flags=${v#*=}
    dir=/tmp/variant_$name; rm -rf "$dir"; mkdir -p "$dir"
    src=.
    if [[ $flags == @* ]]; then src=${flags#@}; flags=""; fi
    ( cd "$src" && cp -r setup.py pyproject.toml README.md LICENSE csrc flashmask masks benchmarks tests scripts "$dir"/ )
    defs=""; IFS=, read -r -a kvs <<< "$flags"
    for kv in "${kvs[@]}"; do [ -n "$kv" ] && defs+="#define FLASHMASK_SM90_${kv%%=*} ${kv#*=}"$'\n'; done
    printf '%s' "$defs" | cat - "$src/csrc/sm90/tile_config.h" > "$dir/csrc/sm90/tile_config.h"
    ( cd "$dir" && FLASHMASK_BUILD_CUDA=1 FLASHMASK_PTXAS_VERBOSE=1 FLASHMASK_ARCHS=$ARCHS FLASHMASK_HEAD_DIMS=$HEAD_DIM FLASHMASK_DTYPES=$DTYPE \
        MAX_JOBS=$jobs python3 setup.py build_ext --inplace > "$OUT/build_$name.log" 2>&1 \
        || echo "BUILD FAILED: $name" ) &
    export "V_$name=$dir"
done
wait
echo "built ${#VARS[@]} variants in $(( $(date +%s) - t0 )) s"
for v in "${VARS[@]}"; do  # a serialised wgmma (ptxas C7518) explains a loss before any timing does
    n=$(grep -c C7518 "$OUT/build_${v%%=*}.log"); [ "$n" -gt 0 ] && echo "WARNING: ${v%%=*}: wgmma serialized in $n kernels"
    # The SASS once per variant (the extension is over 100 MB) for the three checks below.
    sass=/tmp/variant_${v%%=*}.sass
    cuobjdump -sass /tmp/variant_${v%%=*}/flashmask/*.so > "$sass" 2>/dev/null
    # So do runtime traps ptxas adds with no advisory (version 36's head dim 128 forward: 90, 6-10% slower).
    n=$(grep -c BPT.TRAP "$sass")
    [ "$n" -gt 0 ] && echo "WARNING: ${v%%=*}: $n runtime traps (BPT.TRAP) in the SASS (scripts/compile_check.py)"
    # And functions left out of line in the attention kernels, namespaces sm80 and sm90 (version 42: a
    # consumer lambda outlined, one kernel 12x slower; the row kernels call 64-bit division routines).
    n=$(awk '/Function :/ { attn = ($0 ~ /4sm[89]0/) } attn && /RET.REL/ { n++ } END { print n + 0 }' "$sass")
    [ "$n" -gt 0 ] && echo "WARNING: ${v%%=*}: $n out-of-line functions (RET.REL) in the SASS (scripts/compile_check.py)"
    # And kernels whose wgmma ptxas waits for one at a time, also with no advisory (a reloaded register operand).
    n=$(python3 -c "import sys; sys.path.insert(0, 'scripts')
import compile_check as c; print(sum(c.wgmma_waited_singly(*w) for w in c.waited_wgmma(sys.stdin.read()).values()))" < "$sass")
    [ "$n" -gt 0 ] && echo "WARNING: ${v%%=*}: $n kernels wait for each wgmma on its own (scripts/compile_check.py)"
    rm -f "$sass"
done
if [ -n "${TESTS:-}" ]; then
    for v in "${VARS[@]}"; do
        name=${v%%=*}
        [[ -n "${TEST_VARIANTS:-}" && " $TEST_VARIANTS " != *" $name "* ]] && continue
        ( cd "/tmp/variant_$name" && timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x -p no:cacheprovider $TESTS \
            > "$OUT/tests_$name.log" 2>&1; echo "tests $name: $(tail -1 "$OUT/tests_$name.log")" )
    done
fi
columns=()
timed=()
for v in "${VARS[@]}"; do
    [[ -n "${BENCH_VARIANTS:-}" && " $BENCH_VARIANTS " != *" ${v%%=*} "* ]] || timed+=("${v%%=*}")
done
bench() {  # bench <variant> <column>
    ( cd "/tmp/variant_$1" && timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_kernels.py --seqlens "$SEQLENS" \
        --families "${FAMILIES:-all}" --head-dims "${BENCH_HEAD_DIMS:-$HEAD_DIM}" --modes "$MODES" --methods "${METHODS:-flashmask}" ${KV_HEADS:+--kv-heads $KV_HEADS} --quick \
        --out "$OUT/$2" > "$OUT/bench_$2.log" 2>&1 || { echo "BENCH FAILED: $2"; tail -5 "$OUT/bench_$2.log"; } )
    columns+=("$2")
}
for name in "${timed[@]}"; do bench "$name" "$name"; done
if [ "${PASSES:-1}" -ge 2 ]; then
    for (( i=${#timed[@]}-1; i>=0; i-- )); do bench "${timed[i]}" "${timed[i]}_2"; done
fi
[ -n "${AFTER:-}" ] && eval "$AFTER"
python3 scripts/sweep_table.py "$OUT" "${columns[@]}"
# The device tool brings back only a few files: the JSON twins of the variants' CSVs would crowd out the rest.
rm -f "$OUT"/*/kernels.json
