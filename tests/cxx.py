"""Small C++ programs compiled against csrc/ for the CPU tests: the kernels' host-readable logic (mask
intervals, tile choices, the registry, the block walks) run without a GPU."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import ROOT

CSRC = os.path.join(ROOT, "csrc")
TESTS = os.path.join(ROOT, "tests")  # host_device.h: csrc/'s device environment on the host


def compiler() -> str:
    """The C++ compiler: $CXX, else c++ or g++; the calling test is skipped where there is none."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    return cxx


def build(source: str, out_dir, name: str, *flags: str) -> Path:
    """``source`` compiled and linked to ``out_dir/name`` (C++17, -O1, csrc/ on the include path;
    ``flags`` after the source: more sources, libraries, a later -std); a failure fails the test
    with the compiler's message."""
    src, exe = Path(out_dir) / f"{name}.cpp", Path(out_dir) / name
    src.write_text(source)
    run = subprocess.run([compiler(), "-std=c++17", "-O1", "-I", CSRC, "-I", TESTS, str(src), *flags, "-o", str(exe)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return exe


def build_with_host_device(source: str, out_dir, name: str) -> Path:
    """``build`` for a driver that includes host_device.h, whose lockstep warp needs C++20's
    std::barrier and threads."""
    return build(source, out_dir, name, "-std=c++20", "-pthread")


def driver_lines(exe, *args) -> list[str]:
    """The output lines of a driver run with ``args`` and no input (e.g. its table of tiles)."""
    run = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


def check_compiles(source: str, out_dir, name: str) -> None:
    """``source`` compiled without code generation (C++17, csrc/ on the include path), so that its
    static_asserts hold; a failure fails the test with the compiler's message."""
    src = Path(out_dir) / f"{name}.cpp"
    src.write_text(source)
    run = subprocess.run([compiler(), "-std=c++17", "-fsyntax-only", "-I", CSRC, str(src)], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-3000:]


def instantiations():
    """csrc/instantiations.py, the one list of kernel instantiations, as a module."""
    spec = importlib.util.spec_from_file_location("flashmask_instantiations", os.path.join(CSRC, "instantiations.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_on_mask(exe, mask, sq: int, causal: bool, *header) -> list[str]:
    """Runs a driver on ``mask`` ([B, Hm, Sk, C]): stdin gets "slices sq sk c causal" and ``header``,
    then each (batch, mask head) slice's [Sk, C] values; returns its output lines."""
    b, hm, sk, c = mask.shape
    lines = [" ".join(map(str, (b * hm, sq, sk, c, int(causal), *header)))]
    lines += [" ".join(map(str, s.flatten().tolist())) for s in mask.reshape(b * hm, sk, c)]
    run = subprocess.run([str(exe)], input="\n".join(lines), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()
