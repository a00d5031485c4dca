"""Full (bidirectional) attention: every query attends every key.

Definition: query i attends key j for all i, j. Non-causal, C=2 (LTS, UTE) with nothing masked:
LTS[j] = S (no row from S on) and UTE[j] = 0 (no row before 0).

::

    S = 4       LTS = [4, 4, 4, 4]
    ####        UTE = [0, 0, 0, 0]
    ####
    ####
    ####

Example::

    >>> full(4)[0, 0].tolist()
    [[4, 0], [4, 0], [4, 0], [4, 0]]
"""
from __future__ import annotations

import torch

from . import _spec

CAUSAL = False


def full(seqlen: int, *, batch_size: int = 1, device=None, validate: bool = True) -> torch.Tensor:
    """int32 ``[batch_size, 1, seqlen, 2]`` (LTS=seqlen, UTE=0): no key is masked."""
    s = _spec.check_seqlen(seqlen)
    b = _spec.check_batch_size(batch_size)
    lts = torch.full((b, s), s, device=device)
    return _spec.finish([lts, torch.zeros_like(lts)], CAUSAL, s, validate)


def full_mask_mod(seqlen: int, *, batch_size: int = 1, device=None):
    """Predicate ``(b, h, q_idx, kv_idx) -> True`` everywhere."""
    _spec.check_seqlen(seqlen)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= 0) & (kv_idx >= 0)

    return mask_mod
