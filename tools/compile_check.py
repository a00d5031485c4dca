"""Compile one kernel instantiation here, without a GPU, and report what ptxas says of each of its
kernels: registers, spills, whether wgmma is serialised (ptxas advisory C7518), and how many runtime
traps ptxas put in each kernel's SASS (BPT.TRAP, counted with cuobjdump where it is found): version 36's
head dim 128 forward carried 90, guards ptxas added once the producer's loads sat in a lambda, and ran
6-10% slower for them, with no advisory in the ptxas log. Also the functions the compiler left out of
line (counted by their returns, RET.REL): a lambda of the forward's consumers taken out of the head dim
128, C=4 kernel reached its captures and the staged mask columns through generic pointers and ran 12x
slower (version 42's row-sum build, docs/perf_notes.md). And the wgmma that ptxas waits for one at
a time without saying so (WAITED: a full wait after most of a kernel's wgmma, where a batch ends
with one; the Q-in-registers forward tried on version 44, whose spilled Q operands ptxas reloaded
between them).

A serialised wgmma costs a Hopper kernel more than most changes gain: the tried per-warpgroup skip
of the SM90 forward (branch sm90-fwd-wg-skip, docs/perf_notes.md) issued wgmma on a path ptxas took
as divergent, was serialised in every head dim 64 variant and lost 7-41% on the H100. Run this on a
kernel change before spending GPU time on it:

    python scripts/compile_check.py --arch sm90 --kernel fwd --head-dim 64 --dtype bf16
    python scripts/compile_check.py --arch sm90 --kernel bwd_kv --head-dim 128 -D FLASHMASK_SM90_BWD_DQ_WARPS128=1
    python scripts/compile_check.py --arch sm90 --source csrc/common/bwd_dsum.cu

Needs nvcc, the nvidia-cutlass wheel and a torch with CUDA headers (the CUDA build of torch compiles
without a GPU) in the Python that runs it. It compiles with the C++ standard that torch's extension
builder uses: C++20 for torch 2.14, whose headers need it, where torch 2.11 builds with C++17; code
that only C++20 takes (a lambda in `decltype`) passes here and fails to build there. Exits 1 when a
kernel has wgmma serialised or waited singly, traps or (an attention kernel) out-of-line functions,
or spills with --fail-on-spills: some head dim 64 forward variants on main spill a few bytes.
"""
import argparse
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(HERE, "csrc")
sys.path.insert(0, CSRC)
import instantiations as inst  # noqa: E402  (the one list of kernels, csrc/instantiations.py)


def parse_ptxas(log: str) -> Dict[str, dict]:
    """Per kernel (mangled name, in the order compiled): registers, spill bytes, serialised wgmma."""
    kernels: Dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = kernels.setdefault(m.group(1), dict(registers=None, spill_stores=0, spill_loads=0,
                                                          wgmma_serialized=False))
            continue
        m = re.search(r"\(C7518\).*in the function '([^']+)'", line)
        if m:  # ptxas may print it before the function's own lines
            kernels.setdefault(m.group(1), dict(registers=None, spill_stores=0, spill_loads=0,
                                                wgmma_serialized=False))["wgmma_serialized"] = True
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current is not None:
            current["spill_stores"], current["spill_loads"] = int(m.group(1)), int(m.group(2))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            current["registers"] = int(m.group(1))
    return kernels


def count_per_kernel(sass: str, instruction: str) -> Dict[str, int]:
    """Per kernel (mangled name) in `cuobjdump -sass` output: how many of its instructions are
    `instruction` (BPT.TRAP: runtime traps; RET.REL: returns, which only a function the compiler left
    out of line has; a CALL.REL to the next instruction, with no return, is ptxas's own reconvergence
    idiom around shuffles)."""
    counts: Dict[str, int] = {}
    current = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = m.group(1)
            counts.setdefault(current, 0)
        elif current is not None and instruction in line:
            counts[current] += 1
    return counts


def waited_wgmma(sass: str) -> Dict[str, Tuple[int, int]]:
    """Per kernel (mangled name) in `cuobjdump -sass` output: (wgmma instructions that a full wait,
    `WARPGROUP.DEPBAR.LE gsb0, 0x0`, follows before the next one, all its wgmma instructions). A
    batch of wgmma ends with one wait; where ptxas has to reload a register operand between them it
    waits after each one instead, with no advisory: the head dim 64 forward with Q in registers
    (tried on version 44, docs/perf_notes.md) spilled Q and waited after all 24 of its wgmma, where
    main waits after 2."""
    counts: Dict[str, Tuple[int, int]] = {}
    current, pending = None, False
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current, pending = m.group(1), False
            counts[current] = (0, 0)
        elif current is None:
            continue
        elif "HGMMA" in line:
            waited, total = counts[current]
            counts[current], pending = (waited, total + 1), True
        elif "WARPGROUP.DEPBAR.LE" in line:
            if pending and re.search(r"gsb0, 0x0\b", line):
                waited, total = counts[current]
                counts[current] = (waited + 1, total)
            pending = False
    return counts


def wgmma_waited_singly(waited: int, total: int) -> bool:
    """Whether most of a kernel's wgmma are each waited for on their own (waited_wgmma)."""
    return total > 0 and 2 * waited > total


def sass_checks(obj: str) -> Tuple[Dict[str, int], Dict[str, int], Dict[str, Tuple[int, int]]]:
    """Per kernel of an object file: its traps and its out-of-line functions' returns
    (count_per_kernel) and its waited wgmma (waited_wgmma); ({}, {}, {}) where no cuobjdump is found."""
    tool = shutil.which("cuobjdump")
    if tool is None:
        return {}, {}, {}
    run = subprocess.run([tool, "-sass", obj], capture_output=True, text=True)
    if run.returncode != 0:
        return {}, {}, {}
    sass = run.stdout
    return count_per_kernel(sass, "BPT.TRAP"), count_per_kernel(sass, "RET.REL"), waited_wgmma(sass)


def cxx_standard() -> str:
    """The C++ standard torch's extension builder passes nvcc (its headers need it)."""
    import torch.utils.cpp_extension as cpp
    with open(cpp.__file__) as f:
        found = re.findall(r"-std=c\+\+(\d+)", f.read())
    return f"-std=c++{max(found, key=int)}" if found else "-std=c++17"


def nvcc_command(unit: str, out: str, arch: str, includes: List[str], defines: List[str], flags,
                 std: str = "-std=c++17") -> List[str]:
    target = "90a" if arch == "sm90" else "80"
    cmd = ["nvcc", *flags, std, "-gencode", f"arch=compute_{target},code=sm_{target}", "-Xptxas", "-v"]
    cmd += [f"-I{d}" for d in includes] + [f"-D{d}" for d in defines]
    return cmd + ["-c", unit, "-o", out]


def _demangle(names: List[str]) -> List[str]:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm90", choices=["sm80", "sm90"])
    parser.add_argument("--kernel", default="fwd", help="fwd, bwd_kv or bwd_dq (csrc/instantiations.py KERNELS)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=["fp16", "bf16"])
    parser.add_argument("-D", dest="defines", action="append", default=[], help="a macro, e.g. FLASHMASK_SM90_FWD_WG64=2")
    parser.add_argument("--keep", default=None, help="write the object file here (for cuobjdump -sass)")
    parser.add_argument("--fail-on-spills", action="store_true")
    parser.add_argument("--source", default=None,
                        help="compile this file instead of an instantiation (e.g. csrc/common/bwd_dsum.cu)")
    args = parser.parse_args()

    if args.source is not None and not os.path.isfile(args.source):
        parser.error(f"--source {args.source!r}: no such file")
    if args.source is None and args.kernel not in inst.KERNELS[args.arch]:
        parser.error(f"{args.arch} has no kernel {args.kernel!r}: {sorted(inst.KERNELS[args.arch])}")
    try:
        import torch.utils.cpp_extension as cpp
        spec = importlib.util.find_spec("cutlass_library")
    except ImportError as e:
        print(f"needs torch (a CUDA build) and nvidia-cutlass: {e}", file=sys.stderr)
        return 2
    if spec is None:
        print("needs the nvidia-cutlass wheel (pip install nvidia-cutlass==4.2.0.0)", file=sys.stderr)
        return 2
    cutlass = os.path.join(list(spec.submodule_search_locations)[0], "source", "include")
    with tempfile.TemporaryDirectory() as tmp:
        unit = os.path.abspath(args.source) if args.source else \
            inst.generate(tmp, [inst.Instantiation(args.arch, args.kernel, args.head_dim, args.dtype)])[0]
        includes = [CSRC, tmp, cutlass, *cpp.include_paths(device_type="cuda"), sysconfig.get_paths()["include"]]
        # A pip-installed CUDA torch brings the CUDA library headers (cusparse.h, ...) in nvidia/*/include.
        nvidia = importlib.util.find_spec("nvidia")
        for root in (nvidia.submodule_search_locations if nvidia else []):
            includes += sorted(glob.glob(os.path.join(root, "*", "include")))
        out = args.keep or os.path.join(tmp, "unit.o")
        cmd = nvcc_command(unit, out, args.arch, includes, args.defines, inst.NVCC_FLAGS, cxx_standard())
        print(f"compiling {os.path.basename(unit)} {' '.join('-D' + d for d in args.defines)}", flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True)
        traps, outlined, waits = sass_checks(out) if run.returncode == 0 else ({}, {}, {})
    if run.returncode != 0:
        print(run.stderr[:3000], file=sys.stderr)  # the first errors explain the rest
        return run.returncode
    kernels = parse_ptxas(run.stdout + run.stderr)
    names = _demangle(list(kernels))
    bad = False
    # calls: returns of functions left out of line
    print(f"{'registers':>9s} {'spill st/ld':>12s} {'wgmma':>10s} {'traps':>5s} {'calls':>5s}  kernel")
    for (mangled, k), name in zip(kernels.items(), names):
        spills = k["spill_stores"] + k["spill_loads"]
        n_traps, n_calls = traps.get(mangled), outlined.get(mangled)
        # The hand-written row kernels (--source) call ptxas's 64-bit integer division routines.
        calls_fail = bool(n_calls) and args.source is None
        singly = wgmma_waited_singly(*waits.get(mangled, (0, 0)))
        bad |= k["wgmma_serialized"] or singly or (spills > 0 and args.fail_on_spills) or bool(n_traps) or calls_fail
        wgmma = "SERIALIZED" if k["wgmma_serialized"] else "WAITED" if singly else "ok"
        print(f"{k['registers'] or '-':>9} {k['spill_stores']:>5d}/{k['spill_loads']:<6d} "
              f"{wgmma:>10s} {'-' if n_traps is None else n_traps:>5} "
              f"{'-' if n_calls is None else n_calls:>5}  {name[:160]}")
    if not traps:
        print("(no cuobjdump on PATH: traps and calls not counted)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
