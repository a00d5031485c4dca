"""Build flashmask: the pure-Python library always, the CUDA extension ``flashmask._C`` when wanted.

Environment switches:
  FLASHMASK_BUILD_CUDA  auto (default: build when torch has CUDA and nvcc is found), 1 (force), 0 (skip)
  FLASHMASK_HEAD_DIMS   head dims to instantiate, e.g. "128" or "64,128" (default: all)
  FLASHMASK_DTYPES      "fp16", "bf16" or both (default: both)
  FLASHMASK_ARCHS       CUDA archs, e.g. "90" or "80;90" (default: "80;90")
CuTe/CUTLASS headers come from the nvidia-cutlass wheel (`pip install nvidia-cutlass`), or from
CUTLASS_INCLUDE_DIR.
"""
import glob
import importlib.util
import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
ALL_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
ALL_DTYPES = ("fp16", "bf16")


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

    head_dims = _env_list("FLASHMASK_HEAD_DIMS", ALL_HEAD_DIMS, int)
    dtypes = _env_list("FLASHMASK_DTYPES", ALL_DTYPES)
    archs = _env_list("FLASHMASK_ARCHS", ("80", "90"))
    bad = [d for d in head_dims if d not in ALL_HEAD_DIMS] + [t for t in dtypes if t not in ALL_DTYPES]
    if bad:
        raise RuntimeError(f"unknown head dims / dtypes {bad}; choose from {ALL_HEAD_DIMS} and {ALL_DTYPES}")
    # One translation unit per (kernel, head dim, dtype) so that ninja compiles them in parallel.
    sources = sorted(glob.glob(os.path.join("csrc", "*.cu")) + glob.glob(os.path.join("csrc", "*.cpp")))
    for path in sorted(glob.glob(os.path.join("csrc", "instantiations", "*.cu"))):
        m = re.search(r"_hdim(\d+)_(fp16|bf16)", path)
        if m and int(m.group(1)) in head_dims and m.group(2) in dtypes:
            sources.append(path)
    defines = [f"-DFLASHMASK_HDIM{d}" for d in head_dims] + [f"-DFLASHMASK_{t.upper()}" for t in dtypes]
    gencode = []
    for a in archs:
        gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    nvcc = ["-O3", "--use_fast_math", "--expt-relaxed-constexpr", "--expt-extended-lambda",
            "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-lineinfo", "--threads", "2"] + gencode + defines
    if os.environ.get("FLASHMASK_PTXAS_VERBOSE"):
        nvcc += ["-Xptxas", "-v"]
    return CUDAExtension(
        name="flashmask._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "csrc"), _cutlass_include()],
        extra_compile_args={"cxx": ["-O3"] + defines, "nvcc": nvcc},
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
        "hf": ["transformers>=4.53", "datasets"],
        "cuda": ["nvidia-cutlass==4.2.0.0", "ninja"],
        "dev": ["pytest", "hypothesis", "matplotlib", "einops", "transformers>=4.53", "datasets"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
