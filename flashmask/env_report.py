"""What this installation of flashmask can run, for a bug report or a check after the install:
``python -m flashmask``.

The versions of flashmask, torch, CUDA and transformers; the GPUs; whether the CUDA kernels are
built and, if not, why; the head dims and dtypes they were built for; and, on each visible GPU, the
kernel family (sm80 or sm90) that a forward, a backward and a deterministic backward of each
compiled head dim would run on. Its shape on a Hopper GPU with a full build (values illustrative,
abridged)::

    flashmask 0.1.0 at /src/flashmask/flashmask
    torch 2.11.0+cu130 (CUDA 13.0), Python 3.12.3, Linux-6.8-x86_64
    transformers 5.17.0
    GPU 0: NVIDIA H100 80GB HBM3, compute capability 9.0
    CUDA kernels: built (.../flashmask/_C.cpython-312-x86_64-linux-gnu.so)
      dtypes: float16, bfloat16; head dims (q/k, v): 32, 64, 96, 128, (192, 128), 192, 256; device code:
      sm_80, sm_90a

    GPU 0, bfloat16: the kernel family of each call
    | head dims | forward | backward | deterministic backward |
    |---|---|---|---|
    | 64 | sm90 | sm90 | sm90 |
    ...
"""
from __future__ import annotations

import importlib.util
import os
import platform
import sys
from typing import List, Optional, Tuple

import torch

import flashmask
from flashmask import _cuda

# The environment variables the library reads at run time (the build's are setup.py's).
RUNTIME_VARIABLES = ("FLASHMASK_ARCH", "FLASHMASK_MASK_CACHE")
SLOTS = (("fwd", "forward"), ("bwd", "backward"), ("bwd_deterministic", "deterministic backward"))


def _dims(pair: Tuple[int, int]) -> str:
    d, dv = pair
    return str(d) if d == dv else f"({d}, {dv})"


def _transformers_version() -> str:
    if importlib.util.find_spec("transformers") is None:
        return "not installed (the Hugging Face backend needs it)"
    import transformers

    return transformers.__version__


def _family_table(device: int, cc: int, dtype: torch.dtype, pairs: List[Tuple[int, int]]) -> List[str]:
    """Per compiled head-dim pair, the family each slot would run on GPU ``device`` of compute
    capability ``cc`` (or the error the call would raise)."""
    name = str(dtype).replace("torch.", "")
    lines = [f"GPU {device}, {name}: the kernel family of each call",
             "| head dims | " + " | ".join(title for _, title in SLOTS) + " |", "|---" * (len(SLOTS) + 1) + "|"]
    for d, dv in pairs:
        cells = []
        for slot, _ in SLOTS:
            try:  # arch 0: the newest family the device runs, or FLASHMASK_ARCH, as a call would choose
                cells.append(f"sm{_cuda._C.selected_arch(d, name, cc, 0, slot, dv)}")
            except RuntimeError as e:
                cells.append(f"none: {str(e).splitlines()[0]}")
        lines.append(f"| {_dims((d, dv))} | " + " | ".join(cells) + " |")
    return lines


def report() -> str:
    """The report ``python -m flashmask`` prints."""
    lines = [f"flashmask {flashmask.__version__} at {os.path.dirname(os.path.abspath(flashmask.__file__))}",
             f"torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}, "
             f"{platform.platform(terse=True)}",
             f"transformers {_transformers_version()}"]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ccs = [10 * major + minor for major, minor in map(torch.cuda.get_device_capability, range(gpus))]
    if not gpus:
        lines.append("GPU: none visible (torch.cuda.is_available() is False)")
    for i, cc in enumerate(ccs):
        lines.append(f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability {cc // 10}.{cc % 10}")
    set_vars = [f"{name}={os.environ[name]}" for name in RUNTIME_VARIABLES if name in os.environ]
    if set_vars:
        lines.append("environment: " + ", ".join(set_vars))
    built: Optional[str] = getattr(_cuda._C, "__file__", None) if _cuda._C is not None else None
    if built is None:
        lines += ["CUDA kernels: not available", f"  {_cuda.unavailable_reason()}",
                  "  every call runs on the reference path (exact, O(Sq x Sk) work: not for long sequences)"]
        return "\n".join(lines)
    pairs = list(_cuda.compiled_head_dim_pairs())
    dtypes = list(_cuda.compiled_dtypes())
    lines.append(f"CUDA kernels: built ({built})")
    lines.append("  dtypes: " + ", ".join(str(t).replace("torch.", "") for t in dtypes)
                 + "; head dims (q/k, v): " + ", ".join(_dims(p) for p in pairs)
                 + "; device code: " + ", ".join(_cuda.cuda_targets()))
    if not gpus:
        lines.append(f"  not usable here: {_cuda.unavailable_reason()}")
        return "\n".join(lines)
    if dtypes and pairs:
        dtype = torch.bfloat16 if torch.bfloat16 in dtypes else dtypes[0]
        for i, cc in enumerate(ccs):
            missing = _cuda.device_code_reason(cc)
            if missing:
                lines.append(f"  GPU {i}: {missing}; its calls run on the reference path")
            else:
                lines += [""] + _family_table(i, cc, dtype, pairs)
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
