"""Build flashmask: the pure-Python library always, the CUDA extension ``flashmask._C`` when wanted.

Environment switches:
  FLASHMASK_BUILD_CUDA  auto (default: build when torch has CUDA and nvcc is found), 1 (force), 0 (skip)
  FLASHMASK_HEAD_DIMS   head dims to instantiate, e.g. "128" or "64,128" (default: all); an unequal
                        (head dim, value head dim) pair comes with its q/k head dim: "192" builds
                        (192, 192) and (192, 128)
  FLASHMASK_DTYPES      "fp16", "bf16" or both (default: both)
  FLASHMASK_ARCHS       CUDA archs, e.g. "90" or "80;90" (default: "80;90"); "90" also builds the
                        SM90 (wgmma/TMA) kernels, compiled for sm_90a. With an older arch next to
                        "90", the SM80 backward at the head dims the SM90 backward serves is compiled
                        for the older ones only (a shorter build); "90" alone keeps it for sm_90
  FLASHMASK_PTXAS_VERBOSE  set: ptxas reports registers, spills and serialised wgmma (C7518) per kernel
The instantiations themselves are listed once, in csrc/instantiations.py, which writes their
translation units under build/generated/.
CuTe/CUTLASS headers come from the nvidia-cutlass wheel (`pip install nvidia-cutlass`), or from
CUTLASS_INCLUDE_DIR.
"""
import glob
import importlib.util
import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATED = os.path.join("build", "generated")


def _instantiations_module():
    spec = importlib.util.spec_from_file_location("flashmask_instantiations",
                                                  os.path.join(HERE, "csrc", "instantiations.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env_list(name, default, cast=str):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return list(default)
    return [cast(x) for x in re.split(r"[,; ]+", raw) if x]


def _want_cuda():
    mode = os.environ.get("FLASHMASK_BUILD_CUDA", "auto").lower()
    if mode in ("0", "false", "no", "off"):
        return False
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        if mode in ("1", "true", "yes", "on"):
            raise RuntimeError("FLASHMASK_BUILD_CUDA=1 needs torch installed first (pip install --no-build-isolation)")
        return False
    ok = torch.version.cuda is not None and CUDA_HOME is not None
    if mode in ("1", "true", "yes", "on") and not ok:
        raise RuntimeError(f"FLASHMASK_BUILD_CUDA=1 but torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME}")
    return ok


def _cutlass_include():
    if os.environ.get("CUTLASS_INCLUDE_DIR"):
        return os.environ["CUTLASS_INCLUDE_DIR"]
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the CUDA build needs the CuTe/CUTLASS headers: pip install nvidia-cutlass==4.2.0.0 "
                           "(or set CUTLASS_INCLUDE_DIR)")
    inc = os.path.join(list(spec.submodule_search_locations)[0], "source", "include")
    if not os.path.exists(os.path.join(inc, "cute", "tensor.hpp")):
        raise RuntimeError(f"no cute/tensor.hpp under {inc}: is nvidia-cutlass complete?")
    return inc


def _cuda_extension():
    from torch.utils.cpp_extension import CUDAExtension

    inst = _instantiations_module()
    head_dims = _env_list("FLASHMASK_HEAD_DIMS", inst.HEAD_DIMS, int)
    dtypes = _env_list("FLASHMASK_DTYPES", inst.DTYPES)
    archs = _env_list("FLASHMASK_ARCHS", ("80", "90"))
    families = inst.arch_families(archs)
    try:
        selected = inst.instantiations(head_dims, dtypes, families)
    except ValueError as e:
        raise RuntimeError(str(e)) from None
    # One translation unit per (architecture, kernel, head dim, value head dim, dtype) so that ninja
    # compiles them in parallel, plus the hand-written ones (binding, mask preprocessing, row kernels).
    sources = sorted(glob.glob(os.path.join("csrc", "*", "*.cu")) + glob.glob(os.path.join("csrc", "*", "*.cpp")))
    # The archs decide which SM80 backward units leave their sm_90 code out (instantiations.skips_sm90).
    sources += [os.path.relpath(p, HERE) for p in inst.generate(os.path.join(HERE, GENERATED), selected, archs)]
    gencode = []
    for target in inst.gencode_targets(archs):  # "90" -> "90a": wgmma and setmaxnreg need it
        gencode += ["-gencode", f"arch=compute_{target},code=sm_{target}"]
    nvcc = list(inst.NVCC_FLAGS) + ["--threads", "2"] + gencode
    if os.environ.get("FLASHMASK_PTXAS_VERBOSE"):
        nvcc += ["-Xptxas", "-v"]
    return CUDAExtension(
        name="flashmask._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "csrc"), os.path.join(HERE, GENERATED), _cutlass_include()],
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc},
    )


ext_modules, cmdclass = [], {}
if _want_cuda():
    from torch.utils.cpp_extension import BuildExtension

    ext_modules = [_cuda_extension()]
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(
    name="flashmask",
    version="0.1.0",
    description="Exact attention with FlashMask column-interval masks at FlashAttention speed",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["flashmask", "flashmask.*", "masks", "masks.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "plot": ["matplotlib"],
        "hf": ["transformers>=4.53", "datasets", "tqdm"],
        "cuda": ["nvidia-cutlass==4.2.0.0", "ninja"],
        "dev": ["pytest", "hypothesis", "matplotlib", "einops", "transformers>=4.53", "datasets", "tqdm",
                "ruff==0.17.6", "clang-format==23.1.5", "pre-commit"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
