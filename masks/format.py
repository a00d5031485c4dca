"""The FlashMask column-interval format: unpacking, validation and dense expansion.

``startend_row_indices`` is an int32 tensor ``[B, Hm, Sk, C]``. Column ``j`` lists the query
rows that may NOT attend key ``j`` as up to two half-open row intervals:

===========  ===  ======================  ==========================================
causal       C    vectors                 rows masked in key column j
===========  ===  ======================  ==========================================
True         1    LTS                     ``[LTS, Sq)`` plus the causal triangle
True         2    LTS, LTE                ``[LTS, LTE)`` plus the causal triangle
False        2    LTS, UTE                ``[LTS, Sq)`` and ``[0, UTE)``
False        4    LTS, LTE, UTS, UTE      ``[LTS, LTE)`` and ``[UTS, UTE)``
===========  ===  ======================  ==========================================

Causal with ``Sq != Sk`` is aligned bottom-right: query ``i`` sees key ``j`` iff
``j <= i + Sk - Sq``. Values outside ``[0, Sq]`` act as if clamped to it and an interval whose
start is past its end is empty (row ``i`` is masked by ``[start, end)`` iff ``start <= i < end``);
``validate`` rejects both. The contract for users, with worked examples and pictures, is
docs/format.md.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

_VALID_C = {True: (1, 2), False: (2, 4)}


class Intervals(NamedTuple):
    """The masked row intervals of every key column, each ``[B, Hm, Sk]`` (None = absent).

    Rows in ``[lts, lte)`` and in ``[uts, ute)`` are masked; ``lte is None`` means "to the
    last row", ``uts is None`` means "from row 0".
    """

    lts: torch.Tensor
    lte: Optional[torch.Tensor]
    uts: Optional[torch.Tensor]
    ute: Optional[torch.Tensor]


def check_columns(num_columns: int, causal: bool) -> None:
    """Raise if ``C`` is not allowed for this causal mode."""
    if num_columns not in _VALID_C[bool(causal)]:
        allowed = " or ".join(str(c) for c in _VALID_C[bool(causal)])
        raise ValueError(
            f"startend_row_indices has C={num_columns} columns in its last dimension, but "
            f"causal={bool(causal)} needs C={allowed} (causal: LTS or LTS,LTE; "
            f"non-causal: LTS,UTE or LTS,LTE,UTS,UTE)")


def _check_shape(startend_row_indices: torch.Tensor, causal: bool) -> int:
    """Raise unless the tensor is ``[B, Hm, Sk, C]`` with a ``C`` this causal mode allows; returns ``C``."""
    if startend_row_indices.dim() != 4:
        raise ValueError(
            "startend_row_indices must have 4 dimensions [B, Hm, Sk, C], got shape "
            f"{tuple(startend_row_indices.shape)}")
    c = startend_row_indices.shape[-1]
    check_columns(c, causal)
    return c


def check_tensor(startend_row_indices, *, batch_size: Optional[int] = None,
                 name: str = "startend_row_indices") -> None:
    """The rule for a mask tensor, the same at every entry point (``flashmask_attention``, the
    modules, the Hugging Face and context-parallel backends, :func:`to_dense`, :func:`validate`).

    A ``torch.Tensor`` of dtype ``torch.int32`` with 4 dimensions ``[B, Hm, Sk, C]`` and, where the
    inputs' batch is known, ``B`` equal to it: no dtype conversion, no broadcasting over the batch.
    Raises naming ``name``, the value and what was expected; no device sync.
    """
    t = startend_row_indices
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be torch.int32, got {t.dtype} (row indices: convert integer masks "
                         "with .to(torch.int32))")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions [B, Hm, Sk, C], got shape {tuple(t.shape)}")
    if batch_size is not None and t.shape[0] != batch_size:
        raise ValueError(f"{name} has batch {t.shape[0]} but the inputs have batch {batch_size}: the mask needs "
                         f"one row per sample (e.g. .expand({batch_size}, -1, -1, -1))")


def unpack(startend_row_indices: torch.Tensor, causal: bool) -> Intervals:
    """Split ``[B, Hm, Sk, C]`` into its named vectors for the given causal mode."""
    c = _check_shape(startend_row_indices, causal)
    cols = startend_row_indices.unbind(-1)
    if causal:
        return Intervals(cols[0], cols[1] if c == 2 else None, None, None)
    if c == 2:
        return Intervals(cols[0], None, None, cols[1])
    return Intervals(cols[0], cols[1], cols[2], cols[3])


def to_dense(startend_row_indices: Optional[torch.Tensor], causal: bool, seqlen_q: Optional[int] = None,
             seqlen_k: Optional[int] = None, rows: Optional[slice] = None) -> torch.Tensor:
    """Expand the column intervals into a boolean ``[B, Hm, Sq, Sk]`` mask (True = attends).

    For tests, pictures and the reference path only: it is O(Sq * Sk). ``seqlen_q`` defaults to
    ``Sk``; ``rows`` restricts the result to a slice of query rows, so that a caller can expand a
    large mask a chunk at a time. With ``startend_row_indices=None`` the mask is ``[1, 1, Sq, Sk]``
    and holds only the causal triangle (``seqlen_k`` is then required). The mask tensor must
    follow :func:`check_tensor` (int32, ``[B, Hm, Sk, C]``), as everywhere else.

    Example::

        >>> lts = torch.tensor([3, 4, 5, 6, 7, 8, 9, 10, 10, 10], dtype=torch.int32)
        >>> to_dense(lts.view(1, 1, 10, 1), causal=True)[0, 0, 4].int().tolist()
        [0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    """
    if startend_row_indices is None:
        if seqlen_k is None:
            raise ValueError("to_dense needs seqlen_k when startend_row_indices is None")
        sk = seqlen_k
        device = None
    else:
        check_tensor(startend_row_indices)
        sk = startend_row_indices.shape[2]
        if seqlen_k is not None and seqlen_k != sk:
            raise ValueError(f"seqlen_k={seqlen_k} but startend_row_indices has Sk={sk}")
        device = startend_row_indices.device
    sq = sk if seqlen_q is None else int(seqlen_q)
    r0, r1, _ = (rows or slice(0, sq)).indices(sq)
    i = torch.arange(r0, r1, device=device).view(-1, 1)  # query rows
    j = torch.arange(sk, device=device).view(1, -1)  # key columns
    allowed = torch.ones(r1 - r0, sk, dtype=torch.bool, device=device)
    if causal:
        allowed &= j <= i + (sk - sq)
    if startend_row_indices is None:
        return allowed.view(1, 1, r1 - r0, sk)
    iv = unpack(startend_row_indices, causal)
    col = lambda t: t.unsqueeze(2)  # [B, Hm, 1, Sk], broadcast against rows
    masked = (i >= col(iv.lts)) & (True if iv.lte is None else i < col(iv.lte))
    if iv.ute is not None:
        masked = masked | ((True if iv.uts is None else i >= col(iv.uts)) & (i < col(iv.ute)))
    return allowed & ~masked


def validate(startend_row_indices: torch.Tensor, causal: bool, seqlen_q: Optional[int] = None, *,
             batch_size: Optional[int] = None, num_heads_q: Optional[int] = None,
             num_heads_k: Optional[int] = None, seqlen_k: Optional[int] = None,
             check_values: bool = True) -> None:
    """Check a ``startend_row_indices`` tensor; raise ``ValueError`` naming what is wrong.

    Checks :func:`check_tensor` (int32, 4-D, ``B`` against ``batch_size``), ``C`` against
    ``causal``, ``Hm`` (1, Hk or Hq) and ``Sk`` against the given sizes and, with
    ``check_values``, that every value lies in ``[0, Sq]`` and that ``LTS <= LTE`` and ``UTS <= UTE``;
    a value error names the first bad
    (batch, head, column). The value check of a valid mask reads one flag back to the host (one
    device sync).
    """
    t = startend_row_indices
    check_tensor(t, batch_size=batch_size)
    _check_shape(t, causal)  # not unpack: its views cost host time on every attention call
    b, hm, sk, _ = t.shape
    if seqlen_k is not None and sk != seqlen_k:
        raise ValueError(f"startend_row_indices has Sk={sk} columns but the keys have length {seqlen_k}")
    if num_heads_q is not None and hm not in (1, num_heads_q, num_heads_k):
        allowed_h = sorted({1, num_heads_q} | ({num_heads_k} if num_heads_k is not None else set()))
        raise ValueError(
            f"startend_row_indices has {hm} mask heads; it must be one of {allowed_h} "
            f"(1, the number of key heads, or the number of query heads)")
    if not check_values or t.numel() == 0:
        return
    sq = sk if seqlen_q is None else int(seqlen_q)
    iv = unpack(t, causal)
    names = ("LTS", "LTE") if causal else (("LTS", "UTE") if t.shape[-1] == 2 else ("LTS", "LTE", "UTS", "UTE"))
    bad = (t < 0) | (t > sq)
    pairs = [(lo, hi, what) for lo, hi, what in ((iv.lts, iv.lte, "LTS <= LTE"), (iv.uts, iv.ute, "UTS <= UTE"))
             if lo is not None and hi is not None]
    flags = [bad.any()] + [(lo > hi).any() for lo, hi, _ in pairs]
    if not bool(torch.stack(flags).any()):  # the one read-back (device sync) of a valid mask
        return
    if bad.any():
        _raise_first(bad.any(-1), f"values must lie in [0, Sq={sq}]", t, names)
    for lo, hi, what in pairs:
        if (lo > hi).any():
            _raise_first(lo > hi, f"each column needs {what}", t, names)


def _raise_first(bad: torch.Tensor, what: str, t: torch.Tensor, names) -> None:
    b, h, j = (int(x) for x in bad.nonzero()[0])
    vals = ", ".join(f"{n}={int(v)}" for n, v in zip(names, t[b, h, j].tolist()))
    raise ValueError(f"startend_row_indices is invalid at batch {b}, head {h}, column {j} ({vals}): {what}")
