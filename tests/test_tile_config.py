"""The SM90 forward's register split under the build switches (csrc/sm90/tile_config.h,
``fwd_registers_fit``), on the CPU with a C++ compiler: the header is plain C++.

setmaxnreg only moves registers within what the CTA got at launch; a producer / consumer split
that asks for more makes the consumers' setmaxnreg wait for ever (a D=128 forward with 32 producer
registers hung an H100 in version 37). ``FwdTraits`` turns that into a compile error, but only a
CUDA build of that instantiation finds it: the two-warpgroup D=64 build (``FWD_WG64=2``) stopped
building when D=64 took 32 producer registers, and nothing said so until a GPU build (version 40).
Each switch combination that scripts/sweep_variants.sh may build is checked here.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")

PROGRAM = r"""
#include "sm90/tile_config.h"
static_assert(flashmask::sm90::fwd_registers_fit(64), "head dim 64: setmaxnreg split does not fit");
static_assert(flashmask::sm90::fwd_registers_fit(128), "head dim 128: setmaxnreg split does not fit");
int main() { return 0; }
"""


def fits(tmp_path, switches):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "fit.cpp"
    src.write_text(PROGRAM)
    defines = [f"-DFLASHMASK_SM90_{k}={v}" for k, v in switches.items()]
    run = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-I", CSRC, *defines, str(src)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        assert "does not fit" in run.stderr, run.stderr  # a failure for any other reason is a bug here
    return run.returncode == 0


@pytest.mark.parametrize("switches", [{}, {"FWD_WG64": 2}, {"FWD_WG64": 2, "FWD_Q_STAGES64": 1},
                                      {"FWD_DECODE_WARP_KEYS128": 32768}, {"FWD_PRODUCER_REGS64": 24}])
def test_switch_combinations_fit(tmp_path, switches):
    assert fits(tmp_path, switches)


@pytest.mark.parametrize("switches", [{"FWD_PRODUCER_REGS128": 32},  # version 37's hang
                                      {"FWD_WG64": 2, "FWD_PRODUCER_REGS64": 32}])
def test_splits_that_overflow_are_refused(tmp_path, switches):
    assert not fits(tmp_path, switches)
