"""Compile one kernel instantiation without a GPU and report what ptxas says of each kernel, with
the SASS checks for what slows a kernel down without any error:

- registers and spill bytes;
- wgmma serialised (ptxas advisory C7518): costs a Hopper kernel more than most changes gain;
- wgmma waited for one at a time (WAITED; no advisory): ptxas reloads a register operand between them;
- runtime traps (BPT.TRAP) and functions left out of line (RET.REL): guards and calls ptxas adds
  silently, each seen to make a kernel several times slower;
- where the spills are: local-memory instructions before / after the first setmaxnreg.dec, i.e. in
  the consumer warpgroups' reach or in the low-register producer warps' code.

    python -m tools.compile_check --arch sm90 --kernel fwd --head-dim 64 --dtype bf16
    python -m tools.compile_check --arch sm80 --kernel bwd_kv --head-dim 192 --head-dim-v 128
    python -m tools.compile_check --arch sm80 --kernel bwd_kv --head-dim 128 --target 90a
    python -m tools.compile_check --arch sm90 --source csrc/common/bwd_dsum.cu
    python -m tools.compile_check --sass flashmask/_C*.so
    python -m tools.compile_check --same-code before.o after.o

An instantiation is generated as a build for ``--archs`` (FLASHMASK_ARCHS, default "80;90") generates
it and compiled for ``--target`` (default: its family's own arch, 80 or 90a): an SM80 unit
compiled for 90a shows the sm_90 code that build keeps (empty kernels where csrc/instantiations.py
skips_sm90 leaves it out).
Compiling needs nvcc, the nvidia-cutlass wheel and a CUDA build of torch; it uses the C++ standard
torch's extension builder uses, so that code the build would refuse fails here too.
--sass checks an object file or a built extension instead (needs cuobjdump only). --same-code says
whether two object files (--keep) or extensions hold the same machine code for each kernel, read
from their embedded cubins (no CUDA tools needed): the check for a change meant to leave the
kernels as they were, whose line tables (paths, line numbers) differ anyway. Exits 1 when a
kernel has wgmma serialised or waited singly, traps or (an attention kernel) out-of-line functions,
or spills with --fail-on-spills.
"""
import argparse
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(HERE, "csrc")


def _instantiations_module():
    """csrc/instantiations.py, the one list of kernels (loaded by path, as setup.py does)."""
    spec = importlib.util.spec_from_file_location("flashmask_instantiations", os.path.join(CSRC, "instantiations.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


inst = _instantiations_module()


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


def sass_functions(sass: str) -> Dict[str, List[str]]:
    """`cuobjdump -sass` output split into its functions: mangled name -> its lines."""
    functions: Dict[str, List[str]] = {}
    current = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = functions.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
    return functions


def count_per_kernel(sass: str, instruction: str) -> Dict[str, int]:
    """Per kernel (mangled name) in `cuobjdump -sass` output: how many of its instructions are
    `instruction` (BPT.TRAP: runtime traps; RET.REL: returns, which only a function the compiler left
    out of line has; a CALL.REL to the next instruction, with no return, is ptxas's own reconvergence
    idiom around shuffles)."""
    return {name: sum(instruction in line for line in lines) for name, lines in sass_functions(sass).items()}


def waited_wgmma(sass: str) -> Dict[str, Tuple[int, int]]:
    """Per kernel (mangled name) in `cuobjdump -sass` output: (wgmma instructions that a full wait,
    `WARPGROUP.DEPBAR.LE gsb0, 0x0`, follows before the next one, all its wgmma instructions). A
    batch of wgmma ends with one wait; where ptxas has to reload a register operand between them it
    waits after each one instead, with no advisory."""
    counts: Dict[str, Tuple[int, int]] = {}
    for name, lines in sass_functions(sass).items():
        waited = total = 0
        pending = False
        for line in lines:
            if "HGMMA" in line:
                total, pending = total + 1, True
            elif "WARPGROUP.DEPBAR.LE" in line:
                waited += pending and bool(re.search(r"gsb0, 0x0\b", line))
                pending = False
        counts[name] = (waited, total)
    return counts


def local_memory_by_role(sass: str) -> Dict[str, Tuple[int, int]]:
    """Per kernel (mangled name) in `cuobjdump -sass` output: its local-memory loads and stores
    (spills) before and after its first `USETMAXREG.DEALLOC`. A warp-specialised kernel lays out its
    setup and its consumer warpgroups' code (which raise their registers) first and the code of the
    warps that give registers back (producer, dQ writers) after that instruction, so the pair tells
    spills in the consumers' reach from spills of the low-register warps. A kernel without
    `setmaxnreg` counts everything first."""
    counts: Dict[str, Tuple[int, int]] = {}
    for name, lines in sass_functions(sass).items():
        before = after = 0
        dealloc = False
        for line in lines:
            if "USETMAXREG.DEALLOC" in line:
                dealloc = True
            elif re.search(r"\b(STL|LDL)\b", line):
                before, after = (before, after + 1) if dealloc else (before + 1, after)
        counts[name] = (before, after)
    return counts


def wgmma_waited_singly(waited: int, total: int) -> bool:
    """Whether most of a kernel's wgmma are each waited for on their own (waited_wgmma)."""
    return total > 0 and 2 * waited > total


def sass_checks(obj: str) -> Tuple[Dict[str, int], Dict[str, int], Dict[str, Tuple[int, int]],
                                   Dict[str, Tuple[int, int]]]:
    """Per kernel of an object file: its traps and its out-of-line functions' returns
    (count_per_kernel), its waited wgmma (waited_wgmma) and its local-memory instructions by warp role
    (local_memory_by_role); ({}, {}, {}, {}) where no cuobjdump is found."""
    tool = shutil.which("cuobjdump")
    if tool is None:
        return {}, {}, {}, {}
    run = subprocess.run([tool, "-sass", obj], capture_output=True, text=True)
    if run.returncode != 0:
        return {}, {}, {}, {}
    sass = run.stdout
    return (count_per_kernel(sass, "BPT.TRAP"), count_per_kernel(sass, "RET.REL"), waited_wgmma(sass),
            local_memory_by_role(sass))


def is_attention_kernel(mangled: str) -> bool:
    """Whether a kernel is one of the attention kernels (namespaces flashmask::sm80 and ::sm90); the
    others, the row kernels, call ptxas's 64-bit integer division routines out of line."""
    return "4sm80" in mangled or "4sm90" in mangled


def sass_report(path: str) -> int:
    """The kernels of an object file or built extension with runtime traps, out-of-line functions (an
    attention kernel) or wgmma waited for one at a time: one line each and a total; 1 if any."""
    if shutil.which("cuobjdump") is None:
        print("--sass needs cuobjdump (CUDA toolkit) on PATH", file=sys.stderr)
        return 2
    traps, outlined, waits, _ = sass_checks(path)
    if not traps:
        print(f"{path}: no kernels in cuobjdump -sass", file=sys.stderr)
        return 2
    found = []  # (check, what it found, mangled name)
    for mangled in traps:
        waited, total = waits.get(mangled, (0, 0))
        if traps[mangled]:
            found.append(("traps", f"{traps[mangled]} traps", mangled))
        if outlined.get(mangled) and is_attention_kernel(mangled):
            found.append(("calls", f"{outlined[mangled]} calls", mangled))
        if wgmma_waited_singly(waited, total):
            found.append(("waited", f"WAITED {waited}/{total}", mangled))
    for (_, what, _), name in zip(found, _demangle([m for *_, m in found])):
        print(f"{what:>14s}  {name[:160]}")
    count = {check: sum(f[0] == check for f in found) for check in ("traps", "calls", "waited")}
    print(f"{len(traps)} kernels: {count['traps']} with runtime traps, {count['calls']} attention kernels with "
          f"out-of-line functions, {count['waited']} waiting for each wgmma on its own")
    return 1 if found else 0


EM_CUDA = 190  # the e_machine of a cubin


def kernel_code(path: str) -> Dict[str, str]:
    """Digest of each kernel's machine code (a cubin's ``.text.<mangled name>`` section) in the
    uncompressed cubins embedded in an object file or extension; a name met again (another arch's
    cubin) is keyed ``name#2`` and so on."""
    with open(path, "rb") as f:
        data = f.read()

    def word(at: int, size: int) -> int:
        return int.from_bytes(data[at:at + size], "little")

    code: Dict[str, str] = {}
    elf = data.find(b"\x7fELF")
    while elf >= 0:
        # ELF64 little-endian header: e_machine at 18, e_shoff at 40, e_shentsize/e_shnum/e_shstrndx at 58
        if data[elf + 4:elf + 5] == b"\x02" and word(elf + 18, 2) == EM_CUDA:
            shoff, entsize, count, strndx = word(elf + 40, 8), word(elf + 58, 2), word(elf + 60, 2), word(elf + 62, 2)
            # (name offset, section offset, size) of each section header
            headers = [(word(h, 4), word(h + 24, 8), word(h + 32, 8))
                       for h in (elf + shoff + i * entsize for i in range(count))]
            names = elf + headers[strndx][1]
            for name_at, offset, size in headers:
                start = names + name_at
                name = data[start:data.index(b"\0", start)].decode()
                if name.startswith(".text."):
                    kernel = key = name[len(".text."):]
                    n = 2
                    while key in code:
                        key, n = f"{kernel}#{n}", n + 1
                    code[key] = hashlib.sha256(data[elf + offset:elf + offset + size]).hexdigest()
        elf = data.find(b"\x7fELF", elf + 1)
    return code


def same_code_report(a: str, b: str) -> int:
    """Lists the kernels whose machine code differs between two files; 0 when every kernel matches."""
    code_a, code_b = kernel_code(a), kernel_code(b)
    if not code_a or not code_b:
        print(f"{a if not code_a else b}: no uncompressed cubin found", file=sys.stderr)
        return 2
    differ = sorted(k for k in set(code_a) | set(code_b) if code_a.get(k) != code_b.get(k))
    for k, name in zip(differ, _demangle([k.split("#")[0] for k in differ])):
        where = "differs" if k in code_a and k in code_b else f"only in {a if k in code_a else b}"
        print(f"{where:>10s}  {name[:160]}")
    print(f"{len(code_a)} / {len(code_b)} kernels, {len(differ)} with other machine code")
    return 1 if differ else 0


def cxx_standard() -> str:
    """The C++ standard torch's extension builder passes nvcc (its headers need it)."""
    import torch.utils.cpp_extension as cpp
    with open(cpp.__file__) as f:
        found = re.findall(r"-std=c\+\+(\d+)", f.read())
    return f"-std=c++{max(found, key=int)}" if found else "-std=c++17"


def nvcc_command(unit: str, out: str, arch: str, includes: List[str], defines: List[str], flags,
                 std: str = "-std=c++17", target: Optional[str] = None) -> List[str]:
    """``target``: the CUDA arch to compile for ("80", "90a", ...; None: the family's own)."""
    target = target or ("90a" if arch == "sm90" else "80")
    cmd = ["nvcc", *flags, std, "-gencode", f"arch=compute_{target},code=sm_{target}", "-Xptxas", "-v"]
    cmd += [f"-I{d}" for d in includes] + [f"-D{d}" for d in defines]
    return cmd + ["-c", unit, "-o", out]


def generated_unit(out_dir: str, instance, archs: List[str]) -> str:
    """The translation unit of ``instance`` as a build for the CUDA archs ``archs`` (every head dim
    and dtype) writes it under out_dir; an instance that build leaves out is written as well."""
    selected = inst.instantiations(archs=inst.arch_families(archs))
    if instance not in selected:
        selected.append(instance)
    paths = inst.generate(out_dir, selected, archs)
    return paths[selected.index(instance)]


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
    parser.add_argument("--head-dim", type=int, default=128, help="of q and k")
    parser.add_argument("--head-dim-v", type=int, default=None,
                        help="of v and the output (default: the head dim; see HEAD_DIM_PAIRS)")
    parser.add_argument("--dtype", default="bf16", choices=["fp16", "bf16"])
    parser.add_argument("--target", default=None, help="CUDA arch to compile for, e.g. 80, 90a (default: the "
                        "family's own: 80 for sm80, 90a for sm90)")
    parser.add_argument("--archs", default="80;90",
                        help="the build's FLASHMASK_ARCHS, which the generated unit follows (default: 80;90)")
    parser.add_argument("-D", dest="defines", action="append", default=[],
                        help="pass -DNAME or -DNAME=VALUE to nvcc (repeatable)")
    parser.add_argument("--keep", default=None, help="write the object file here (for cuobjdump -sass)")
    parser.add_argument("--fail-on-spills", action="store_true")
    parser.add_argument("--source", default=None,
                        help="compile this file instead of an instantiation (e.g. csrc/common/bwd_dsum.cu)")
    parser.add_argument("--sass", default=None, metavar="FILE",
                        help="check the SASS of this object file or built extension instead of compiling")
    parser.add_argument("--same-code", nargs=2, default=None, metavar=("A", "B"),
                        help="compare the machine code of each kernel in two object files or extensions")
    args = parser.parse_args()

    if args.same_code is not None:
        for f in args.same_code:
            if not os.path.isfile(f):
                parser.error(f"--same-code {f!r}: no such file")
        return same_code_report(*args.same_code)
    if args.sass is not None:
        if not os.path.isfile(args.sass):
            parser.error(f"--sass {args.sass!r}: no such file")
        return sass_report(args.sass)

    if args.source is not None and not os.path.isfile(args.source):
        parser.error(f"--source {args.source!r}: no such file")
    if args.source is None and args.kernel not in inst.KERNELS[args.arch]:
        parser.error(f"{args.arch} has no kernel {args.kernel!r}: {sorted(inst.KERNELS[args.arch])}")
    if args.target is not None and not re.fullmatch(r"\d+a?", args.target):
        parser.error(f"--target {args.target!r}: expected a CUDA arch such as 80 or 90a")
    archs = [a for a in re.split(r"[,; ]+", args.archs) if a]
    if not archs or not all(re.fullmatch(r"\d+a?", a) for a in archs):
        parser.error(f"--archs {args.archs!r}: expected CUDA archs such as 80;90")
    head_dim_v = args.head_dim if args.head_dim_v is None else args.head_dim_v
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
        unit = os.path.abspath(args.source) if args.source else generated_unit(
            tmp, inst.Instantiation(args.arch, args.kernel, args.head_dim, head_dim_v, args.dtype), archs)
        includes = [CSRC, tmp, cutlass, *cpp.include_paths(device_type="cuda"), sysconfig.get_paths()["include"]]
        # A pip-installed CUDA torch brings the CUDA library headers (cusparse.h, ...) in nvidia/*/include.
        nvidia = importlib.util.find_spec("nvidia")
        for root in (nvidia.submodule_search_locations if nvidia else []):
            includes += sorted(glob.glob(os.path.join(root, "*", "include")))
        out = args.keep or os.path.join(tmp, "unit.o")
        cmd = nvcc_command(unit, out, args.arch, includes, args.defines, inst.NVCC_FLAGS, cxx_standard(), args.target)
        print(f"compiling {os.path.basename(unit)} for {cmd[cmd.index('-gencode') + 1]} "
              f"{' '.join('-D' + d for d in args.defines)}", flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True)
        traps, outlined, waits, local = sass_checks(out) if run.returncode == 0 else ({}, {}, {}, {})
    if run.returncode != 0:
        print(run.stderr[:3000], file=sys.stderr)  # the first errors explain the rest
        return run.returncode
    kernels = parse_ptxas(run.stdout + run.stderr)
    names = _demangle(list(kernels))
    bad = False
    # calls: returns of functions left out of line; local a/b: local-memory instructions before / after
    # the first setmaxnreg.dec (consumers and setup / the warps that give registers back)
    print(f"{'registers':>9s} {'spill st/ld':>12s} {'local a/b':>9s} {'wgmma':>10s} {'traps':>5s} {'calls':>5s}"
          "  kernel")
    for (mangled, k), name in zip(kernels.items(), names):
        spills = k["spill_stores"] + k["spill_loads"]
        n_traps, n_calls = traps.get(mangled), outlined.get(mangled)
        # The hand-written row kernels (--source) call ptxas's 64-bit integer division routines.
        calls_fail = bool(n_calls) and args.source is None
        singly = wgmma_waited_singly(*waits.get(mangled, (0, 0)))
        bad |= k["wgmma_serialized"] or singly or (spills > 0 and args.fail_on_spills) or bool(n_traps) or calls_fail
        wgmma = "SERIALIZED" if k["wgmma_serialized"] else "WAITED" if singly else "ok"
        roles = local.get(mangled)
        roles = "-" if roles is None else f"{roles[0]}/{roles[1]}"
        print(f"{k['registers'] or '-':>9} {k['spill_stores']:>5d}/{k['spill_loads']:<6d} {roles:>9s} "
              f"{wgmma:>10s} {'-' if n_traps is None else n_traps:>5} "
              f"{'-' if n_calls is None else n_calls:>5}  {name[:160]}")
    if not traps:
        print("(no cuobjdump on PATH: traps and calls not counted)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
