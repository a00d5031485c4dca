"""Timing one attention call: the random inputs, the timed step of each mode, the median time
(``triton.testing.do_bench`` on CUDA, imported where used), the host time per call, and a cell
that never raises."""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Tuple

import torch

from benchmarks.errors import format_error, is_fatal_cuda_error, status_of
from benchmarks.flops import attn_flops
from benchmarks.gpu_clocks import ClockSampler

if TYPE_CHECKING:
    from benchmarks.methods import Prepared

MODES = ("fwd", "bwd", "fwdbwd")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_inputs(batch: int, seqlen: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                seed: int = 0, kv_heads: Optional[int] = None, head_dim_v: Optional[int] = None):
    """Fresh random q, k, v (requiring grad) and dout: q ``[B, S, H, D]``, k ``[B, S, kv_heads, D]``
    (default ``H``), v ``[B, S, kv_heads, Dv]`` and dout ``[B, S, H, Dv]`` (``Dv = head_dim_v``,
    default ``D``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hk = heads if kv_heads is None else kv_heads
    dv = head_dim if head_dim_v is None else head_dim_v
    shapes = ((batch, seqlen, heads, head_dim), (batch, seqlen, hk, head_dim), (batch, seqlen, hk, dv),
              (batch, seqlen, heads, dv))
    q, k, v, dout = (torch.randn(sh, generator=g, device=device, dtype=dtype) for sh in shapes)
    for t in (q, k, v):
        t.requires_grad_(True)
    return q, k, v, dout


def make_sinks(heads: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Random float32 attention sinks ``[heads]`` (one logit per query head), a leaf requiring grad
    as a learnable parameter is."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(heads, generator=g, device=device, dtype=torch.float32).requires_grad_(True)


def make_step(attn: Callable, mode: str, q, k, v, dout, params: Sequence[torch.Tensor] = ()) -> Callable:
    """The function to time. ``bwd`` runs the forward once here, outside the timed function.
    ``params``: more leaves ``attn`` reads (attention sinks) whose gradients ``bwd`` and ``fwdbwd``
    compute along with those of q, k and v."""
    inputs = (q, k, v, *params)
    if mode == "fwd":
        qd, kd, vd = q.detach(), k.detach(), v.detach()  # no autograd state at all in the forward timing

        def step():
            with torch.no_grad():
                return attn(qd, kd, vd)
    elif mode == "bwd":
        out = attn(q, k, v)

        def step():
            return torch.autograd.grad(out, inputs, dout, retain_graph=True)
    elif mode == "fwdbwd":
        def step():
            out = attn(q, k, v)
            return torch.autograd.grad(out, inputs, dout)
    else:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    return step


def _fallback_bench(fn: Callable, warmup_ms: float, rep_ms: float, device: torch.device) -> float:
    """Median per-call time in ms, each call timed alone (CUDA events on GPU, perf_counter else)."""
    def one() -> float:
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    est = max(one(), 1e-3)
    for _ in range(int(warmup_ms / est)):
        fn()
    times = [one() for _ in range(max(1, min(10000, int(rep_ms / est))))]
    return float(statistics.median(times))


MIN_TIMED_CALLS = 5


def time_ms(fn: Callable, warmup_ms: float, rep_ms: float, device: torch.device) -> float:
    """Median ms of ``fn`` by ``triton.testing.do_bench`` on CUDA (imported here, not at import time)."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            # At 32K and beyond one call outlasts rep_ms, and do_bench would time it once: take
            # at least MIN_TIMED_CALLS calls.
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            rep_ms = max(rep_ms, MIN_TIMED_CALLS * s.elapsed_time(e))
            return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return _fallback_bench(fn, warmup_ms, rep_ms, device)


# A call shorter than this may wait for its own launch path (tens of microseconds of Python and
# driver): such cells also get their host time per call measured.
HOST_CHECK_BELOW_MS = 2.0
# At this share of the measured time the GPU is (nearly) waiting for the host: a host slowed down
# for a moment then makes a whole cell slow.
HOST_BOUND_SHARE = 0.8


def host_ms_per_call(fn: Callable, device: torch.device, calls: int = 20) -> float:
    """Host time per call (ms) of ``calls`` calls issued back to back, their GPU work queued behind."""
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e3
    sync(device)
    return host


def host_bound_note(ms: float, host_ms: Optional[float]) -> str:
    """A note for a cell whose launch path takes nearly as long as its measured call, else ""."""
    if host_ms is None or host_ms < HOST_BOUND_SHARE * ms:
        return ""
    return f"host-bound? {host_ms:.3f} ms of host time a call against {ms:.3f} ms measured"


def run_mode(prep: Prepared, mode: str, tensors, warmup_ms: float, rep_ms: float,
             device: torch.device, clocks: bool = False) -> Tuple[float, float, Optional[float], Optional[tuple]]:
    """``(median ms, first-call seconds, host ms per call, (MHz, W) or None)``; the first call
    (compilation, plans) is not in the median; the host time only for CUDA calls shorter than
    HOST_CHECK_BELOW_MS (else None); ``clocks``: the GPU's clock and power sampled while timed
    (:mod:`benchmarks.gpu_clocks`)."""
    q, k, v, dout = tensors
    sync(device)
    t0 = time.perf_counter()
    step = make_step(prep.attn, mode, q, k, v, dout, prep.params)
    r = step()
    del r
    sync(device)
    first = time.perf_counter() - t0
    sampled = None
    if clocks:
        with ClockSampler(device) as sampler:
            ms = time_ms(step, warmup_ms, rep_ms, device)
        sampled = sampler.result
    else:
        ms = time_ms(step, warmup_ms, rep_ms, device)
    host = host_ms_per_call(step, device) if device.type == "cuda" and ms < HOST_CHECK_BELOW_MS else None
    del step
    return ms, first, host, sampled


def try_time(prep: Prepared, mode: str, tensors, pairs: int, head_dim: int, warmup_ms: float, rep_ms: float,
             device: torch.device, head_dim_v: Optional[int] = None, clocks: bool = False) -> dict:
    """Time one mode; never raises. Returns ``{"status", "ms", "tflops", "first_call_s", "host_ms",
    "sm_mhz", "power_w", "notes", "fatal"}``; a cell that may be bound by its launch path says so in
    its notes. TFLOP/s by :func:`benchmarks.flops.attn_flops` (``head_dim_v``: v's head dim, default
    ``head_dim``). ``clocks``: sample the GPU's SM clock and power while timing (else both None)."""
    notes = [n for n in prep.notes if n]
    try:
        ms, first, host, sampled = run_mode(prep, mode, tensors, warmup_ms, rep_ms, device, clocks)
        tflops = attn_flops(pairs, head_dim, mode, head_dim_v) / (ms * 1e-3) / 1e12
        host_note = host_bound_note(ms, host)
        if host_note:
            notes.append(host_note)
        mhz, watts = sampled if sampled is not None else (None, None)
        return {"status": "ok", "ms": ms, "tflops": tflops, "first_call_s": first, "host_ms": host,
                "sm_mhz": mhz, "power_w": watts, "notes": "; ".join(notes), "fatal": False}
    except Exception as e:
        return {"status": status_of(e), "notes": "; ".join([*notes, format_error(e)]),
                "fatal": is_fatal_cuda_error(e)}
