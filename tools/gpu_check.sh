#!/bin/bash
# On a GPU machine: build the extension, run the GPU tests, then optionally a benchmark; logs in
# OUTDIR and a short summary printed last. `bash tools/gpu_check.sh --help` lists the options.
set -o pipefail

usage() {
    cat <<'EOF'
usage: bash tools/gpu_check.sh OUTDIR [--wheels DIR] [--tests "PATHS"] [--bench "COMMAND"]
                                      [--test-timeout SECONDS] [--skip-build]

Builds the extension (pip install -e . with FLASHMASK_BUILD_CUDA=1, so a failed CUDA build fails),
runs the GPU tests and, if asked, a benchmark. Writes OUTDIR/gpu.txt (nvidia-smi), build.log,
ptxas.txt, env.txt (python -m flashmask), tests.log and bench.log, and prints a summary last (build seconds, test counts, exit code).

  OUTDIR                  folder for the logs (created if missing)
  --wheels DIR            first install the wheels in DIR with no package index (offline machines)
  --tests "PATHS"         pytest paths (default: tests/gpu tests/multigpu; tests where there is no tests/gpu)
  --bench "COMMAND"       run after the tests from the checkout's root, with $OUTDIR set, e.g.
                          'python -m benchmarks.bench_kernels --quick --out $OUTDIR/bench'
  --test-timeout SECONDS  stop the tests after this long (default: no limit)
  --skip-build            use the extension already built

The build honours FLASHMASK_HEAD_DIMS, FLASHMASK_DTYPES, FLASHMASK_ARCHS and MAX_JOBS (setup.py).
PYTHON names the interpreter (default: python3). Exit code: 1 if the build fails, else the tests'
if they fail, else the benchmark's.
EOF
}

fail_usage() {  # fail_usage MESSAGE
    echo "gpu_check.sh: $1" >&2
    echo "run 'bash tools/gpu_check.sh --help' for the options" >&2
    exit 2
}

OUTDIR="" WHEELS="" TESTS="" BENCH="" TEST_TIMEOUT="" SKIP_BUILD=0
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --wheels|--tests|--bench|--test-timeout)
            [ $# -ge 2 ] || fail_usage "$1 needs a value"
            case "$1" in
                --wheels) WHEELS=$2 ;;
                --tests) TESTS=$2 ;;
                --bench) BENCH=$2 ;;
                --test-timeout) TEST_TIMEOUT=$2 ;;
            esac
            shift 2 ;;
        --skip-build) SKIP_BUILD=1; shift ;;
        -*) fail_usage "unknown option '$1'" ;;
        *)
            [ -z "$OUTDIR" ] || fail_usage "one OUTDIR expected, got '$OUTDIR' and '$1'"
            OUTDIR=$1; shift ;;
    esac
done
[ -n "$OUTDIR" ] || { usage >&2; fail_usage "OUTDIR is missing"; }
[ ! -e "$OUTDIR" ] || [ -d "$OUTDIR" ] || fail_usage "OUTDIR '$OUTDIR' exists and is not a folder"
if [ -n "$WHEELS" ]; then
    [ -d "$WHEELS" ] || fail_usage "--wheels '$WHEELS': no such folder"
    compgen -G "$WHEELS/*.whl" > /dev/null || fail_usage "--wheels '$WHEELS': no .whl file in it"
fi
if [ -n "$TEST_TIMEOUT" ] && ! [[ "$TEST_TIMEOUT" =~ ^[1-9][0-9]*$ ]]; then
    fail_usage "--test-timeout '$TEST_TIMEOUT': expected a whole number of seconds"
fi

mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd) || fail_usage "OUTDIR '$OUTDIR' cannot be created"
export OUTDIR
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if [ -z "$TESTS" ]; then
    if [ -d tests/gpu ]; then
        TESTS="tests/gpu"
        [ -d tests/multigpu ] && TESTS+=" tests/multigpu"
    else
        TESTS="tests"
    fi
fi

if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUTDIR/gpu.txt"
fi

if [ -n "$WHEELS" ]; then
    echo "installing the wheels in $WHEELS"
    if ! "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl; then
        echo "gpu_check.sh: installing the wheels in $WHEELS failed" >&2
        exit 1
    fi
fi

build_line="build: skipped (--skip-build)"
ptxas_line=""
build_rc=0
if [ "$SKIP_BUILD" = 0 ]; then
    t0=$(date +%s)
    FLASHMASK_BUILD_CUDA=1 FLASHMASK_PTXAS_VERBOSE=${FLASHMASK_PTXAS_VERBOSE:-1} \
        "$PY" -m pip install --no-build-isolation --no-deps -v -e . > "$OUTDIR/build.log" 2>&1
    build_rc=$?
    seconds=$(( $(date +%s) - t0 ))
    what="head dims ${FLASHMASK_HEAD_DIMS:-all}, dtypes ${FLASHMASK_DTYPES:-all}, archs ${FLASHMASK_ARCHS:-default}"
    if [ $build_rc -ne 0 ]; then
        grep -n "error" "$OUTDIR/build.log" | head -40
        build_line="build: FAILED after $seconds s ($what; see build.log)"
    else
        build_line="build: $seconds s ($what)"
        # Register and spill lines with their counts; a serialised wgmma (C7518) costs a Hopper
        # kernel more than most changes gain, so it is named on its own.
        grep -h "registers\|spill" "$OUTDIR/build.log" | sort | uniq -c | sort -rn > "$OUTDIR/ptxas.txt"
        kernels=$(grep -c "Used [0-9]* registers" "$OUTDIR/build.log")
        max_regs=$(grep -o "Used [0-9]* registers" "$OUTDIR/build.log" | awk '$2 > m { m = $2 } END { print m + 0 }')
        spilling=$(grep -E -c "[1-9][0-9]* bytes spill (stores|loads)" "$OUTDIR/build.log")
        serialized=$(grep -c "C7518" "$OUTDIR/build.log")
        ptxas_line="ptxas: $kernels kernels, up to $max_regs registers, $spilling spilling, $serialized with wgmma serialised (C7518)"
        if [ "$serialized" -gt 0 ]; then
            echo "WARNING: wgmma serialised (ptxas C7518) in $serialized kernels: grep C7518 $OUTDIR/build.log" \
                | tee -a "$OUTDIR/ptxas.txt"
        fi
    fi
fi

# What the build can run on this machine: the kernels' head dims and the family each call takes.
[ $build_rc -eq 0 ] && "$PY" -m flashmask > "$OUTDIR/env.txt" 2>&1

tests_line="tests: not run (the build failed)"
tests_rc=0
bench_line="bench: not run"
bench_rc=0
if [ $build_rc -eq 0 ]; then
    echo "== pytest $TESTS"
    # shellcheck disable=SC2086  # TESTS is a list of paths
    ${TEST_TIMEOUT:+timeout "$TEST_TIMEOUT"} "$PY" -m pytest -q -p no:cacheprovider $TESTS 2>&1 \
        | tee "$OUTDIR/tests.log" | tail -40
    tests_rc=${PIPESTATUS[0]}
    counts=$(tail -5 "$OUTDIR/tests.log" | grep -E -o "[0-9]+ (passed|failed|skipped|deselected|xfailed|xpassed|errors?)" \
        | paste -sd, - | sed 's/,/, /g')
    [ $tests_rc -eq 124 ] && [ -n "$TEST_TIMEOUT" ] && counts="stopped after $TEST_TIMEOUT s${counts:+, $counts}"
    tests_line="tests: ${counts:-no counts in tests.log} (exit $tests_rc)"
    if [ -n "$BENCH" ]; then
        echo "== $BENCH"
        bash -c "$BENCH" 2>&1 | tee "$OUTDIR/bench.log" | tail -60
        bench_rc=${PIPESTATUS[0]}
        bench_line="bench: exit $bench_rc (bench.log)"
    fi
fi

rc=$build_rc
[ $rc -eq 0 ] && rc=$tests_rc
[ $rc -eq 0 ] && rc=$bench_rc
[ $build_rc -ne 0 ] && rc=1
echo
echo "== summary ($OUTDIR)"
echo "$build_line"
[ -n "$ptxas_line" ] && echo "$ptxas_line"
echo "$tests_line"
echo "$bench_line"
echo "exit code: $rc"
exit $rc
