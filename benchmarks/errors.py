"""How a failed benchmark cell is reported: OOM or error, a one-line message, and whether the CUDA
context survived it."""
from __future__ import annotations

import torch


def status_of(e: BaseException) -> str:
    return "oom" if is_oom(e) else "error"


def is_oom(e: BaseException) -> bool:
    return isinstance(e, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in str(e).lower()


def is_fatal_cuda_error(e: BaseException) -> bool:
    """Errors after which the CUDA context is unusable (every later call would fail too)."""
    msg = str(e).lower()
    return any(s in msg for s in ("illegal memory access", "unspecified launch failure", "misaligned address",
                                  "illegal instruction", "device-side assert"))


def format_error(e: BaseException, limit: int = 240) -> str:
    if is_oom(e):
        return "OOM"
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    msg = f"{type(e).__name__}: {lines[0] if lines else ''}"
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."
