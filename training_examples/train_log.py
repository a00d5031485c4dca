"""What a training run reports: smoothed tokens/s, peak memory, the size of its packs, and the loss
curve (CSV and PNG)."""
from __future__ import annotations

import collections
import csv
import os
import resource
from typing import Dict, List, Optional, Tuple

import torch

from training_examples.parallel import Parallel, all_reduce


class Throughput:
    """Tokens per second over the last ``window`` steps.

    One step's rate swings with the tokens it happened to pack and with one-off costs (the first
    step, a checkpoint); the total of the last ``window`` steps over their total time does not.
    The first step, which pays for warm-up (allocations, kernel selection), is left out once
    another step has been timed.
    """

    def __init__(self, window: int = 20):
        self.steps = collections.deque(maxlen=window)
        self.first: Optional[tuple] = None

    def update(self, tokens: int, seconds: float) -> None:
        if self.first is None and not self.steps:
            self.first = (tokens, seconds)
            return
        self.steps.append((tokens, seconds))

    def rate(self) -> float:
        steps = self.steps or [self.first or (0, 1.0)]
        return sum(t for t, _ in steps) / max(sum(s for _, s in steps), 1e-9)


def peak_memory_gib(device: torch.device) -> Tuple[float, str]:
    """``(GiB, what)``: CUDA ``max_memory_allocated`` (``"cuda"``) or the process' peak RSS (``"rss"``)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "cuda"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "rss"


def peak_memory_str(device: torch.device) -> str:
    """Peak memory so far: CUDA ``max_memory_allocated`` or the process' peak RSS on CPU."""
    gib, what = peak_memory_gib(device)
    return f"{gib:.2f} GiB ({what})"


class LossLog:
    """One row per step (step, loss, tokens/s, seconds, extras), kept in memory and written to
    ``<dir>/loss.csv`` as it goes; ``plot()`` draws ``<dir>/loss.png``. ``dir=None`` keeps it in memory."""

    def __init__(self, directory: Optional[str], history: Optional[List[Dict]] = None):
        self.rows: List[Dict] = list(history or [])
        self.csv_path = self.png_path = None
        self._file = self._writer = None
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
            self.csv_path = os.path.join(directory, "loss.csv")
            self.png_path = os.path.join(directory, "loss.png")

    def add(self, row: Dict) -> None:
        self.rows.append(row)
        if self.csv_path is None:
            return
        if self._writer is None:  # (re)write from the start: a resumed run carries its history
            self._file = open(self.csv_path, "w", newline="")
            self._writer = csv.DictWriter(self._file, fieldnames=list(row))
            self._writer.writeheader()
            self._writer.writerows(self.rows[:-1])
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None

    def plot(self, title: str) -> Optional[str]:
        """Write the loss curve PNG; returns its path, or None (no directory, or no matplotlib)."""
        if self.png_path is None or not self.rows:
            return None
        try:
            from matplotlib.figure import Figure  # no pyplot: no global state, no display needed
        except ImportError:
            print("loss.png skipped: pip install matplotlib", flush=True)
            return None
        fig = Figure(figsize=(7, 4))
        ax = fig.add_subplot()
        ax.plot([r["step"] for r in self.rows], [r["loss"] for r in self.rows], linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.png_path, dpi=100)
        return self.png_path


def peak_memory(device: torch.device, par: Parallel) -> str:
    """Peak memory of this process (CUDA ``max_memory_allocated``, CPU peak RSS); with several
    processes the maximum over the ranks (a collective: every rank calls it)."""
    gib, what = peak_memory_gib(device)
    if not par.distributed:
        return f"{gib:.2f} GiB ({what})"
    t = all_reduce(torch.tensor([gib], dtype=torch.float64, device=device), par, op="max")
    return f"{float(t):.2f} GiB/{par.per_rank} ({what}, max over {par.world} ranks)"


def packs_str(args, par: Parallel) -> str:
    return (f"packs of {args.max_length} tokens x {args.batch_size}"
            f"{' per data-parallel group' if par.dp > 1 else ''}")


def rate_str(tokens_per_s: float, par: Parallel) -> str:
    """Tokens/s; with several processes per rank (``tokens/s/GPU``, on the CPU ``tokens/s/process``) and in all."""
    if not par.distributed:
        return f"{tokens_per_s:,.0f} tokens/s"
    return f"{tokens_per_s / par.world:,.0f} tokens/s/{par.per_rank} ({tokens_per_s:,.0f} in all)"
