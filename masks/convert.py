"""Conversions into the column-interval format: from a dense mask, and from flash-attn windows.

* ``from_dense``: boolean mask (True = attends) -> ``startend_row_indices`` with the smallest
  ``C`` that expresses it, or a ``ValueError`` naming the first column that cannot be expressed.
* ``window_to_startend``: flash-attn ``window_size=(left, right)`` -> indices (C=1 causal, C=2
  otherwise).
* ``merge_window``: intersect existing indices with such a window.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import _intervals
from ._spec import check_batch_size, is_int
from .format import unpack
from .packed import document_starts, from_starts


def from_dense(mask: torch.Tensor, causal: bool, num_columns: Optional[int] = None) -> torch.Tensor:
    """Convert a bool mask ``[B, H, Sq, Sk]`` or ``[Sq, Sk]`` (True = attends) to int32 ``[B, H, Sk, C]``.

    ``C`` is the smallest that expresses every column (causal: 1 then 2; non-causal: 2 then 4)
    unless ``num_columns`` fixes it. A causal mask must not attend above the (bottom-right
    aligned) diagonal. ``to_dense(from_dense(m, causal), causal, Sq) == m``. O(B*H*Sq*Sk).
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a torch.bool tensor (True = attends), got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)}")
    if mask.dim() == 2:
        mask = mask[None, None]
    if mask.dim() != 4:
        raise ValueError(f"mask must be [B, H, Sq, Sk] or [Sq, Sk], got shape {tuple(mask.shape)}")
    sq, sk = mask.shape[-2:]
    masked = ~mask
    leak = None  # causal: columns attended above the diagonal, which no C can express
    if causal:
        i = torch.arange(sq, device=mask.device).view(-1, 1)
        above = torch.arange(sk, device=mask.device).view(1, -1) > i + (sk - sq)  # the causal triangle
        leak = (mask & above).any(2)
        masked = masked & ~above  # the causal flag masks the triangle; only the rest is encoded
    runs = _intervals.runs_of_dense(masked)

    def describe(b, h, j):
        if leak is not None and bool(leak[b, h, j]):
            row = int((mask[b, h, :, j] & above[:, j]).nonzero()[0])
            return f"it is attended by row {row}, above the causal diagonal (use causal=False)"
        col = masked[b, h, :, j].tolist()
        spans, start = [], None
        for r, m in enumerate(col + [False]):
            if m and start is None:
                start = r
            elif not m and start is not None:
                spans.append(f"[{start}, {r})")
                start = None
        where = " below the diagonal" if causal else ""
        return (f"its masked rows{where} form {len(spans)} run(s) "
                f"{', '.join(spans[:4])}{' ...' if len(spans) > 4 else ''}")

    return _intervals.encode(runs, causal, num_columns, sq, describe, leak)


def _window(window_size) -> tuple:
    if (not isinstance(window_size, Sequence) or len(window_size) != 2
            or any(not is_int(w) or w < -1 for w in window_size)):
        raise ValueError("window_size must be a pair (left, right) of ints >= -1 (-1 = unbounded), "
                         f"got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def window_to_startend(window_size, seqlen_q: int, seqlen_k: int, causal: bool, batch_size: int = 1,
                       device=None) -> torch.Tensor:
    """flash-attn local attention as indices ``[batch_size, 1, Sk, C]``.

    Query i attends key j iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (a bound of -1 is
    unbounded); causal forces ``right = 0`` and gives C=1 (LTS), non-causal gives C=2 (LTS, UTE).
    """
    left, right = _window(window_size)
    for n, v in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{n} must be a positive int, got {v!r}")
    bsz = check_batch_size(batch_size)
    d = torch.arange(seqlen_k, device=device) - (seqlen_k - seqlen_q)  # row where key j is on the diagonal
    # Key j is seen by rows d - right .. d + left.
    lts = (d + left + 1).clamp(0, seqlen_q) if left >= 0 else torch.full_like(d, seqlen_q)
    cols = [lts]
    if not causal:
        cols.append((d - right).clamp(0, seqlen_q) if right >= 0 else torch.zeros_like(d))
    return torch.stack(cols, -1).to(torch.int32).expand(bsz, 1, seqlen_k, len(cols)).contiguous()


def merge_window(startend_row_indices: Optional[torch.Tensor], causal: bool, window_size, seqlen_q: int, *,
                 seqlen_k: Optional[int] = None) -> torch.Tensor:
    """Intersect a mask with the flash-attn window ``window_size`` (rows masked by either stay masked).

    ``None`` gives the window alone (``seqlen_k`` defaults to ``seqlen_q``). Causal C=1:
    ``LTS = min(LTS, window LTS)``; non-causal C=2: ``LTS = min``, ``UTE = max``; these always fit.
    Causal C=2 and non-causal C=4 are merged column by column where the union of the masked rows
    still fits the same C (the result is then re-canonicalised); otherwise ``ValueError`` naming
    the first column that cannot be expressed. Returns int32 with the input's C.
    """
    if startend_row_indices is None:
        return window_to_startend(window_size, seqlen_q, seqlen_k or seqlen_q, causal)
    t = startend_row_indices
    if seqlen_k is not None and seqlen_k != t.shape[2]:
        raise ValueError(f"seqlen_k={seqlen_k} but startend_row_indices has Sk={t.shape[2]}")
    w = window_to_startend(window_size, seqlen_q, t.shape[2], causal, device=t.device)[0, 0]  # [Sk, C']
    return _merge_bounds(t, causal, w[:, 0], None if causal else w[:, 1], int(seqlen_q),
                         lambda b, j: f"the window's {w[j].tolist()}")


def merge_chunks(startend_row_indices: Optional[torch.Tensor], chunk_size: int, seqlen: int,
                 position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Intersect a causal mask (``Sq = Sk = seqlen``) with chunked attention (Llama 4): a token sees
    only the earlier tokens of its chunk, chunks of ``chunk_size`` positions counted from each
    document's first token (position 0). ``position_ids`` ``[B, S]`` (or ``[S]``): the tokens'
    positions in their documents (packed rows restart them; a chunk also ends wherever they do not
    grow by exactly 1); default ``0 .. S-1``.

    ``None`` gives the chunks alone (int32 ``[B, 1, S, 1]``). C=1 always fits; a C=2 causal mask is
    merged where each column's masked rows still form one run besides the chunk's, else
    ``ValueError`` naming the column. Returns int32 with the input's C (and the positions' batch).
    """
    if not is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    device = startend_row_indices.device if startend_row_indices is not None else (
        position_ids.device if position_ids is not None else None)
    j = torch.arange(seqlen, device=device)
    pos = j[None] if position_ids is None else position_ids.reshape(-1, position_ids.shape[-1]).to(device)
    if pos.shape[-1] != seqlen:
        raise ValueError(f"position_ids has {pos.shape[-1]} tokens, expected seqlen={seqlen}")
    # [B, 1, S]: the row where a key's chunk ends: chunk_size positions on, or where the positions restart
    doc_end = from_starts(document_starts(pos), True)[:, :, :, 0]
    end = torch.minimum(j - pos % chunk_size + chunk_size, doc_end[:, 0])[:, None, :]
    if startend_row_indices is None:
        return end.unsqueeze(-1).to(torch.int32)
    t = startend_row_indices
    if t.shape[2] != seqlen:
        raise ValueError(f"startend_row_indices has Sk={t.shape[2]}, expected seqlen={seqlen}")
    if t.shape[0] != end.shape[0]:
        if min(t.shape[0], end.shape[0]) != 1:
            raise ValueError(f"startend_row_indices has batch {t.shape[0]} but position_ids {end.shape[0]}")
        b = max(t.shape[0], end.shape[0])
        t, end = t.expand(b, -1, -1, -1), end.expand(b, -1, -1)
    return _merge_bounds(t, True, end, None, seqlen, lambda b, j: f"the chunk's end row {int(end[b, 0, j])}")


def _merge_bounds(t: torch.Tensor, causal: bool, lower: torch.Tensor, upper: Optional[torch.Tensor], sq: int,
                  bound_text) -> torch.Tensor:
    """The mask ``t`` with, in every key column j, the rows ``>= lower[..., j]`` (and, non-causal, the
    rows ``< upper[..., j]``) masked too; ``lower`` / ``upper`` broadcast against ``[B, Hm, Sk]``."""
    iv = unpack(t, causal)
    sk, c = t.shape[2], t.shape[3]
    if causal and c == 1:
        return torch.minimum(t[..., 0], lower).unsqueeze(-1).to(torch.int32)
    if not causal and c == 2:
        return torch.stack([torch.minimum(iv.lts, lower), torch.maximum(iv.ute, upper)], -1).to(torch.int32)
    full = torch.full_like(iv.lts, sq)
    if causal:  # clip to the rows below the diagonal, which the flag does not already mask
        d = (torch.arange(sk, device=t.device) - (sk - sq)).clamp(0, sq)
        lo = torch.stack([torch.maximum(iv.lts, d), torch.maximum(lower, d).expand_as(iv.lts)], -1)
        hi = torch.stack([iv.lte, full], -1)
    else:
        zero = torch.zeros_like(iv.lts)
        lo = torch.stack([iv.lts, iv.uts, lower.expand_as(zero), zero], -1)
        hi = torch.stack([iv.lte, iv.ute, full, upper.expand_as(zero)], -1)
    runs = _intervals.runs_of_union(lo, hi)

    def describe(b, h, j):
        return (f"the mask's masked rows {t[b, h, j].tolist()} and {bound_text(b, j)} together form "
                f"{int(runs.count[b, h, j])} separate runs")

    return _intervals.encode(runs, causal, c, sq, describe)
