"""Global + sliding window (bidirectional): a few global tokens plus a symmetric local band.

Definition: the first ``num_global`` tokens are global: they attend every key and every query
attends them. Any other query i attends a non-global key j iff ``|i - j| < window``, i.e. itself
and ``window - 1`` neighbours on each side (the same count as ``sliding_window``, mirrored).
Non-causal, C=4. For a non-global key j the masked rows are ``[g, j - window + 1)`` above the
band (UTS, UTE; written (0, 0) when empty) and ``[j + window, S)`` below it (LTS, LTE=S);
global keys mask nothing (LTS = LTE = S, UTS = UTE = 0).

::

    S = 10, num_global = 2, window = 2
    ##########     LTS = [10, 10, 4, 5, 6, 7, 8, 9, 10, 10]
    ##########     LTE = [10] * 10
    ####......     UTS = [0, 0, 0, 0, 2, 2, 2, 2, 2, 2]
    #####.....     UTE = [0, 0, 0, 0, 3, 4, 5, 6, 7, 8]
    ##.###....
    ##..###...
    ##...###..
    ##....###.
    ##.....###
    ##......##

Example::

    >>> global_sliding_window(10, 2, 2)[0, 0, :, 3].tolist()
    [0, 0, 0, 0, 3, 4, 5, 6, 7, 8]
"""
from __future__ import annotations

import torch

from . import _spec

CAUSAL = False


def _check(seqlen, num_global, window):
    s = _spec.check_seqlen(seqlen)
    if not _spec.is_int(num_global) or not 0 <= num_global <= s:
        raise ValueError(f"num_global must be an int in [0, seqlen={s}], got {num_global!r}")
    if not _spec.is_int(window) or window < 1:
        raise ValueError(f"window must be an int >= 1 (the query itself counts), got {window!r}")
    return s, int(num_global), int(window)


def global_sliding_window(seqlen: int, num_global: int, window: int, *, batch_size: int = 1, device=None,
                          validate: bool = True) -> torch.Tensor:
    """int32 ``[batch_size, 1, seqlen, 4]`` (LTS, LTE, UTS, UTE)."""
    s, g, w = _check(seqlen, num_global, window)
    bsz = _spec.check_batch_size(batch_size)
    j = torch.arange(s, device=device)
    local = j >= g
    lts = torch.where(local, (j + w).clamp(max=s), s)
    lte = torch.full_like(j, s)
    ute = j - w + 1
    above = local & (ute > g)  # a non-empty band of non-global rows above the window
    uts = torch.where(above, g, 0)
    ute = torch.where(above, ute, 0)
    return _spec.finish([x.expand(bsz, s) for x in (lts, lte, uts, ute)], CAUSAL, s, validate)


def global_sliding_window_mask_mod(seqlen: int, num_global: int, window: int, *, batch_size: int = 1,
                                   device=None):
    """Predicate: ``q_idx < g or kv_idx < g or |q_idx - kv_idx| < window``."""
    _, g, w = _check(seqlen, num_global, window)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx < g) | (kv_idx < g) | ((q_idx - kv_idx).abs() < w)

    return mask_mod
