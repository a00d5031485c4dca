"""The kernel choice of csrc/api/registry.cpp on the CPU: the registry compiled with a C++ compiler
and torch's c10 against the table csrc/instantiations.py generates for a build, the kernels stubbed.

A build for sm_80 and sm_90 (the default) leaves the SM80 kernels' sm_90 code out at the head dims
the SM90 kernels serve (instantiations.skips_sm90): on compute capability 9.0 a call forced onto sm80
there must go to the SM90 kernels, never to the empty SM80 kernels nor to a larger SM80 head dim; a
build for sm_90 alone keeps them; and no call that names no family changes its kernels.
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
#include <string>
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
        std::printf("device_archs %%d %%d", cc, d);
        for (int64_t a : device_archs(d, "bfloat16", cc)) std::printf(" %%d", int(a));
        std::printf("\n");
    }
    for (int cc : {75, 80, 86, 89, 90, 100, 120}) {
        std::printf("code %%d %%d", cc, int(has_code_for(cc)));
        try {
            std::printf(" %%d\n", select_kernels(64, 64, DType::bf16, cc, 0, Slot::fwd).kernels->arch);
        } catch (const std::exception& e) {
            const std::string what = e.what();
            std::printf(" error %%s\n", what.substr(0, what.find('\n')).c_str());
        }
    }
    for (const std::string& t : cuda_targets()) std::printf("target %%s\n", t.c_str());
}
"""


def _select_table(tmp_path, archs):
    """{(cc, forced arch, d, dv, slot): (family, head dim) or None}, {(cc, d): backward families} and
    {cc: (whether the build has code for it, the family or error of a head dim 64 forward there)}
    with the build's device code targets under "targets", of a build for the CUDA archs ``archs``
    (every head dim and dtype)."""
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
    select, backward, code = {}, {}, {"targets": []}
    for line in run.stdout.splitlines():
        m = re.fullmatch(r"select (\d+) (\d+) (\d+) (\d+) (\w+) (?:(\d+) (\d+)|error)", line)
        if m:
            cc, arch, d, dv = map(int, m.groups()[:4])
            select[(cc, arch, d, dv, m.group(5))] = None if m.group(6) is None else (int(m.group(6)), int(m.group(7)))
        elif line.startswith("code "):
            _, cc, has, fwd = line.split(" ", 3)
            code[int(cc)] = (bool(int(has)), fwd)
        elif line.startswith("target "):
            code["targets"].append(line.split()[1])
        else:
            cc, d, *families = map(int, line.split()[1:])
            backward[(cc, d)] = families
    return select, backward, code


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("registry")
    return {archs: _select_table(tmp, list(archs)) for archs in (("80", "90"), ("90",))}


def test_forced_sm80_goes_to_sm90_where_its_sm90_code_is_left_out(tables):
    select, backward, _ = tables[("80", "90")]
    for d, dv in PAIRS:
        # The smallest SM90 pair holding (d, dv): (160, 128) runs on (192, 128).
        sm90_dims = min(h for h in (64, 96, 128, 192, 256) if h >= d)
        for slot in SLOTS:
            assert select[(90, 80, d, dv, slot)] == (90, sm90_dims), (d, dv, slot)
        # On an A100 the forced family is the one that runs.
        assert select[(80, 80, d, dv, "fwd")][0] == 80
    assert backward[(90, 128)] == [90] and backward[(90, 32)] == [] and backward[(90, 192)] == [90]
    assert backward[(80, 128)] == [80] and backward[(80, 32)] == [80]


def test_a_build_for_sm90_alone_keeps_the_sm80_kernels(tables):
    select, backward, _ = tables[("90",)]
    on_ampere = tables[("80", "90")][0]
    for d, dv in PAIRS:
        for slot in SLOTS:
            # Forced onto sm80 on Hopper: the SM80 kernels an A100 runs in the default build.
            assert select[(90, 80, d, dv, slot)] == on_ampere[(80, 80, d, dv, slot)], (d, dv, slot)
            assert select[(90, 80, d, dv, slot)][0] == 80
    assert backward[(90, 128)] == [80, 90] and backward[(90, 32)] == [80]


def test_the_trim_changes_no_call_that_names_no_family(tables):
    """Without a forced family, and with sm90 forced, both builds choose the same kernels on compute
    capability 9.0; on 8.0 the build for sm_90 alone has no code and chooses nothing."""
    trimmed, full = tables[("80", "90")][0], tables[("90",)][0]
    assert trimmed.keys() == full.keys()
    for key in trimmed:
        cc, arch = key[:2]
        if cc == 80:
            assert full[key] is None and (trimmed[key] is not None or key[-1] != "fwd"), key
        elif arch != 80:
            assert trimmed[key] == full[key], key
    # On Hopper every backward is the SM90 one.
    for d, dv in PAIRS:
        assert trimmed[(90, 0, d, dv, "bwd")][0] == 90, (d, dv)


def test_a_gpu_the_build_has_no_code_for_gets_no_kernel(tables):
    """sm_80 code runs on every 8.x GPU, sm_90a code on 9.0 alone; elsewhere (Turing, Blackwell, or
    an A100 under a build for sm_90 alone) the registry chooses nothing and says why."""
    expected = {("80", "90"): {75: False, 80: True, 86: True, 89: True, 90: True, 100: False, 120: False},
                ("90",): {75: False, 80: False, 86: False, 89: False, 90: True, 100: False, 120: False}}
    for archs, has in expected.items():
        code = tables[archs][2]
        assert code["targets"] == (["sm_80", "sm_90a"] if archs == ("80", "90") else ["sm_90a"])
        for cc, ok in has.items():
            assert code[cc][0] == ok, (archs, cc)
            if ok:
                assert code[cc][1] == ("90" if cc == 90 else "80"), (archs, cc)
            else:
                assert code[cc][1].startswith(f"error flashmask: this build has no device code for compute "
                                              f"capability {cc // 10}.{cc % 10} (it carries "
                                              f"{', '.join(code['targets'])})"), (archs, cc, code[cc])
