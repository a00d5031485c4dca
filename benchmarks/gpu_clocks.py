"""The SM clock and board power of the GPU while a cell is timed, sampled by ``nvidia-smi``.

At its power cap a GPU lowers its clock, by how much depends on the kernel, so two kernels timed
back to back may run at different clocks: TFLOP/s then measure energy per FLOP as much as cycles.
Short timings start below the cap (a cell of 30-100 ms runs partly at the idle GPU's boost clock),
so they favour whichever kernel draws more power. ``bench_kernels --gpu-clocks --rep 4000`` times
each cell for 4 s and says at which clock and power it ran.

Example::

    with ClockSampler(torch.device("cuda")) as sampler:
        ...  # the timed calls
    sampler.result  # (median MHz, median W) of the steady part, or None without samples
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from typing import List, Optional, Sequence, Tuple

import torch

SAMPLE_MS = 50  # nvidia-smi's sampling interval
RAMP_SHARE = 0.25  # the first samples, before the clock settles at the power cap, are left out
START_S = 0.3  # nvidia-smi's start-up before its first sample


def parse_samples(text: str) -> List[Tuple[float, float]]:
    """``(MHz, W)`` of each ``clocks.sm,power.draw`` line of ``nvidia-smi --format=csv,noheader,nounits``;
    lines that are not two numbers (``[N/A]``, blank, a message) are skipped."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            samples.append((float(parts[0]), float(parts[1])))
        except ValueError:
            continue
    return samples


def steady_medians(samples: Sequence[Tuple[float, float]]) -> Optional[Tuple[float, float]]:
    """Median MHz and W of the samples after the first RAMP_SHARE of them; None without samples."""
    if not samples:
        return None
    steady = samples[int(len(samples) * RAMP_SHARE):]
    return statistics.median(s[0] for s in steady), statistics.median(s[1] for s in steady)


def smi_command(device: torch.device) -> List[str]:
    """The sampling command for ``device``, named by UUID where torch gives one (so that
    CUDA_VISIBLE_DEVICES cannot point nvidia-smi at another GPU)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    target = str(index) if uuid is None else str(uuid) if str(uuid).startswith("GPU-") else f"GPU-{uuid}"
    return ["nvidia-smi", "-i", target, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
            "-lms", str(SAMPLE_MS)]


def check_available() -> Optional[str]:
    """Why clocks cannot be sampled here (no nvidia-smi, no CUDA), or None."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi is not on PATH"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


class ClockSampler:
    """Samples while its ``with`` block runs; ``result`` is then ``(MHz, W)`` or None. ``command``
    replaces the nvidia-smi command (tests)."""

    def __init__(self, device: Optional[torch.device] = None, command: Optional[Sequence[str]] = None):
        if command is None and device is None:
            raise ValueError("ClockSampler needs a device or a command")
        self.command = list(command) if command is not None else smi_command(device)
        self.result: Optional[Tuple[float, float]] = None
        self._proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "ClockSampler":
        self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(START_S)  # the timing starts once sampling runs, not during nvidia-smi's start-up
        if self._proc.poll() is not None:
            err = self._proc.communicate()[1].strip()
            raise RuntimeError(f"{' '.join(self.command)} exited with status {self._proc.returncode}: "
                               f"{err or 'no message'}")
        return self

    def __exit__(self, *exc) -> None:
        self._proc.terminate()
        out, _ = self._proc.communicate()
        self.result = steady_medians(parse_samples(out))
        self._proc = None
