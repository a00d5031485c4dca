"""Document mask (bidirectional): packed documents, each attending fully to itself only.

Definition: i attends j iff tokens i and j belong to the same document. Non-causal, C=2: key j
is masked for rows from its document's end on (LTS[j] = doc end) and for rows before its
document's start (UTE[j] = doc start). A tail of tokens beyond ``sum(doc_lens)`` forms one more
document.

::

    S = 10, doc_lens = [4, 3, 3]     LTS = [4, 4, 4, 4, 7, 7, 7, 10, 10, 10]
    ####......                       UTE = [0, 0, 0, 0, 4, 4, 4, 7, 7, 7]
    ####......
    ####......
    ####......
    ....###...
    ....###...
    ....###...
    .......###
    .......###
    .......###

Example::

    >>> document(10, [4, 3, 3])[0, 0, :, 1].tolist()
    [0, 0, 0, 0, 4, 4, 4, 7, 7, 7]
"""
from __future__ import annotations

import torch

from . import _spec
from .causal_document import _docs

CAUSAL = False


def document(seqlen: int, doc_lens, *, batch_size=None, device=None, validate: bool = True) -> torch.Tensor:
    """int32 ``[B, 1, seqlen, 2]`` (LTS = doc end, UTE = doc start)."""
    s, per = _docs(seqlen, doc_lens, batch_size)
    start, end, _ = _spec.segments(per, s, device)
    return _spec.finish([end, start], CAUSAL, s, validate)


def document_mask_mod(seqlen: int, doc_lens, *, batch_size=None, device=None):
    """Predicate: same document."""
    _, per = _docs(seqlen, doc_lens, batch_size)
    doc = _spec.ids(per, device)

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    return mask_mod
