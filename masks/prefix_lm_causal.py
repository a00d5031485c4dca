"""Prefix-LM (causal) mask: a bidirectional prefix followed by causal generation.

Definition: query i attends key j iff j < prefix_len (the prefix is visible to every row,
including earlier prefix rows) or j <= i. Non-causal, C=2: prefix keys mask nothing
(UTE = 0); a key j after the prefix is masked for rows before it (UTE[j] = j); LTS = S.

::

    S = 10, prefix_len = 5     LTS = [10] * 10
    #####.....                 UTE = [0, 0, 0, 0, 0, 5, 6, 7, 8, 9]
    #####.....
    #####.....
    #####.....
    #####.....
    ######....
    #######...
    ########..
    #########.
    ##########

Example::

    >>> prefix_lm_causal(10, 5)[0, 0, :, 1].tolist()
    [0, 0, 0, 0, 0, 5, 6, 7, 8, 9]
    >>> prefix_lm_causal(4, [1, 3]).shape   # two samples with their own prefixes
    torch.Size([2, 1, 4, 2])
"""
from __future__ import annotations

import torch

from . import _spec

CAUSAL = False


def _parse(seqlen, prefix_len, batch_size):
    s = _spec.check_seqlen(seqlen)
    per = _spec.samples(prefix_len, "prefix_len", 0, batch_size)
    for b, p in enumerate(per):
        if not _spec.is_int(p) or not 0 <= p <= s:
            raise ValueError(f"prefix_len of sample {b} must be an int in [0, seqlen={s}], got {p!r}")
    return s, [int(p) for p in per]


def prefix_lm_causal(seqlen: int, prefix_len, *, batch_size=None, device=None, validate: bool = True) -> torch.Tensor:
    """int32 ``[B, 1, seqlen, 2]``; ``prefix_len`` is an int or a list of B ints."""
    s, per = _parse(seqlen, prefix_len, batch_size)
    j = torch.arange(s, device=device).expand(len(per), s)
    p = torch.tensor(per, device=device).view(-1, 1)
    ute = torch.where(j < p, 0, j)
    return _spec.finish([torch.full_like(j, s), ute], CAUSAL, s, validate)


def prefix_lm_causal_mask_mod(seqlen: int, prefix_len, *, batch_size=None, device=None):
    """Predicate: ``kv_idx < prefix_len[b] or kv_idx <= q_idx``."""
    _, per = _parse(seqlen, prefix_len, batch_size)
    p = torch.tensor(per, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < p[b]) | (kv_idx <= q_idx)

    return mask_mod
