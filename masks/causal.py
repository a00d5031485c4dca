"""Causal attention: query i attends key j iff j <= i.

Causal, C=1: the causal flag already masks the upper triangle, so LTS[j] = S (nothing more).

::

    S = 4       LTS = [4, 4, 4, 4]
    #...
    ##..
    ###.
    ####

Example::

    >>> causal(4)[0, 0, :, 0].tolist()
    [4, 4, 4, 4]
"""
from __future__ import annotations

import torch

from . import _spec

CAUSAL = True


def causal(seqlen: int, *, batch_size: int = 1, device=None, validate: bool = True) -> torch.Tensor:
    """int32 ``[batch_size, 1, seqlen, 1]`` with LTS = seqlen."""
    s = _spec.check_seqlen(seqlen)
    b = _spec.check_batch_size(batch_size)
    return _spec.finish([torch.full((b, s), s, device=device)], CAUSAL, s, validate)


def causal_mask_mod(seqlen: int, *, batch_size: int = 1, device=None):
    """Predicate: ``kv_idx <= q_idx``."""
    _spec.check_seqlen(seqlen)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    return mask_mod
