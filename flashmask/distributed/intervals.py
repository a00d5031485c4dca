"""Column intervals restricted to a block of query rows, and exact work counts per block.

A context-parallel rank that owns the query rows ``[r0, r1)`` of a self-attention runs the
unchanged kernels on those rows against every key. Its mask is the global one with the rows
renumbered: local row ``i' = i - r0``. Every masked interval ``[s, e)`` of a column becomes
``[clamp(s - r0, 0, n), clamp(e - r0, 0, n))`` with ``n = r1 - r0`` (clamping keeps exactly the
part inside the block; an empty interval stays empty).

The causal flag cannot be kept: the kernels align causal masks bottom-right over the *local*
rows, which matches the global triangle only for the last block. So the triangle is written as
an interval: key ``j`` is hidden from the global rows ``i < j - (Sk - Sq)``, the rows
``[0, clamp(j - (Sk - Sq) - r0, 0, n))`` of the block, and the block's mask is non-causal:

=====================  ==============================================================
global mask            the block's mask (non-causal), ``c(x) = clamp(x - r0, 0, n)``
=====================  ==============================================================
causal, None           C=2: LTS' = n, UTE' = c(j - off)
causal C=1 (LTS)       C=2: LTS' = c(LTS), UTE' = c(j - off)
causal C=2 (LTS, LTE)  C=4: LTS' = c(LTS), LTE' = c(LTE), UTS' = 0, UTE' = c(j - off)
non-causal, None       None
non-causal C=2         C=2: c(LTS), c(UTE)
non-causal C=4         C=4: c(LTS), c(LTE), c(UTS), c(UTE)
=====================  ==============================================================

(``off = Sk - Sq``, 0 for self-attention.) Everything is O(B * Hm * Sk) per block; no
``Sq x Sk`` tensor is ever built.

Example (causal document, lengths 4, 3, 3; the block of rows 4-7)::

    >>> import masks
    >>> m = masks.causal_document(10, [4, 3, 3])
    >>> local = slice_rows(m, True, 4, 7)        # non-causal, C=2, rows 0..2 = global 4..6
    >>> local[0, 0, :, 0].tolist(), local[0, 0, :, 1].tolist()
    ([0, 0, 0, 0, 3, 3, 3, 3, 3, 3], [0, 0, 0, 0, 0, 1, 2, 3, 3, 3])
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from masks.format import unpack

__all__ = ["slice_rows", "visible_pairs", "block_pairs"]


def _sizes(startend: Optional[torch.Tensor], seqlen_q: Optional[int], seqlen_k: Optional[int]) -> Tuple[int, int]:
    if startend is not None:
        sk = startend.shape[2]
        if seqlen_k is not None and int(seqlen_k) != sk:
            raise ValueError(f"seqlen_k={seqlen_k} but startend_row_indices has Sk={sk}")
    elif seqlen_k is None:
        raise ValueError("seqlen_k is required when startend_row_indices is None")
    else:
        sk = int(seqlen_k)
    sq = sk if seqlen_q is None else int(seqlen_q)
    return sq, sk


def slice_rows(startend_row_indices: Optional[torch.Tensor], causal: bool, r0: int, r1: int,
               seqlen_q: Optional[int] = None, seqlen_k: Optional[int] = None,
               device=None) -> Optional[torch.Tensor]:
    """The mask of the query rows ``[r0, r1)`` against all keys, as a **non-causal** mask.

    Args:
        startend_row_indices: int32 ``[B, Hm, Sk, C]`` (or ``None``) for ``causal``.
        causal: how the global mask is read (docs/format.md; bottom-right aligned if Sq != Sk).
        r0, r1: the block of global query rows, ``0 <= r0 <= r1 <= Sq``.
        seqlen_q: global Sq (default Sk). seqlen_k: needed only when the mask is ``None``.
        device: where a mask built from ``None`` goes (default: the mask's device, else CPU).

    Returns:
        int32 ``[B, Hm, Sk, C']`` to use with ``causal=False`` and ``Sq = r1 - r0`` local rows
        (``[1, 1, Sk, 2]`` for a causal ``None``), or ``None`` (non-causal without a mask).
        Row ``i'`` of the block attends key ``j`` exactly when global row ``r0 + i'`` does.
    """
    sq, sk = _sizes(startend_row_indices, seqlen_q, seqlen_k)
    r0, r1 = int(r0), int(r1)
    if not 0 <= r0 <= r1 <= sq:
        raise ValueError(f"need 0 <= r0 <= r1 <= Sq={sq}, got r0={r0}, r1={r1}")
    n = r1 - r0
    if startend_row_indices is None and not causal:
        return None
    dev = startend_row_indices.device if startend_row_indices is not None else device

    def c(x):
        return (x.to(torch.int64) - r0).clamp_(0, n)

    cols = []
    if causal:
        j = torch.arange(sk, device=dev, dtype=torch.int64)
        ute = (j - (sk - sq) - r0).clamp_(0, n)  # the causal triangle: global rows < j - off
        if startend_row_indices is None:
            cols = [torch.full_like(ute, n), ute]
            return torch.stack(cols, -1).to(torch.int32).view(1, 1, sk, 2)
        iv = unpack(startend_row_indices, True)
        ute = ute.expand_as(iv.lts)
        if iv.lte is None:
            cols = [c(iv.lts), ute]
        else:
            cols = [c(iv.lts), c(iv.lte), torch.zeros_like(ute), ute]
    else:
        cols = [c(x) for x in startend_row_indices.unbind(-1)]
    return torch.stack(cols, -1).to(torch.int32)


def visible_pairs(local: Optional[torch.Tensor], n: int, sk: int) -> torch.Tensor:
    """Unmasked (row, key) pairs of a non-causal mask over ``n`` rows, summed per (batch, head).

    ``local`` is int32 ``[B, Hm, Sk, C]`` non-causal (C=2 or 4) with values in ``[0, n]``, or
    ``None`` (all ``n * sk`` pairs). Returns int64 ``[B, Hm]`` (``[1, 1]`` for ``None``). Exact,
    O(B * Hm * Sk): per column, ``n`` minus the size of the union of its masked intervals.
    """
    if local is None:
        return torch.full((1, 1), n * sk, dtype=torch.int64)
    x = local.to(torch.int64).clamp(0, n)
    if x.shape[-1] == 2:  # [LTS, n) and [0, UTE)
        lts, ute = x[..., 0], x[..., 1]
        masked = torch.where(ute >= lts, torch.full_like(lts, n), ute + (n - lts))
    elif x.shape[-1] == 4:  # [LTS, LTE) and [UTS, UTE)
        a, b, cc, d = x.unbind(-1)
        l1, l2 = (b - a).clamp(min=0), (d - cc).clamp(min=0)
        overlap = (torch.minimum(b, d) - torch.maximum(a, cc)).clamp(min=0)
        masked = l1 + l2 - overlap
    else:
        raise ValueError(f"visible_pairs takes a non-causal mask (C=2 or 4), got C={x.shape[-1]}")
    return (n - masked).sum(-1)


def block_pairs(startend_row_indices: Optional[torch.Tensor], causal: bool, bounds: Sequence[Tuple[int, int]],
                seqlen_q: Optional[int] = None, seqlen_k: Optional[int] = None) -> torch.Tensor:
    """Exact unmasked pairs of each block of query rows, summed over batch and mask heads.

    ``bounds`` lists ``(r0, r1)`` blocks. Returns int64 ``[len(bounds)]`` on the CPU (one host
    read). O(len(bounds) * B * Hm * Sk).

    Example::

        >>> block_pairs(None, True, [(0, 2), (2, 4)], seqlen_k=4).tolist()   # causal 4x4: 1+2 | 3+4
        [3, 7]
    """
    sq, sk = _sizes(startend_row_indices, seqlen_q, seqlen_k)
    out = []
    for r0, r1 in bounds:
        local = slice_rows(startend_row_indices, causal, r0, r1, sq, sk)
        out.append(visible_pairs(local, r1 - r0, sk).sum())
    return torch.stack(out).cpu() if out else torch.zeros(0, dtype=torch.int64)
