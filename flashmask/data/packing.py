"""Packing documents into rows, and what both collators share: the mask's batch key, the checks of
their arguments and the vectorised placement of segments in a ``[rows, max_length]`` grid."""
from __future__ import annotations

import bisect
import math
from typing import List, Optional, Sequence, Tuple

import torch

MASK_KEY = "attn_mask_startend_row_indices"
PACKING_STRATEGIES = ("bfd", "sequential", "none")


def pack_sequences(lengths: Sequence[int], max_length: int, strategy: str = "bfd") -> List[List[int]]:
    """Group sample indices into rows whose lengths sum to at most ``max_length``.

    Args:
        lengths: length of each sample (each ``1 <= length <= max_length``).
        max_length: capacity of a row.
        strategy: ``"bfd"`` (best-fit decreasing: few rows, order not kept), ``"sequential"``
            (next-fit in the given order: a new row whenever the next sample does not fit) or
            ``"none"`` (one sample per row).

    Returns:
        A list of rows, each a list of indices into ``lengths``; every index appears exactly once.

    Example::

        >>> pack_sequences([3, 2, 4], 8)
        [[2, 0], [1]]
        >>> pack_sequences([3, 2, 4], 8, strategy="sequential")
        [[0, 1], [2]]
    """
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"strategy must be one of {PACKING_STRATEGIES}, got {strategy!r}")
    max_length = _positive_int(max_length, "max_length")
    lengths = [int(x) for x in lengths]
    for i, n in enumerate(lengths):
        if n < 1 or n > max_length:
            raise ValueError(f"sample {i} has length {n}; lengths must lie in [1, max_length={max_length}]")
    if strategy == "none":
        return [[i] for i in range(len(lengths))]
    if strategy == "sequential":
        rows, used = [], max_length + 1
        for i, n in enumerate(lengths):
            if used + n > max_length:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += n
        return rows
    # Best-fit decreasing: put each sample (longest first) into the fullest row it fits in.
    rows: List[List[int]] = []
    free: List[Tuple[int, int]] = []  # sorted (remaining capacity, row index)
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        n = lengths[i]
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            rows.append([i])
            bisect.insort(free, (max_length - n, len(rows) - 1))
        else:
            cap, r = free.pop(k)
            rows[r].append(i)
            bisect.insort(free, (cap - n, r))
    return rows


def _positive_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be a positive int, got {x!r}")
    return x


def _as_ids(x, what: str) -> torch.Tensor:
    """A 1-D long tensor of token ids; never rounds a float (``[1.5, 2.0]`` is an error, not ``[1, 2]``)."""
    if isinstance(x, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of ints (token ids), got {type(x).__name__} {x[:40]!r}: "
                        "tokenize the text first")
    if isinstance(x, torch.Tensor):
        t = x
    else:
        try:  # the dtype is inferred, so that floats stay floats and are rejected below
            t = torch.as_tensor(x if hasattr(x, "__array__") else list(x))
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{what} must be a sequence of ints (token ids), got {type(x).__name__} "
                            f"{str(x)[:60]}") from None
    if t.dim() != 1:
        raise ValueError(f"{what} must be a 1-D sequence of token ids, got shape {tuple(t.shape)}")
    if t.numel() and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        odd = t[t != t.round()] if t.dtype.is_floating_point else t
        example = (odd if odd.numel() else t)[0].item()
        raise ValueError(f"{what} must hold integer token ids, got {t.dtype} values such as {example!r}")
    return t.to(torch.long)


def _padded_len(used: int, max_length: int, padding: str, multiple: Optional[int]) -> int:
    s = max_length if padding == "max_length" else max(used, 1)
    if multiple:
        s = int(math.ceil(s / multiple) * multiple)
    return s


def _check_common(max_length, pad_token_id, packing, padding, pad_to_multiple_of):
    _positive_int(max_length, "max_length")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a non-negative int, got {pad_token_id!r}")
    if packing not in PACKING_STRATEGIES:
        raise ValueError(f"packing must be one of {PACKING_STRATEGIES}, got {packing!r}")
    if padding not in ("longest", "max_length"):
        raise ValueError(f"padding must be 'longest' or 'max_length', got {padding!r}")
    if pad_to_multiple_of is not None:
        _positive_int(pad_to_multiple_of, "pad_to_multiple_of")


class _RowLayout:
    """Places segments (documents or triples) given per row into a ``[R, S]`` grid, vectorised.

    ``lens`` are the segment lengths in row order, ``row`` the row of each. Gives per-token flat
    arrays: ``seg`` (segment of the token), ``off`` (offset inside its segment), ``r``/``c`` (its
    row and column), and per segment ``col0`` (first column); ``used`` per row.
    """

    def __init__(self, lens: torch.Tensor, row: torch.Tensor, num_rows: int):
        self.lens, self.row = lens, row
        n = lens.numel()
        first = torch.cumsum(lens, 0) - lens  # flat start of each segment
        self.seg = torch.repeat_interleave(torch.arange(n), lens)
        self.off = torch.arange(int(lens.sum())) - first[self.seg]
        self.used = torch.zeros(num_rows, dtype=torch.long).index_add_(0, row, lens)
        row_first = torch.cumsum(self.used, 0) - self.used  # flat start of each row
        self.col0 = first - row_first[row]
        self.r = row[self.seg]
        self.c = self.col0[self.seg] + self.off
        self.flat_first = first
