"""Causal sliding window: query i attends itself and the ``window - 1`` keys before it.

Definition: i attends j iff ``0 <= i - j < window``. Causal, C=1: key j is seen by rows
``j .. j + window - 1``, so LTS[j] = min(j + window, S). (In flash-attn terms this is
``window_size=(window - 1, 0)``.)

::

    S = 10, window = 3     LTS = [3, 4, 5, 6, 7, 8, 9, 10, 10, 10]
    #.........
    ##........
    ###.......
    .###......
    ..###.....
    ...###....
    ....###...
    .....###..
    ......###.
    .......###

Example::

    >>> sliding_window(10, 3)[0, 0, :, 0].tolist()
    [3, 4, 5, 6, 7, 8, 9, 10, 10, 10]
"""
from __future__ import annotations

import torch

from . import _spec

CAUSAL = True


def _check_window(window) -> int:
    if not _spec.is_int(window) or window < 1:
        raise ValueError(f"window must be an int >= 1 (the query itself counts), got {window!r}")
    return int(window)


def sliding_window(seqlen: int, window: int, *, batch_size: int = 1, device=None,
                   validate: bool = True) -> torch.Tensor:
    """int32 ``[batch_size, 1, seqlen, 1]``: LTS[j] = min(j + window, seqlen)."""
    s = _spec.check_seqlen(seqlen)
    w = _check_window(window)
    b = _spec.check_batch_size(batch_size)
    lts = (torch.arange(s, device=device) + w).clamp_(max=s).expand(b, s)
    return _spec.finish([lts], CAUSAL, s, validate)


def sliding_window_mask_mod(seqlen: int, window: int, *, batch_size: int = 1, device=None):
    """Predicate: ``0 <= q_idx - kv_idx < window``."""
    _spec.check_seqlen(seqlen)
    w = _check_window(window)

    def mask_mod(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (d >= 0) & (d < w)

    return mask_mod
