"""The SM90 kernels' tile configuration (csrc/sm90/tile_config.h) on the CPU, with a C++ compiler:
the header is plain C++.

setmaxnreg only moves registers within what the CTA got at launch; a producer / consumer split that
asks for more makes the consumers' setmaxnreg wait for ever (a head dim 128 forward with 32 producer
registers hangs). ``FwdTraits`` turns that into a compile error, but only a CUDA build of that
instantiation finds it; here a C++ compiler checks every head dim's split, and that the check
refuses the splits known to overflow.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests import ROOT

CSRC = os.path.join(ROOT, "csrc")

PROGRAM = r"""
#include "sm90/tile_config.h"
using namespace flashmask::sm90;
static_assert(fwd_registers_fit(64), "head dim 64: setmaxnreg split does not fit");
static_assert(fwd_registers_fit(128), "head dim 128: setmaxnreg split does not fit");
// 384 threads get 168 registers each at launch: 32 producer registers beside two consumer
// warpgroups of 240 ask for more; 24 fit, and so do 32 beside three warpgroups of 160.
static_assert(!setmaxnreg_fits(384, 32, 256, 240), "an overflowing split passes");
static_assert(setmaxnreg_fits(384, 24, 256, 240), "head dim 128's split is refused");
static_assert(setmaxnreg_fits(512, 32, 384, 160), "head dim 64's split is refused");
static_assert(fwd_tile(64).block_m == 64 * fwd_tile(64).consumer_warpgroups, "64 rows per warpgroup");
static_assert(fwd_tile(128).block_m == 64 * fwd_tile(128).consumer_warpgroups, "64 rows per warpgroup");
// Per-warpgroup skipping needs warpgroups that issue freely: three, not the pingpong's two.
static_assert(!fwd_tile(128).group_sight || fwd_tile(128).consumer_warpgroups == 3, "pingpong skips");
static_assert(!fwd_tile(64).group_sight || fwd_tile(64).consumer_warpgroups == 3, "pingpong skips");
static_assert(bwd_tile(64).dq_warps >= 1 && bwd_tile(64).dq_warps <= 3, "three warps besides the producer");
static_assert(bwd_tile(128).dq_warps >= 1 && bwd_tile(128).dq_warps <= 3, "three warps besides the producer");
int main() { return 0; }
"""


def test_register_splits_fit(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "fit.cpp"
    src.write_text(PROGRAM)
    run = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-I", CSRC, str(src)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
