"""Where a training step's time goes: one step under ``torch.profiler``, its GPU time split into
attention kernels and everything else.

The split bounds what a faster attention can give end to end (Amdahl): a step whose attention
kernels take a share ``a`` of its GPU time runs at most ``1 / (1 - a)`` times faster with free
attention. Attention kernels are told by name (:data:`ATTENTION_KERNEL`): flashmask's kernels,
FlexAttention's compiled kernels (``triton_tem_fused_flex_attention...``), and SDPA's flash,
memory-efficient and cuDNN kernels. Eager attention is matrix products and a softmax, not told
apart from the model's other matrix products: its share reads 0.

On a CPU (smoke runs) the same split is taken over the outermost CPU operators instead of kernels.
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Tuple

import torch

ATTENTION_KERNEL = re.compile(r"flashmask|flex_attention|fmha|flash|sdpa|scaled_dot_product|efficient_attention",
                              re.IGNORECASE)


def split_times(named_us: Iterable[Tuple[str, float]], top: int = 5) -> dict:
    """``{"total_ms", "attention_ms", "attention_share", "top"}`` from ``(name, microseconds)``
    pairs; ``top``: the ``top`` names taking the most time, ``(name, ms, count)``."""
    total = attn = 0.0
    per_name: dict = {}
    for name, us in named_us:
        total += us
        if ATTENTION_KERNEL.search(name):
            attn += us
        ms, n = per_name.get(name, (0.0, 0))
        per_name[name] = (ms + us / 1e3, n + 1)
    top = sorted(((n, ms, c) for n, (ms, c) in per_name.items()), key=lambda t: -t[1])[:top]
    return {"total_ms": total / 1e3, "attention_ms": attn / 1e3,
            "attention_share": attn / total if total > 0 else None, "top": top}


def _device_kernels(events) -> list:
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name, e.device_time_total) for e in events if e.device_type == cuda]


def _outer_cpu_ops(events) -> list:
    """The outermost matching CPU operators, and every other top-level operator less the matching
    ones inside it (so that the times add up to the step's)."""
    cpu = torch.autograd.DeviceType.CPU
    tops: dict = {}  # id of a top-level operator that does not match -> [name, microseconds]
    out = []
    for e in events:
        if e.device_type != cpu:
            continue
        chain, parent = [], e.cpu_parent
        while parent is not None:
            chain.append(parent)
            parent = parent.cpu_parent
        if any(ATTENTION_KERNEL.search(p.name) for p in chain):
            continue
        if ATTENTION_KERNEL.search(e.name):
            out.append((e.name, e.cpu_time_total))
            if chain:
                tops.setdefault(chain[-1].id, [chain[-1].name, chain[-1].cpu_time_total])[1] -= e.cpu_time_total
        elif not chain:
            tops.setdefault(e.id, [e.name, e.cpu_time_total])
    return out + [tuple(v) for v in tops.values()]


def profile_step(step: Callable[[], object], device: torch.device, trace: Optional[Path] = None,
                 top: int = 5) -> dict:
    """Run ``step()`` once under the profiler; :func:`split_times` of its GPU kernels (CPU
    operators on a CPU), plus ``"wall_ms"``. ``trace``: a Chrome trace file to write."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        if on_gpu:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    events = prof.events()
    out = split_times(_device_kernels(events) if on_gpu else _outer_cpu_ops(events), top)
    out["wall_ms"] = wall * 1e3
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    return out
