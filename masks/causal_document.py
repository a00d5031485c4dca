"""Causal document mask: packed documents, each attending causally to itself only.

Definition: i attends j iff j <= i and tokens i and j belong to the same document. Causal, C=1:
key j is seen by the rows of its document from j on, so LTS[j] = end of j's document.

Documents are given by their lengths; if they sum to less than ``seqlen`` the remaining tail
tokens form one more document (e.g. padding, kept apart from the real documents).

::

    S = 10, doc_lens = [4, 3, 3]     LTS = [4, 4, 4, 4, 7, 7, 7, 10, 10, 10]
    #.........
    ##........
    ###.......
    ####......
    ....#.....
    ....##....
    ....###...
    .......#..
    .......##.
    .......###

Example::

    >>> causal_document(10, [4, 3, 3])[0, 0, :, 0].tolist()
    [4, 4, 4, 4, 7, 7, 7, 10, 10, 10]
    >>> causal_document(6, [[2, 4], [3]]).shape   # two samples; sample 1 gets a tail doc of 3
    torch.Size([2, 1, 6, 1])
"""
from __future__ import annotations

import torch

from . import _spec

CAUSAL = True


def _docs(seqlen, doc_lens, batch_size):
    s = _spec.check_seqlen(seqlen)
    per = _spec.samples(doc_lens, "doc_lens", 1, batch_size)
    return s, [_spec.lengths(x, "doc_lens", s, b) for b, x in enumerate(per)]


def causal_document(seqlen: int, doc_lens, *, batch_size=None, device=None, validate: bool = True) -> torch.Tensor:
    """int32 ``[B, 1, seqlen, 1]``; ``doc_lens`` is one list of lengths or a list of B lists."""
    s, per = _docs(seqlen, doc_lens, batch_size)
    _, end, _ = _spec.segments(per, s, device)
    return _spec.finish([end], CAUSAL, s, validate)


def causal_document_mask_mod(seqlen: int, doc_lens, *, batch_size=None, device=None):
    """Predicate: same document and ``kv_idx <= q_idx``."""
    _, per = _docs(seqlen, doc_lens, batch_size)
    doc = _spec.ids(per, device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)

    return mask_mod
