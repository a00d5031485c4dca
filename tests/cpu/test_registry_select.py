"""The kernel choice of csrc/api/registry.cpp on the CPU: the registry compiled with a C++ compiler
and torch's c10 against the table csrc/instantiations.py generates for a build, the kernels stubbed.

A build for sm_80 and sm_90 (the default) leaves the SM80 backward's sm_90 code out at the head dims
the SM90 backward serves (instantiations.skips_sm90): on compute capability 9.0 a backward forced onto
sm80 there must go to the SM90 backward, never to the empty SM80 kernels nor to a larger SM80 head
dim; a build for sm_90 alone keeps it; and no call that names no family changes its kernels.
"""
from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from tests.cxx import CSRC, build, instantiations

PAIRS = [(32, 32), (40, 40), (64, 64), (96, 96), (128, 128), (160, 160), (192, 192), (256, 256), (192, 128),
         (96, 64), (160, 128)]
SLOTS = ("fwd", "bwd", "bwd_deterministic")

DRIVER = r"""
#include <cstdio>
#include "api/registry.h"
namespace flashmask {
#include "stubs.inc"
}
using namespace flashmask;
int main() {
    const int pairs[][2] = {%(pairs)s};
    const char* slots[] = {"fwd", "bwd", "bwd_deterministic"};
    for (int cc : {80, 90}) for (int arch : {0, 80, 90}) for (const auto& p : pairs) for (int s = 0; s < 3; ++s) {
        if (arch == 90 && cc != 90) continue;
        try {
            const Selection sel = select_kernels(p[0], p[1], DType::bf16, cc, arch, Slot(s));
            std::printf("select %%d %%d %%d %%d %%s %%d %%d\n", cc, arch, p[0], p[1], slots[s], sel.kernels->arch,
                        sel.kernels->head_dim);
        } catch (const std::exception&) {
            std::printf("select %%d %%d %%d %%d %%s error\n", cc, arch, p[0], p[1], slots[s]);
        }
    }
    for (int cc : {80, 90}) for (int d : {32, 64, 96, 128, 192, 256}) {
        std::printf("backward_archs %%d %%d", cc, d);
        for (int64_t a : backward_archs(d, "bfloat16", cc)) std::printf(" %%d", int(a));
        std::printf("\n");
    }
}
"""


def _select_table(tmp_path, archs):
    """{(cc, forced arch, d, dv, slot): (family, head dim) or None} and {(cc, d): backward families}
    of a build for the CUDA archs ``archs`` (every head dim and dtype)."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    inst = instantiations()
    out = tmp_path / "".join(archs)
    inst.generate(str(out), inst.instantiations(archs=inst.arch_families(archs)), archs)
    registry = (out / "kernel_registry.inc").read_text()
    stubs = [line.replace(", cudaStream_t);", ", cudaStream_t) {}") for line in registry.splitlines()
             if line.startswith("void run_")]
    (out / "stubs.inc").write_text("\n".join(stubs) + "\n")
    (out / "cuda_runtime.h").write_text("typedef struct CUstream_st* cudaStream_t;\n")  # all registry.h needs
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    exe = build(DRIVER % {"pairs": ", ".join(f"{{{d}, {dv}}}" for d, dv in PAIRS)}, out, "driver",
                f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", str(out), "-I",
                os.path.join(os.path.dirname(torch.__file__), "include"), os.path.join(CSRC, "api", "registry.cpp"),
                f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}")
    run = subprocess.run([str(exe)], capture_output=True, text=True, env=dict(os.environ, FLASHMASK_ARCH=""))
    assert run.returncode == 0, run.stderr[-3000:]
    select, backward = {}, {}
    for line in run.stdout.splitlines():
        m = re.fullmatch(r"select (\d+) (\d+) (\d+) (\d+) (\w+) (?:(\d+) (\d+)|error)", line)
        if m:
            cc, arch, d, dv = map(int, m.groups()[:4])
            select[(cc, arch, d, dv, m.group(5))] = None if m.group(6) is None else (int(m.group(6)), int(m.group(7)))
            continue
        cc, d, *families = map(int, line.split()[1:])
        backward[(cc, d)] = families
    return select, backward


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("registry")
    return {archs: _select_table(tmp, list(archs)) for archs in (("80", "90"), ("90",))}


def test_forced_sm80_backward_goes_to_sm90_where_its_sm90_code_is_left_out(tables):
    select, backward = tables[("80", "90")]
    for d, dv in PAIRS:
        # The smallest SM90 pair holding (d, dv): (160, 128) runs on (192, 128).
        sm90_dims = min(h for h in (64, 96, 128, 192, 256) if h >= d)
        for slot in ("bwd", "bwd_deterministic"):
            assert select[(90, 80, d, dv, slot)] == (90, sm90_dims), (d, dv, slot)
        # The forward keeps its sm_90 code: split-KV runs on it only.
        assert select[(90, 80, d, dv, "fwd")] == select[(80, 80, d, dv, "fwd")], (d, dv)
        assert select[(90, 80, d, dv, "fwd")][0] == 80
    assert backward[(90, 128)] == [90] and backward[(90, 32)] == [] and backward[(90, 192)] == [90]
    assert backward[(80, 128)] == [80] and backward[(80, 32)] == [80]


def test_a_build_for_sm90_alone_keeps_the_sm80_backward(tables):
    select, backward = tables[("90",)]
    for d, dv in PAIRS:
        for slot in SLOTS:
            assert select[(90, 80, d, dv, slot)] == select[(80, 80, d, dv, slot)], (d, dv, slot)
            assert select[(90, 80, d, dv, slot)][0] == 80
    assert backward[(90, 128)] == [80, 90] and backward[(90, 32)] == [80]


def test_the_trim_changes_no_call_that_names_no_family(tables):
    """Without a forced family, and with sm90 forced, both builds choose the same kernels; on compute
    capability 8.0 every choice is the same."""
    trimmed, full = tables[("80", "90")][0], tables[("90",)][0]
    assert trimmed.keys() == full.keys()
    for key in trimmed:
        cc, arch = key[:2]
        if cc == 80 or arch != 80:
            assert trimmed[key] == full[key], key
    # On Hopper every backward is the SM90 one.
    for d, dv in PAIRS:
        assert trimmed[(90, 0, d, dv, "bwd")][0] == 90, (d, dv)
