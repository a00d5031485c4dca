"""Document masks for packed sequences, from ``cu_seqlens`` or from restarting ``position_ids``.

Padding-free collators (Hugging Face ``DataCollatorWithFlattening``, TRL ``padding_free=True``)
concatenate documents into one row and emit either cumulative lengths ``cu_seqlens`` (as
flash-attn varlen takes) or ``position_ids`` that restart at each document. Both become the
causal-document (C=1: LTS = doc end) or document (C=2: LTS = doc end, UTE = doc start) format.

The packed-sequence rule lives here and only here (the Hugging Face backend and the
context-parallel batch sharding call these functions): a new document starts at token 0 and
wherever the position id does not grow by exactly 1 from the previous token, as transformers'
``masking_utils.find_packed_sequence_indices`` decides; ``cu_seqlens`` give the boundaries
directly. See docs/format.md, "Packed sequences".

Example::

    >>> from_cu_seqlens(torch.tensor([0, 4, 7, 10]))[0, 0, :, 0].tolist()
    [4, 4, 4, 4, 7, 7, 7, 10, 10, 10]
    >>> from_position_ids(torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]))[0, 0, :, 0].tolist()
    [4, 4, 4, 4, 7, 7, 7, 10, 10, 10]
    >>> document_starts(torch.tensor([0, 1, 2, 5, 6, 7])).int().tolist()  # a jump starts a document
    [[1, 0, 0, 1, 0, 0]]
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ._spec import finish, is_int


def from_cu_seqlens(cu_seqlens: torch.Tensor, causal: bool = True, seqlen: Optional[int] = None, device=None,
                    *, validate: bool = True) -> torch.Tensor:
    """int32 ``[1, 1, S, C]`` for one packed row whose documents are ``[cu[k], cu[k+1])``.

    ``cu_seqlens`` is 1-D, starts at 0 and never decreases. ``seqlen`` defaults to ``cu[-1]``; a
    longer ``seqlen`` makes the tokens after ``cu[-1]`` one more document (e.g. padding).
    Reads ``cu_seqlens`` on the host once for the checks.
    """
    vals = check_cu_seqlens(cu_seqlens)
    cu = torch.as_tensor(cu_seqlens)
    cu = cu.to(device=device if device is not None else cu.device, dtype=torch.long)
    s = vals[-1] if seqlen is None else seqlen
    if not is_int(s) or s < 1 or s < vals[-1]:
        raise ValueError(f"seqlen must be a positive int >= cu_seqlens[-1]={vals[-1]}, got {s!r}")
    return from_starts(cu_seqlens_starts(cu, 1, s), causal, validate=validate)


def from_cu_seqlens_qk(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool = True,
                       window_size=None, device=None, *, validate: bool = True) -> torch.Tensor:
    """int32 ``[1, 1, Sk, 2]`` for packed queries and keys with documents of their own lengths, as
    flash-attn varlen takes them: document ``i`` is query rows ``[cu_q[i], cu_q[i+1])`` against keys
    ``[cu_k[i], cu_k[i+1])``; ``Sq = cu_q[-1]``, ``Sk = cu_k[-1]``.

    Within a document of ``lq`` queries and ``lk`` keys, query ``r`` sees key ``o`` (both counted from
    the document's start) iff ``r + lk - lq - left <= o <= r + lk - lq + right`` (flash-attn's
    ``window_size=(left, right)``, ``-1`` unbounded), each document's window and causal triangle
    aligned bottom-right; ``causal`` sets ``right = 0``. The result is the non-causal (LTS, UTE) form:
    pass it with ``causal=False``. With equal query and key documents, :func:`from_cu_seqlens`
    (and :func:`masks.merge_window`) give the same mask in the compact causal form.

    Example: two documents of 2 queries against 3 and 1 keys, causal::

        >>> from_cu_seqlens_qk(torch.tensor([0, 2, 4]), torch.tensor([0, 3, 4]))[0, 0].tolist()
        [[2, 0], [2, 0], [2, 1], [4, 3]]
    """
    from .convert import _window

    vq = check_cu_seqlens(cu_seqlens_q, name="cu_seqlens_q")
    vk = check_cu_seqlens(cu_seqlens_k, name="cu_seqlens_k")
    if len(vq) != len(vk):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must list the same documents, got {len(vq) - 1} and "
                         f"{len(vk) - 1}")
    if vq[-1] < 1 or vk[-1] < 1:
        raise ValueError(f"need at least one query and one key, got cu_seqlens_q[-1]={vq[-1]}, "
                         f"cu_seqlens_k[-1]={vk[-1]}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    left, right = (-1, -1) if window_size is None else _window(window_size)
    if causal:
        right = 0
    if device is None:
        device = torch.as_tensor(cu_seqlens_k).device
    cq = torch.tensor(vq, dtype=torch.long, device=device)
    ck = torch.tensor(vk, dtype=torch.long, device=device)
    j = torch.arange(vk[-1], device=device)
    doc = torch.searchsorted(ck[1:], j, right=True)  # key j's document (empty documents skipped)
    lq = cq[doc + 1] - cq[doc]
    diag = j - ck[doc] - (ck[doc + 1] - ck[doc] - lq)  # the row offset where key j is on the diagonal
    first = (diag - right) if right >= 0 else torch.zeros_like(diag)
    stop = (diag + left + 1) if left >= 0 else lq
    zero = torch.zeros_like(lq)
    ute = cq[doc] + torch.minimum(torch.maximum(first, zero), lq)
    lts = cq[doc] + torch.minimum(torch.maximum(stop, zero), lq)
    return finish([lts[None], ute[None]], False, vq[-1], validate)


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: Optional[int] = None, name: str = "cu_seqlens") -> List[int]:
    """Raise ``ValueError`` unless ``cu_seqlens`` is a 1-D integer tensor that starts at 0, never
    decreases (a repeat is an empty document) and, when ``total`` is given, ends exactly at
    ``total`` (every token in one document). Returns the values (read on the host: one sync)."""
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor [n_docs + 1], got {cu.dtype} {tuple(cu.shape)}")
    vals = cu.tolist()
    shown = f"{vals[:8]}{'...' if len(vals) > 8 else ''}"
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {shown}")
    for k, (a, b) in enumerate(zip(vals, vals[1:])):
        if b < a:
            raise ValueError(f"{name} must be non-decreasing, got {shown} ({name}[{k + 1}]={b} < {name}[{k}]={a})")
    if total is not None and vals[-1] != total:
        where = "runs past" if vals[-1] > total else "stops before"
        raise ValueError(f"{name} must end at the number of tokens B * S = {total}, got {name}[-1]={vals[-1]} "
                         f"({where} the end of the batch): {shown}")
    return vals


def cu_seqlens_starts(cu_seqlens: torch.Tensor, batch_size: int, seqlen: int, device=None) -> torch.Tensor:
    """bool ``[B, S]``, True where a packed document starts, from ``cu_seqlens`` over the flattened
    ``B * S`` tokens (documents ``[cu[k], cu[k+1])``, as flash-attn varlen takes them).

    Every row starts a document too: a document never crosses a row boundary. Tokens after
    ``cu[-1]`` form one more document; boundaries past ``B * S`` are ignored. Vectorised, no host
    sync (the callers check the values where they must).
    """
    total = batch_size * seqlen
    cu = torch.as_tensor(cu_seqlens)
    cu = cu.to(device=device if device is not None else cu.device, dtype=torch.long).reshape(-1)
    flat = torch.zeros(total + 1, dtype=torch.bool, device=cu.device)
    flat[cu.clamp(0, total)] = True
    starts = flat[:total].view(batch_size, seqlen).clone()
    starts[:, 0] = True
    return starts


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """bool ``[B, S]``, True where a packed document starts, from ``position_ids`` ``[B, S]`` or ``[S]``.

    Token 0 starts a document, and so does every token whose position is not the previous one's
    plus 1 (transformers' ``find_packed_sequence_indices`` rule): ``[0, 1, 2, 5, 6, 7]`` is two
    documents, ``[0, 1, 2, 0, 1]`` two, ``[3, 4, 5]`` one. Vectorised, no host sync.
    """
    pos = torch.as_tensor(position_ids)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2 or pos.shape[1] < 1 or pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise ValueError(f"position_ids must be an integer tensor [B, S], got {pos.dtype} {tuple(pos.shape)}")
    first = torch.ones_like(pos[:, :1], dtype=torch.bool)
    return torch.cat([first, pos[:, 1:] != pos[:, :-1] + 1], 1)


def from_starts(starts: torch.Tensor, causal: bool = True, *, validate: bool = False) -> torch.Tensor:
    """int32 ``[B, 1, S, C]`` document mask from bool "a document starts here" flags ``[B, S]``.

    Causal: LTS = end of the token's document (C=1). Non-causal: (LTS, UTE) = (document end,
    document start) (C=2). ``starts[:, 0]`` is taken as True.
    """
    bsz, s = starts.shape
    starts = starts.clone()
    starts[:, 0] = True
    t = torch.arange(s, device=starts.device).expand(bsz, s)
    start = torch.where(starts, t, 0).cummax(1).values  # latest document start at or before t
    nxt = torch.where(starts, t, s)[:, 1:]  # the next start after t: suffix minimum
    nxt = torch.cat([nxt, nxt.new_full((bsz, 1), s)], 1)
    end = nxt.flip(1).cummin(1).values.flip(1)
    return finish([end] if causal else [end, start], causal, s, validate)


def from_position_ids(position_ids: torch.Tensor, causal: bool = True, *, validate: bool = True) -> torch.Tensor:
    """int32 ``[B, 1, S, C]`` from ``position_ids`` ``[B, S]`` (or ``[S]``) of packed rows.

    Documents as :func:`document_starts` finds them: a new one wherever the position does not
    grow by exactly 1, so ``[0, 1, 2, 0, 1]`` and ``[0, 1, 2, 5, 6]`` are both two documents.
    Fully vectorised (cummax / reversed cummin), no host sync.
    """
    return from_starts(document_starts(position_ids), causal, validate=validate)
