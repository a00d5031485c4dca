"""The one list of kernel instantiations, and the generator of their translation units.

Every compiled kernel is an (architecture, kernel, head dim, value head dim, dtype) tuple: the head
dim is that of q and k, the value head dim that of v and the output, equal but for the pairs of
``HEAD_DIM_PAIRS``. setup.py selects a subset (``FLASHMASK_HEAD_DIMS``, which takes a pair with its
q/k head dim, ``FLASHMASK_DTYPES``, ``FLASHMASK_ARCHS``) and calls :func:`generate`,
which writes one ``.cu`` file per tuple (so that ninja compiles them in parallel) and
``kernel_registry.inc``, the table the binding dispatches on. Adding a head dim, a pair, a dtype or
an architecture's kernel is one edit here. A build for sm_90 and an older arch compiles the SM80
kernels for the older ones only where the SM90 kernels serve their head dims on sm_90
(:func:`skips_sm90`).

Run as a script to print the full list: ``python csrc/instantiations.py``.
"""
from __future__ import annotations

import os
from typing import Dict, Iterable, List, NamedTuple, Sequence, Tuple

HEAD_DIMS: Tuple[int, ...] = (32, 64, 96, 128, 192, 256)
# Unequal (q/k head dim, value head dim) pairs, besides the equal ones: (192, 128) is DeepSeek's
# multi-head latent attention. An equal head dim's kernels also serve any pair that fits them.
HEAD_DIM_PAIRS: Tuple[Tuple[int, int], ...] = ((192, 128),)
DTYPES: Dict[str, str] = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}


class Kernel(NamedTuple):
    header: str  # the launch header, relative to csrc/
    function: str  # the launch template, called as function<head_dim, head_dim_v, element>(params, stream)
    params: str  # the parameter struct it takes


# Kernels per architecture family. "sm80" (mma.sync, cp.async) also runs on sm_90; "sm90" kernels
# (wgmma, TMA) are compiled for sm_90a only.
KERNELS: Dict[str, Dict[str, Kernel]] = {
    "sm80": {
        "fwd": Kernel("sm80/fwd_launch.h", "sm80::run_fwd", "AttnParams"),
        "bwd_kv": Kernel("sm80/bwd_launch.h", "sm80::run_bwd_kv", "BwdParams"),
        "bwd_dq": Kernel("sm80/bwd_launch.h", "sm80::run_bwd_dq", "BwdParams"),
    },
    "sm90": {
        "fwd": Kernel("sm90/fwd_launch.h", "sm90::run_fwd", "AttnParams"),
        "bwd_kv": Kernel("sm90/bwd_launch.h", "sm90::run_bwd", "BwdParams"),
    },
}
# Head dims per architecture family (a subset of HEAD_DIMS); the binding runs any other head dim on
# the sm80 kernels.
ARCH_HEAD_DIMS: Dict[str, Tuple[int, ...]] = {"sm80": HEAD_DIMS, "sm90": (64, 96, 128, 192, 256)}
# Unequal pairs per architecture family (a subset of HEAD_DIM_PAIRS); a family without one leaves it
# to a family that has it.
ARCH_HEAD_DIM_PAIRS: Dict[str, Tuple[Tuple[int, int], ...]] = {"sm80": HEAD_DIM_PAIRS, "sm90": HEAD_DIM_PAIRS}
# The compute capability (major * 10 + minor) an architecture family needs at least.
ARCH_MIN_CC: Dict[str, int] = {"sm80": 80, "sm90": 90}
# nvcc flags of every translation unit; setup.py adds one -gencode per arch, and
# tools/compile_check.py compiles single units with them to read ptxas's report.
NVCC_FLAGS: Tuple[str, ...] = ("-O3", "--use_fast_math", "--expt-relaxed-constexpr", "--expt-extended-lambda",
                               "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                               "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                               "-lineinfo")
# The registry's kernel slots: a family fills those it has.
SLOTS: Tuple[str, ...] = ("fwd", "bwd_kv", "bwd_dq")


class Instantiation(NamedTuple):
    arch: str
    kernel: str
    head_dim: int  # of q and k
    head_dim_v: int  # of v and the output
    dtype: str

    @property
    def dims(self) -> str:
        """hdim128 for equal head dims, hdim192x128 for a pair."""
        pair = "" if self.head_dim == self.head_dim_v else f"x{self.head_dim_v}"
        return f"hdim{self.head_dim}{pair}"

    @property
    def symbol(self) -> str:
        return f"run_{self.arch}_{self.kernel}_{self.dims}_{self.dtype}"

    @property
    def filename(self) -> str:
        return f"{self.arch}/{self.kernel}_{self.dims}_{self.dtype}.cu"


def arch_head_dim_pairs(arch: str) -> List[Tuple[int, int]]:
    """Every (head dim, value head dim) pair of an architecture family, equal ones first."""
    return [(d, d) for d in ARCH_HEAD_DIMS[arch]] + list(ARCH_HEAD_DIM_PAIRS[arch])


def instantiations(head_dims: Iterable[int] = HEAD_DIMS, dtypes: Iterable[str] = tuple(DTYPES),
                   archs: Iterable[str] = tuple(KERNELS)) -> List[Instantiation]:
    """Every instantiation of the selected head dims, dtypes and architecture families; a pair of
    unequal head dims comes with its q/k head dim."""
    head_dims, dtypes, archs = list(head_dims), list(dtypes), list(archs)
    known = set(HEAD_DIMS) | {d for d, _ in HEAD_DIM_PAIRS}
    bad = ([d for d in head_dims if d not in known] + [t for t in dtypes if t not in DTYPES]
           + [a for a in archs if a not in KERNELS])
    if bad:
        raise ValueError(f"unknown head dims / dtypes / archs {bad}; choose from {tuple(sorted(known))}, "
                         f"{tuple(DTYPES)}, {tuple(KERNELS)}")
    return [Instantiation(a, k, d, dv, t) for a in archs for k in KERNELS[a] for d, dv in arch_head_dim_pairs(a)
            if d in head_dims for t in dtypes]


def _ccs(cuda_archs: Iterable[str]) -> List[int]:
    return [int(a.rstrip("a")) for a in cuda_archs]


def arch_families(cuda_archs: Sequence[str]) -> List[str]:
    """The kernel families worth compiling for these CUDA archs ("80", "90", ...)."""
    ccs = _ccs(cuda_archs)
    return [f for f, cc in ARCH_MIN_CC.items() if any(c >= cc for c in ccs)]


def gencode_targets(cuda_archs: Sequence[str]) -> List[str]:
    """The device code targets of a build for ``cuda_archs``: "90" becomes the arch-specific "90a",
    which wgmma and setmaxnreg need (the SM90 family's kernels)."""
    sm90a = bool(KERNELS["sm90"])
    return [f"{a}a" if a == "90" and sm90a else a for a in (a.rstrip("a") for a in cuda_archs)]


def skips_sm90(inst: Instantiation, cuda_archs: Iterable[str], selected: Sequence[Instantiation]) -> bool:
    """Whether the build (CUDA archs ``cuda_archs``, instantiations ``selected``) leaves inst's
    sm_90 device code empty: an SM80 kernel, in a build for sm_90 and an older arch, whose (head
    dim, value head dim) a selected SM90 kernel of its dtype and direction (forward or backward)
    holds. On sm_90 the registry then always takes that SM90 kernel (the newest family that has a
    pair holding the call's head dims; the SM90 forward has split-KV too), so the SM80 one would
    only lengthen the build. A build for sm_90 alone keeps it: the only way to run the SM80 kernels
    on a Hopper GPU."""
    ccs = _ccs(cuda_archs)
    if inst.arch != "sm80" or 90 not in ccs or min(ccs) >= 90:
        return False
    forward = inst.kernel == "fwd"
    return any(j.arch == "sm90" and (j.kernel == "fwd") == forward and j.dtype == inst.dtype
               and inst.head_dim <= j.head_dim and inst.head_dim_v <= j.head_dim_v for j in selected)


_BANNER = "// Generated by csrc/instantiations.py from its list of instantiations: do not edit.\n"
# Defined by the units of skips_sm90: their kernels compile to an empty body for sm_90.
SKIP_SM90_MACRO = "FLASHMASK_SM80_SKIP_SM90"


def _translation_unit(inst: Instantiation, skip_sm90: bool = False) -> str:
    k = KERNELS[inst.arch][inst.kernel]
    skip = (f"// The SM90 kernels serve these head dims on sm_90: no sm_90 code here.\n#define {SKIP_SM90_MACRO}\n"
            if skip_sm90 else "")
    return (f"{_BANNER}{skip}#include \"{k.header}\"\n\nnamespace flashmask {{\n"
            f"void {inst.symbol}(const {k.params}& p, cudaStream_t stream) {{\n"
            f"    {k.function}<{inst.head_dim}, {inst.head_dim_v}, {DTYPES[inst.dtype]}>(p, stream);\n}}\n"
            "}  // namespace flashmask\n")


def _registry(insts: Sequence[Instantiation], cuda_archs: Sequence[str] = ()) -> str:
    lines = [_BANNER, "// Included by api/registry.cpp inside namespace flashmask.\n"]
    for i in insts:
        lines.append(f"void {i.symbol}(const {KERNELS[i.arch][i.kernel].params}&, cudaStream_t);\n")
    lines.append("\nconst KernelSet kKernelSets[] = {\n")
    groups = sorted({(i.arch, i.head_dim, i.head_dim_v, i.dtype) for i in insts})
    for arch, d, dv, t in groups:
        slots = [f"&{Instantiation(arch, s, d, dv, t).symbol}" if Instantiation(arch, s, d, dv, t) in insts
                 else "nullptr" for s in SLOTS]
        # KernelSet::skips_sm90: whether the set has no sm_90 code (its kernels all skip or none do).
        skips = {skips_sm90(i, cuda_archs, insts) for i in insts
                 if (i.arch, i.head_dim, i.head_dim_v, i.dtype) == (arch, d, dv, t)}
        if len(skips) > 1:
            raise ValueError(f"the {arch} kernels of {(d, dv, t)} would keep sm_90 code for some slots only: "
                             "select the SM90 forward and backward together")
        skip = skips == {True}
        lines.append(f"    {{{ARCH_MIN_CC[arch]}, {d}, {dv}, DType::{t}, {', '.join(slots)}, "
                     f"{'true' if skip else 'false'}}},\n")
    lines.append("    {0, 0, 0, DType::fp16, nullptr, nullptr, nullptr, false},  // sentinel: a build may compile "
                 "nothing\n};\n")
    # CudaTarget: {compute capability, arch-specific (sm_90a code runs on 9.0 alone)}; none listed: any.
    targets = "".join(f"{{{t.rstrip('a')}, {'true' if t.endswith('a') else 'false'}}}, "
                      for t in gencode_targets(cuda_archs))
    lines.append(f"\nconst CudaTarget kCudaTargets[] = {{{targets}{{0, false}}}};  // the build's device code\n")
    return "".join(lines)


def _write_if_changed(path: str, text: str) -> None:
    # Rewriting an unchanged file would make ninja recompile it.
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def generate(out_dir: str, insts: Sequence[Instantiation], cuda_archs: Sequence[str] = ()) -> List[str]:
    """Writes the translation units and kernel_registry.inc under out_dir for a build for the CUDA
    archs ``cuda_archs`` (FLASHMASK_ARCHS; they decide :func:`skips_sm90`); returns the .cu paths."""
    paths = []
    for inst in insts:
        path = os.path.join(out_dir, inst.filename)
        _write_if_changed(path, _translation_unit(inst, skips_sm90(inst, cuda_archs, insts)))
        paths.append(path)
    _write_if_changed(os.path.join(out_dir, "kernel_registry.inc"), _registry(insts, cuda_archs))
    return paths


if __name__ == "__main__":
    for inst in instantiations():
        print(inst.filename)
