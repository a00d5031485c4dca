"""One representative mask per family at any length: the settings of the benchmarks and GPU tests.

``example(family, seqlen)`` returns ``(startend_row_indices, causal)``. Window and document sizes
follow the benchmark settings (sliding window 1024, 8 documents), shrunk for short sequences.

Example::

    >>> mask, causal = example("causal_document", 4096)
    >>> mask.shape, causal
    (torch.Size([1, 1, 4096, 1]), True)
"""
from __future__ import annotations

from typing import Tuple

import torch

from . import FAMILIES


def _doc_lens(seqlen: int, n_docs: int, seed: int = 0) -> list:
    """n_docs lengths summing to seqlen, of uneven sizes (random cuts with a fixed seed)."""
    n_docs = max(1, min(n_docs, seqlen))
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(seqlen - 1, generator=g)[: n_docs - 1].add(1).sort().values.tolist()
    edges = [0] + cuts + [seqlen]
    return [b - a for a, b in zip(edges, edges[1:])]


def _window(seqlen: int) -> int:
    return max(1, min(1024, seqlen // 8))


def example(family: str, seqlen: int, *, batch_size: int = 1, device=None) -> Tuple[torch.Tensor, bool]:
    """``(startend_row_indices [batch_size, 1, seqlen, C], causal)`` for a family's benchmark setting."""
    if family not in FAMILIES:
        raise ValueError(f"unknown mask family {family!r}; known: {sorted(FAMILIES)}")
    if seqlen < 1:
        raise ValueError(f"seqlen must be >= 1, got {seqlen}")
    s, mod = seqlen, FAMILIES[family]
    fn = getattr(mod, family)
    docs = _doc_lens(s, 8)
    if family in ("full", "causal"):
        mask = fn(s, batch_size=batch_size)
    elif family == "sliding_window":
        mask = fn(s, _window(s), batch_size=batch_size)
    elif family in ("causal_document", "document"):
        mask = fn(s, [docs] * batch_size)
    elif family == "share_question":  # DPO-like: prompt half, chosen and rejected a quarter each
        mask = fn(s, [[s - 2 * (s // 4), s // 4, s // 4]] * batch_size) if s >= 4 else fn(s, [[s]] * batch_size)
    elif family == "global_sliding_window":
        mask = fn(s, min(16, s), _window(s), batch_size=batch_size)
    elif family == "causal_blockwise":  # two blocks of a quarter, the second half sees all
        mask = fn(s, [[s // 4, s // 4]] * batch_size)
    elif family == "prefix_lm_causal":
        mask = fn(s, [s // 4] * batch_size)
    elif family == "prefix_lm_document":
        mask = fn(s, [docs] * batch_size, [[d // 2 for d in docs]] * batch_size)
    elif family == "qk_sparse":  # the middle half of the keys is dropped for the third quarter of rows
        mask = fn(s, [[(s // 4, s // 2, s // 2, 3 * s // 4)]] * batch_size)
    else:  # random_eviction
        mask = fn(s, batch_size=batch_size, seed=0)
    return mask.to(device), mod.CAUSAL
