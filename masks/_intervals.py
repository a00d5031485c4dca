"""Private interval arithmetic on key columns, shared by ``convert`` and ``plot``.

Every column's masked rows are summarised by their maximal runs: how many runs there are and
the first and last run (enough for the format, which holds at most two runs per column).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from .format import check_columns


class Runs(NamedTuple):
    """Maximal runs of masked rows per column, each ``[B, H, Sk]`` int64.

    ``first_*`` / ``last_*`` are meaningful only where ``count >= 1``; with one run they agree.
    """

    count: torch.Tensor
    first_lo: torch.Tensor
    first_hi: torch.Tensor
    last_lo: torch.Tensor
    last_hi: torch.Tensor


def runs_of_dense(masked: torch.Tensor) -> Runs:
    """Runs of True along dim 2 of a bool ``[B, H, Sq, Sk]``."""
    b, h, sq, sk = masked.shape
    pad = masked.new_zeros(b, h, 1, sk)
    mp = torch.cat([pad, masked, pad], dim=2)  # rows -1 .. Sq
    starts = (mp[:, :, 1:] & ~mp[:, :, :-1]).to(torch.uint8)  # run starts at r, r in 0..Sq
    ends = (~mp[:, :, 1:] & mp[:, :, :-1]).to(torch.uint8)  # run ends (exclusive) at r
    last = lambda t: sq - t.flip(2).argmax(2)  # index of the last 1 along rows 0..Sq
    return Runs(starts.sum(2, dtype=torch.long), starts.argmax(2), ends.argmax(2), last(starts), last(ends))


def runs_of_union(lo: torch.Tensor, hi: torch.Tensor) -> Runs:
    """Runs of the union of ``k`` half-open intervals ``[lo, hi)`` per column (``[..., k]``)."""
    k = lo.shape[-1]
    lo, hi = lo.long(), hi.long()
    nonempty = lo < hi
    lo = torch.where(nonempty, lo, torch.iinfo(torch.long).max)  # empty intervals sort last, ignored
    hi = torch.where(nonempty, hi, -1)
    lo, order = lo.sort(-1)
    hi = hi.gather(-1, order)
    nonempty = nonempty.gather(-1, order)
    # Largest end among the intervals before t: interval t starts a new run iff it begins after it
    # (touching intervals merge, as adjacent masked rows do).
    before = torch.cat([torch.full_like(hi[..., :1], -1), hi.cummax(-1).values[..., :-1]], -1)
    new = nonempty & (lo > before)
    count = new.sum(-1)
    idx = torch.arange(k, device=lo.device)
    li = torch.where(new, idx, 0).max(-1, keepdim=True).values  # index of the last run's start
    last_hi = hi.max(-1).values
    first_hi = torch.where(count >= 2, before.gather(-1, li).squeeze(-1), last_hi)
    return Runs(count, lo[..., 0], first_hi, lo.gather(-1, li).squeeze(-1), last_hi)


def _first(bad: torch.Tensor):
    return tuple(int(x) for x in bad.nonzero()[0])


def encode(r: Runs, causal: bool, num_columns: Optional[int], sq: int,
           describe: Callable[[int, int, int], str], invalid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Write runs in the format: the smallest ``C`` that fits every column, or ``num_columns``.

    For causal masks the runs must already exclude the causal triangle. ``invalid`` marks columns
    that no C can express (e.g. a causal column attended above the diagonal). Raises
    ``ValueError`` naming the first (batch, head, column) that does not fit, with
    ``describe(b, h, j)``.
    """
    n, fl, fh, ll, lh = r
    if causal:
        fits = {1: (n == 0) | ((n == 1) & (lh == sq)), 2: n <= 1}
        why = {1: "C=1 holds one run that reaches the last row", 2: "causal C=2 holds one run of masked rows "
               "below the diagonal"}
    else:
        top, bottom = fl == 0, lh == sq
        fits = {2: (n == 0) | ((n == 1) & (top | bottom)) | ((n == 2) & top & bottom), 4: n <= 2}
        why = {2: "non-causal C=2 holds a run from row 0 and a run to the last row",
               4: "C=4 holds two runs of masked rows"}
    if invalid is not None:
        fits = {c: f & ~invalid for c, f in fits.items()}
    if num_columns is None:
        allowed = [c for c in sorted(fits) if bool(fits[c].all())]
        c = allowed[0] if allowed else max(fits)
    else:
        check_columns(num_columns, causal)
        c = num_columns
    if not bool(fits[c].all()):
        b, h, j = _first(~fits[c])
        reason = describe(b, h, j)
        if invalid is None or not bool(invalid[b, h, j]):
            reason += f"; {why[c]}"
        raise ValueError(f"mask not representable in the FlashMask format with causal={bool(causal)}, C={c}: "
                         f"batch {b}, head {h}, column {j}: {reason}")
    one, two = n >= 1, n == 2
    if causal:
        lts, lte = torch.where(one, fl, sq), torch.where(one, fh, sq)
        cols = [lts] if c == 1 else [lts, lte]
    elif c == 2:
        upper = one & top  # a run starting at row 0 is the UTE part
        lower = two | (one & ~top)
        cols = [torch.where(lower, ll, sq), torch.where(upper, fh, 0)]
    else:
        # A lone run goes to LTS/LTE when it reaches the last row, else to UTS/UTE (as in the global + sliding
        # window example of docs/format.md); two runs fill both.
        lower = two | (one & bottom)
        upper = two | (one & ~bottom)
        cols = [torch.where(lower, ll, sq), torch.where(lower, lh, sq), torch.where(upper, fl, 0),
                torch.where(upper, fh, 0)]
    return torch.stack(cols, -1).to(torch.int32)
