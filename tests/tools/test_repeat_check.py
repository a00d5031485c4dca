"""tools/repeat_check.py: arguments it cannot honour, and a machine without the kernels, end it
before any tensor is made (no GPU needed)."""
import subprocess
import sys
from pathlib import Path

import pytest

import flashmask

ROOT = Path(__file__).resolve().parents[2]


def run(*args):
    return subprocess.run([sys.executable, "-m", "tools.repeat_check", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--families", "causal,diagonal"], "--families must name mask families of"),
    (["--families", ","], "--families must name mask families of"),
    (["--reps", "0"], "--reps must be >= 1, got 0"),
    (["--kv-heads", "0"], "--kv-heads must be >= 1, got 0"),
    (["--heads", "6", "--kv-heads", "4"], "--kv-heads must divide --heads (6), got 4"),
])
def test_bad_arguments_are_refused(args, message):
    r = run(*args)
    assert r.returncode == 2
    assert message in r.stderr


@pytest.mark.skipif(flashmask.cuda.available(), reason="the kernels can run here")
def test_without_the_kernels_it_says_why():
    r = run("--families", "causal", "--reps", "1")
    assert r.returncode == 2
    assert "needs the CUDA kernels: " + flashmask.cuda.unavailable_reason() in r.stderr
