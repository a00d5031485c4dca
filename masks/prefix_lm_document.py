"""Prefix-LM document mask: packed documents, each a bidirectional prefix then causal tokens.

Definition: query i attends key j iff they are in the same document and (j is in that
document's prefix, or j <= i). Non-causal, C=2: LTS[j] = end of j's document; UTE[j] = start
of the document for prefix keys, j itself otherwise.

``prefix_lens`` is one int per document (same nesting as ``doc_lens``), or a single int used for
every document (cut to the document's length where the document is shorter). Tail tokens after
``sum(doc_lens)`` form one more document with no prefix (plain causal).

::

    S = 10, doc_lens = [3, 2, 5], prefix_lens = 2
    ##........     LTS = [3, 3, 3, 5, 5, 10, 10, 10, 10, 10]
    ##........     UTE = [0, 0, 2, 3, 3, 5, 5, 7, 8, 9]
    ###.......
    ...##.....
    ...##.....
    .....##...
    .....##...
    .....###..
    .....####.
    .....#####

Example::

    >>> prefix_lm_document(10, [3, 2, 5], 2)[0, 0, :, 1].tolist()
    [0, 0, 2, 3, 3, 5, 5, 7, 8, 9]
"""
from __future__ import annotations

import torch

from . import _spec

CAUSAL = False


def _parse(seqlen, doc_lens, prefix_lens, batch_size):
    s = _spec.check_seqlen(seqlen)
    docs = _spec.samples(doc_lens, "doc_lens", 1, batch_size)
    segs = [_spec.lengths(x, "doc_lens", s, b) for b, x in enumerate(docs)]
    if _spec.is_int(prefix_lens):
        if prefix_lens < 0:
            raise ValueError(f"prefix_lens must be >= 0, got {prefix_lens}")
        prefs = [[min(int(prefix_lens), d) for d in x] for x in docs]
    else:
        prefs = _spec.samples(prefix_lens, "prefix_lens", 1, len(docs))
    pre = []
    for b, (x, p, lens) in enumerate(zip(docs, prefs, segs)):
        if _spec.is_int(p) or len(p) != len(x) or any(not _spec.is_int(v) for v in p):
            raise ValueError(f"prefix_lens of sample {b} must be {len(x)} ints (one per document), got {p!r}")
        for d, (n, v) in enumerate(zip(lens, p)):
            if not 0 <= v <= n:
                raise ValueError(f"prefix_lens of sample {b}, document {d} is {v}; it must lie in [0, {n}]")
        pre.append([int(v) for v in p] + [0] * (len(lens) - len(p)))  # the tail doc has no prefix
    return s, segs, pre


def prefix_lm_document(seqlen: int, doc_lens, prefix_lens, *, batch_size=None, device=None,
                       validate: bool = True) -> torch.Tensor:
    """int32 ``[B, 1, seqlen, 2]`` (LTS = doc end, UTE = doc start for prefix keys, else j)."""
    s, segs, pre = _parse(seqlen, doc_lens, prefix_lens, batch_size)
    start, end, _ = _spec.segments(segs, s, device)
    lens = torch.tensor([n for x in segs for n in x], device=device)
    prefix = torch.repeat_interleave(torch.tensor([v for x in pre for v in x], device=device), lens)
    j = torch.arange(s, device=device)
    ute = torch.where(j < start + prefix.view_as(start), start, j)
    return _spec.finish([end, ute], CAUSAL, s, validate)


def prefix_lm_document_mask_mod(seqlen: int, doc_lens, prefix_lens, *, batch_size=None, device=None):
    """Predicate: same document and (key in the document's prefix, or ``kv_idx <= q_idx``)."""
    s, segs, pre = _parse(seqlen, doc_lens, prefix_lens, batch_size)
    doc = _spec.ids(segs, device)
    # Offset of each token inside its document, compared with its document's prefix length.
    in_prefix = torch.stack([
        torch.cat([torch.arange(n) < v for n, v in zip(x, p)]) for x, p in zip(segs, pre)]).to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (in_prefix[b, kv_idx] | (kv_idx <= q_idx))

    return mask_mod
