"""CUDA memory: the free bytes, the peak counter around a call, and freeing what can be freed.
Off CUDA the numbers are ``None``."""
from __future__ import annotations

import gc
from typing import Optional

import torch


def free_memory_bytes(device: torch.device) -> Optional[int]:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    # Memory cached by the allocator is free for us too.
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def reset_peak(device: torch.device) -> Optional[int]:
    """Synchronise, reset the CUDA peak counter and return the bytes allocated now (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.memory_allocated(device))


def peak_since(device: torch.device, base: Optional[int] = 0) -> Optional[int]:
    """``torch.cuda.max_memory_allocated`` minus ``base`` (bytes; None off CUDA)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device) - (base or 0))


def cleanup(collect: bool = True) -> None:
    """Free what can be freed: ``gc.collect()`` (slow with a big heap: at config boundaries and after
    errors, whose tracebacks hold frames and tensors) and the CUDA allocator's cached blocks."""
    if collect:
        gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()
        except Exception:  # a sticky CUDA error: nothing more to free
            pass
        torch.cuda.empty_cache()
