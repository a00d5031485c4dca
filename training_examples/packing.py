"""The stream of packed rows the examples train on: samples packed next-fit into rows of
``--max-length`` tokens, a fresh order every epoch, resumable from a checkpoint."""
from __future__ import annotations

from typing import Callable, Dict, List

import torch


class PackedStream:
    """An endless stream of samples packed into rows of ``max_length`` tokens, resumable.

    Every epoch visits the samples in a fresh order (a permutation seeded by ``seed + epoch``);
    rows are filled next-fit, and the sample that did not fit opens the next row. ``state_dict``
    records where the stream stands, so a resumed run sees the same rows as an uninterrupted one.
    """

    def __init__(self, items: List, size_of: Callable, max_length: int, seed: int):
        self.items, self.size_of, self.max_length, self.seed = items, size_of, max_length, seed
        fits = [i for i, x in enumerate(items) if size_of(x) <= max_length]
        if not fits:
            raise ValueError(f"no sample fits in --max-length {max_length} tokens")
        self.dropped = len(items) - len(fits)
        self.fits = fits
        self.epoch, self.pos, self.pending = 0, 0, None
        self._order = self._permutation()

    def _permutation(self) -> List[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return [self.fits[i] for i in torch.randperm(len(self.fits), generator=g).tolist()]

    def _next(self) -> int:
        if self.pending is not None:
            i, self.pending = self.pending, None
            return i
        if self.pos == len(self._order):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._permutation()
        self.pos += 1
        return self._order[self.pos - 1]

    def rows(self, n: int) -> List[List]:
        out = []
        for _ in range(n):
            row, used = [], 0
            while True:
                i = self._next()
                size = self.size_of(self.items[i])
                if used + size > self.max_length:
                    self.pending = i
                    break
                row.append(self.items[i])
                used += size
            out.append(row)
        return out

    def state_dict(self) -> Dict:
        return {"epoch": self.epoch, "pos": self.pos, "pending": self.pending}

    def load_state_dict(self, state: Dict) -> None:
        self.epoch, self.pos, self.pending = state["epoch"], state["pos"], state["pending"]
        self._order = self._permutation()
