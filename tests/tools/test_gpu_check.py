"""tools/gpu_check.sh on a CPU: its arguments, and its logs and summary with a stand-in interpreter
whose `pip install` prints a ptxas report and whose `pytest` prints a result line."""
import os
import subprocess
import sys

import pytest

from tests import ROOT

SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")

# Answers `-m pip install ...` (the build) with ptxas's lines for two kernels, one of them spilling
# and with wgmma serialised, `-m flashmask` with a report's first line and `-m pytest ...` with a
# result line; records the arguments it got.
FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$(dirname "$0")/calls.txt"
if [ "$2" = pip ]; then
    echo "FLASHMASK_BUILD_CUDA=$FLASHMASK_BUILD_CUDA"
    echo "ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are \
serialized in the function 'k1'"
    echo "ptxas info    : Used 168 registers, used 1 barriers"
    echo "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
    echo "ptxas info    : Used 128 registers, used 1 barriers"
    echo "    8 bytes stack frame, 48 bytes spill stores, 72 bytes spill loads"
    exit ${FAKE_BUILD_RC:-0}
fi
if [ "$2" = flashmask ]; then
    echo "flashmask 0.1.0 at ..."
    exit 0
fi
echo "3 passed, 1 skipped in 0.10s"
"""


def run(*args, env=None):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=120)


@pytest.fixture
def fake_python(tmp_path):
    path = tmp_path / "bin" / "python"
    path.parent.mkdir()
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return path


def test_help_lists_every_option():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: bash tools/gpu_check.sh OUTDIR")
    for option in ("--wheels DIR", "--tests", "--bench", "--test-timeout", "--skip-build", "FLASHMASK_HEAD_DIMS"):
        assert option in r.stdout


def test_missing_outdir_is_refused():
    r = run()
    assert r.returncode == 2
    assert "usage:" in r.stderr and "OUTDIR is missing" in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unknown option '--bogus'"),
    (["--tests"], "--tests needs a value"),
    (["--wheels", "/no/such/folder"], "--wheels '/no/such/folder': no such folder"),
    (["--test-timeout", "soon"], "--test-timeout 'soon': expected a whole number of seconds"),
    (["second"], "one OUTDIR expected"),
])
def test_bad_arguments_are_named(tmp_path, args, message):
    r = run(str(tmp_path / "out"), *args)
    assert r.returncode == 2
    assert message in r.stderr
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_outdir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    r = run(str(path))
    assert r.returncode == 2 and "exists and is not a folder" in r.stderr


def test_wheels_folder_without_wheels_is_refused(tmp_path):
    r = run(str(tmp_path / "out"), "--wheels", str(tmp_path))
    assert r.returncode == 2 and "no .whl file in it" in r.stderr


def test_build_tests_bench_and_summary(tmp_path, fake_python):
    out = tmp_path / "out"
    r = run(str(out), "--bench", 'echo "bench in $OUTDIR"',
            env=dict(PYTHON=str(fake_python), FLASHMASK_HEAD_DIMS="64", FLASHMASK_DTYPES="bf16"))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = r.stdout.splitlines()[-6:]
    assert summary[0] == f"== summary ({out})"
    assert summary[1].startswith("build: ") and summary[1].endswith("s (head dims 64, dtypes bf16, archs default)")
    assert summary[2] == "ptxas: 2 kernels, up to 168 registers, 1 spilling, 1 with wgmma serialised (C7518)"
    assert summary[3] == "tests: 3 passed, 1 skipped (exit 0)"
    assert summary[4] == "bench: exit 0 (bench.log)"
    assert summary[5] == "exit code: 0"
    assert "WARNING: wgmma serialised (ptxas C7518) in 1 kernels" in r.stdout
    assert "FLASHMASK_BUILD_CUDA=1" in (out / "build.log").read_text()
    assert "C7518" in (out / "ptxas.txt").read_text()
    assert (out / "tests.log").read_text().strip() == "3 passed, 1 skipped in 0.10s"
    assert (out / "bench.log").read_text().strip() == f"bench in {out}"
    calls = (tmp_path / "bin" / "calls.txt").read_text().splitlines()
    assert calls[0].startswith("-m pip install --no-build-isolation --no-deps -v -e .")
    # The environment report of the build, before the tests.
    assert calls[1] == "-m flashmask" and (out / "env.txt").read_text() == "flashmask 0.1.0 at ...\n"
    default = "tests/gpu" if os.path.isdir(os.path.join(ROOT, "tests", "gpu")) else "tests"
    assert calls[2].startswith("-m pytest -q -p no:cacheprovider " + default)


def test_failed_build_runs_nothing_else(tmp_path, fake_python):
    out = tmp_path / "out"
    r = run(str(out), "--bench", "echo never", env=dict(PYTHON=str(fake_python), FAKE_BUILD_RC="1"))
    assert r.returncode == 1
    assert "build: FAILED after" in r.stdout and "tests: not run (the build failed)" in r.stdout
    assert r.stdout.splitlines()[-1] == "exit code: 1"
    assert not (out / "tests.log").exists() and not (out / "bench.log").exists() and not (out / "env.txt").exists()


@pytest.mark.slow  # two real pytest runs
def test_failing_tests_and_bench_set_the_exit_code(tmp_path):
    tests = tmp_path / "test_sample.py"
    tests.write_text("def test_ok():\n    pass\n\n\ndef test_broken():\n    assert False\n")
    r = run(str(tmp_path / "out"), "--skip-build", "--tests", str(tests), "--bench", "exit 3",
            env=dict(PYTHON=sys.executable))
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "build: skipped (--skip-build)" in lines
    assert "tests: 1 failed, 1 passed (exit 1)" in lines
    assert "bench: exit 3 (bench.log)" in lines
    assert lines[-1] == "exit code: 1"
    r = run(str(tmp_path / "out"), "--skip-build", "--tests", f"{tests}::test_ok", "--bench", "exit 3",
            env=dict(PYTHON=sys.executable))
    assert r.returncode == 3 and r.stdout.splitlines()[-1] == "exit code: 3"
