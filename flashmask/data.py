"""Collators that pack training samples into rows with a FlashMask mask (no dense mask anywhere).

Two collators, both callable on a list of tokenized samples (e.g. as a ``DataLoader``
``collate_fn``) and both returning a dict of tensors whose ``attn_mask_startend_row_indices``,
``position_ids`` and ``input_ids`` go straight into a Hugging Face model running the
``"fm_colmask"`` backend (:mod:`flashmask.integrations.transformers`) or into
:func:`flashmask.flashmask_attention`:

* :class:`PackedSFTCollator`: supervised fine-tuning. Documents are packed into rows of at most
  ``max_length`` tokens; each attends causally to itself only (causal-document mask,
  ``LTS[j] = end of j's document``); ``position_ids`` restart at 0 in every document; the label
  of each document's first token is ``-100`` so that no token is trained to predict across a
  document boundary (transformers shifts labels inside the loss: logits at ``t`` predict
  ``labels[t + 1]``).
* :class:`ShareQuestionCollator`: DPO and reward models. Each sample is a prompt with a chosen
  and a rejected response laid out as ``[prompt | chosen | rejected]`` in one sequence, so the
  prompt is encoded once. Rejected tokens cannot see chosen tokens, and the positions of both
  responses continue from the prompt, so every response token sees exactly what it would see in
  its own ``prompt + response`` sequence. Several such triples can be packed into one row.
  :func:`shared_sequence_logps` turns the model's logits into the per-sample log-probabilities
  DPO needs; :func:`response_end_values` picks the per-sample scores a reward model needs.

Padding (appended at the end of a row) forms one extra segment that attends only to itself:
no real token ever sees a padding token or loses sight of a real one, and padding carries label
``-100`` (so the outputs at real tokens are exactly those of an unpadded row).

Example::

    >>> from flashmask.data import PackedSFTCollator
    >>> collate = PackedSFTCollator(max_length=8, pad_token_id=0)
    >>> batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [1, 2, 3, 4]}])
    >>> batch["input_ids"].tolist()      # best-fit decreasing: [4-doc, 3-doc] then [2-doc] + padding
    [[1, 2, 3, 4, 5, 6, 7], [8, 9, 0, 0, 0, 0, 0]]
"""
from __future__ import annotations

import bisect
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from flashmask.losses import IGNORE_INDEX

MASK_KEY = "attn_mask_startend_row_indices"
PACKING_STRATEGIES = ("bfd", "sequential", "none")

__all__ = ["IGNORE_INDEX", "MASK_KEY", "pack_sequences", "PackedSFTCollator", "ShareQuestionCollator",
           "shared_sequence_logps", "response_end_values", "logp_positions", "model_inputs"]


# --------------------------------------------------------------------------------------------------
# packing


def pack_sequences(lengths: Sequence[int], max_length: int, strategy: str = "bfd") -> List[List[int]]:
    """Group sample indices into rows whose lengths sum to at most ``max_length``.

    Args:
        lengths: length of each sample (each ``1 <= length <= max_length``).
        max_length: capacity of a row.
        strategy: ``"bfd"`` (best-fit decreasing: few rows, order not kept), ``"sequential"``
            (next-fit in the given order: a new row whenever the next sample does not fit) or
            ``"none"`` (one sample per row).

    Returns:
        A list of rows, each a list of indices into ``lengths``; every index appears exactly once.

    Example::

        >>> pack_sequences([3, 2, 4], 8)
        [[2, 0], [1]]
        >>> pack_sequences([3, 2, 4], 8, strategy="sequential")
        [[0, 1], [2]]
    """
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"strategy must be one of {PACKING_STRATEGIES}, got {strategy!r}")
    max_length = _positive_int(max_length, "max_length")
    lengths = [int(x) for x in lengths]
    for i, n in enumerate(lengths):
        if n < 1 or n > max_length:
            raise ValueError(f"sample {i} has length {n}; lengths must lie in [1, max_length={max_length}]")
    if strategy == "none":
        return [[i] for i in range(len(lengths))]
    if strategy == "sequential":
        rows, used = [], max_length + 1
        for i, n in enumerate(lengths):
            if used + n > max_length:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += n
        return rows
    # Best-fit decreasing: put each sample (longest first) into the fullest row it fits in.
    rows: List[List[int]] = []
    free: List[Tuple[int, int]] = []  # sorted (remaining capacity, row index)
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        n = lengths[i]
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            rows.append([i])
            bisect.insort(free, (max_length - n, len(rows) - 1))
        else:
            cap, r = free.pop(k)
            rows[r].append(i)
            bisect.insort(free, (cap - n, r))
    return rows


def _positive_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be a positive int, got {x!r}")
    return x


def _as_ids(x, what: str) -> torch.Tensor:
    """A 1-D long tensor of token ids; never rounds a float (``[1.5, 2.0]`` is an error, not ``[1, 2]``)."""
    if isinstance(x, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of ints (token ids), got {type(x).__name__} {x[:40]!r}: "
                        "tokenize the text first")
    if isinstance(x, torch.Tensor):
        t = x
    else:
        try:  # the dtype is inferred, so that floats stay floats and are rejected below
            t = torch.as_tensor(x if hasattr(x, "__array__") else list(x))
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{what} must be a sequence of ints (token ids), got {type(x).__name__} "
                            f"{str(x)[:60]}") from None
    if t.dim() != 1:
        raise ValueError(f"{what} must be a 1-D sequence of token ids, got shape {tuple(t.shape)}")
    if t.numel() and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        odd = t[t != t.round()] if t.dtype.is_floating_point else t
        example = (odd if odd.numel() else t)[0].item()
        raise ValueError(f"{what} must hold integer token ids, got {t.dtype} values such as {example!r}")
    return t.to(torch.long)


def _padded_len(used: int, max_length: int, padding: str, multiple: Optional[int]) -> int:
    s = max_length if padding == "max_length" else max(used, 1)
    if multiple:
        s = int(math.ceil(s / multiple) * multiple)
    return s


def _check_common(max_length, pad_token_id, packing, padding, pad_to_multiple_of):
    _positive_int(max_length, "max_length")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a non-negative int, got {pad_token_id!r}")
    if packing not in PACKING_STRATEGIES:
        raise ValueError(f"packing must be one of {PACKING_STRATEGIES}, got {packing!r}")
    if padding not in ("longest", "max_length"):
        raise ValueError(f"padding must be 'longest' or 'max_length', got {padding!r}")
    if pad_to_multiple_of is not None:
        _positive_int(pad_to_multiple_of, "pad_to_multiple_of")


class _RowLayout:
    """Places segments (documents or triples) given per row into a ``[R, S]`` grid, vectorised.

    ``lens`` are the segment lengths in row order, ``row`` the row of each. Gives per-token flat
    arrays: ``seg`` (segment of the token), ``off`` (offset inside its segment), ``r``/``c`` (its
    row and column), and per segment ``col0`` (first column); ``used`` per row.
    """

    def __init__(self, lens: torch.Tensor, row: torch.Tensor, num_rows: int):
        self.lens, self.row = lens, row
        n = lens.numel()
        first = torch.cumsum(lens, 0) - lens  # flat start of each segment
        self.seg = torch.repeat_interleave(torch.arange(n), lens)
        self.off = torch.arange(int(lens.sum())) - first[self.seg]
        self.used = torch.zeros(num_rows, dtype=torch.long).index_add_(0, row, lens)
        row_first = torch.cumsum(self.used, 0) - self.used  # flat start of each row
        self.col0 = first - row_first[row]
        self.r = row[self.seg]
        self.c = self.col0[self.seg] + self.off
        self.flat_first = first


# --------------------------------------------------------------------------------------------------
# SFT


class PackedSFTCollator:
    """Packs tokenized documents into rows for SFT with a causal-document FlashMask mask.

    Args:
        max_length: tokens per row (the pack length).
        pad_token_id: id written on padding (never attended by real tokens, label ``-100``).
        packing: how documents are grouped into rows, see :func:`pack_sequences`.
        padding: ``"longest"`` (rows as long as the fullest one) or ``"max_length"`` (always
            ``max_length``: fixed shapes).
        pad_to_multiple_of: round the row length up to a multiple of this.
        truncation: cut documents longer than ``max_length`` (keeping the start) instead of
            raising ``ValueError``.

    Each sample is a dict with ``input_ids`` (list or 1-D tensor) and optionally ``labels`` (same
    length, ``-100`` = no loss, unshifted as in transformers) or ``completion_mask`` /
    ``assistant_masks`` (1 = compute the loss on this token); without them every token is a label.

    Returns (``R`` rows, ``S`` columns):

    * ``input_ids`` long ``[R, S]``
    * ``labels`` long ``[R, S]``: ``-100`` on padding and on the first token of every document
    * ``position_ids`` long ``[R, S]``: ``0, 1, ...`` restarting at every document (and padding)
    * ``attn_mask_startend_row_indices`` int32 ``[R, 1, S, 1]``: causal-document mask, for
      ``causal=True``

    Example::

        >>> collate = PackedSFTCollator(max_length=6, packing="sequential")
        >>> b = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
        >>> b["labels"].tolist(), b["position_ids"].tolist()
        ([[-100, 6, 7, -100, 9]], [[0, 1, 2, 0, 1]])
        >>> b["attn_mask_startend_row_indices"][0, 0, :, 0].tolist()
        [3, 3, 3, 5, 5]
    """

    def __init__(self, max_length: int, pad_token_id: int = 0, *, packing: str = "bfd", padding: str = "longest",
                 pad_to_multiple_of: Optional[int] = None, truncation: bool = False):
        _check_common(max_length, pad_token_id, packing, padding, pad_to_multiple_of)
        self.max_length, self.pad_token_id = max_length, pad_token_id
        self.packing, self.padding, self.pad_to_multiple_of = packing, padding, pad_to_multiple_of
        self.truncation = truncation

    def _doc(self, f, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if isinstance(f, dict):
            if "input_ids" not in f:
                raise KeyError(f"sample {i} has no 'input_ids' (keys: {sorted(f)})")
            ids = _as_ids(f["input_ids"], f"sample {i} input_ids")
            if f.get("labels") is not None:
                labels = _as_ids(f["labels"], f"sample {i} labels")
            else:
                m = f.get("completion_mask", f.get("assistant_masks"))
                labels = ids.clone()
                if m is not None:
                    m = torch.as_tensor(m)
                    if m.shape != ids.shape:
                        raise ValueError(f"sample {i}: completion_mask has shape {tuple(m.shape)}, input_ids "
                                         f"{tuple(ids.shape)}")
                    labels[m == 0] = IGNORE_INDEX
        else:
            ids = _as_ids(f, f"sample {i}")
            labels = ids.clone()
        if labels.shape != ids.shape:
            raise ValueError(f"sample {i}: labels has shape {tuple(labels.shape)}, input_ids {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise ValueError(f"sample {i} is empty")
        if ids.numel() > self.max_length:
            if not self.truncation:
                raise ValueError(f"sample {i} has {ids.numel()} tokens > max_length={self.max_length} "
                                 "(pass truncation=True to cut it)")
            ids, labels = ids[:self.max_length], labels[:self.max_length]
        return ids, labels

    def __call__(self, features: Sequence) -> Dict[str, torch.Tensor]:
        """Pack ``features`` into rows with :func:`pack_sequences` and collate them."""
        if len(features) == 0:
            raise ValueError("no samples to collate")
        docs = [self._doc(f, i) for i, f in enumerate(features)]
        rows = pack_sequences([d[0].numel() for d in docs], self.max_length, self.packing)
        return self._collate([[docs[i] for i in row] for row in rows])

    def collate_rows(self, rows: Sequence[Sequence]) -> Dict[str, torch.Tensor]:
        """Collate samples already grouped into rows (each row's lengths must sum to <= max_length)."""
        if len(rows) == 0 or any(len(r) == 0 for r in rows):
            raise ValueError("collate_rows needs a non-empty list of non-empty rows")
        k = 0
        out = []
        for r, row in enumerate(rows):
            docs = []
            for f in row:
                docs.append(self._doc(f, k))
                k += 1
            total = sum(d[0].numel() for d in docs)
            if total > self.max_length:
                raise ValueError(f"row {r} holds {total} tokens > max_length={self.max_length}")
            out.append(docs)
        return self._collate(out)

    def _collate(self, rows: List[List[Tuple[torch.Tensor, torch.Tensor]]]) -> Dict[str, torch.Tensor]:
        docs = [d for row in rows for d in row]
        lens = torch.tensor([d[0].numel() for d in docs], dtype=torch.long)
        row_of = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(r) for r in rows]))
        lay = _RowLayout(lens, row_of, len(rows))
        s = _padded_len(int(lay.used.max()), self.max_length, self.padding, self.pad_to_multiple_of)
        nrows = len(rows)
        ids = torch.cat([d[0] for d in docs])
        labels = torch.cat([d[1] for d in docs])
        labels = torch.where(lay.off == 0, IGNORE_INDEX, labels)  # no prediction across a document boundary

        cols = torch.arange(s)
        input_ids = torch.full((nrows, s), self.pad_token_id, dtype=torch.long)
        out_labels = torch.full((nrows, s), IGNORE_INDEX, dtype=torch.long)
        position_ids = (cols[None, :] - lay.used[:, None]).clamp_min(0)  # padding: its own 0, 1, ...
        lts = torch.full((nrows, s), s, dtype=torch.long)  # padding: one trailing segment
        input_ids[lay.r, lay.c] = ids
        out_labels[lay.r, lay.c] = labels
        position_ids[lay.r, lay.c] = lay.off
        lts[lay.r, lay.c] = (lay.col0 + lens)[lay.seg]
        return {"input_ids": input_ids, "labels": out_labels, "position_ids": position_ids,
                MASK_KEY: lts.to(torch.int32)[:, None, :, None].contiguous()}


# --------------------------------------------------------------------------------------------------
# DPO / reward models: share-question layout

_TRIPLE_KEYS = (("prompt_input_ids", "chosen_input_ids", "rejected_input_ids"),
                ("prompt_ids", "chosen_ids", "rejected_ids"))


class ShareQuestionCollator:
    """Lays out (prompt, chosen, rejected) triples as ``[prompt | chosen | rejected]`` rows.

    Mask (causal, C=1, one triple at columns ``[o, o + P + C + R)``): prompt columns
    ``LTS = o + P + C + R`` (seen by both responses, not by later triples); chosen columns
    ``LTS = o + P + C`` (the start of the rejected span: rejected rows cannot see chosen); rejected
    columns ``LTS = o + P + C + R``. Positions: prompt ``0..P-1``, chosen ``P..P+C-1``, rejected
    ``P..P+R-1``. So every response token sees exactly its prompt and its own response, at the
    positions it would have in a separate ``prompt + response`` sequence.

    Args:
        max_length: tokens per row.
        pad_token_id: id written on padding.
        packing: ``"bfd"`` / ``"sequential"`` pack several triples per row; ``"none"`` puts one
            triple per row.
        padding, pad_to_multiple_of: as in :class:`PackedSFTCollator`.
        truncation: when a triple exceeds ``max_length``, drop prompt tokens from the left (keeping
            at least one), then shorten the responses from the right (keeping at least one token
            each), instead of raising ``ValueError``.

    Each sample is a dict with ``prompt_input_ids``, ``chosen_input_ids``, ``rejected_input_ids``
    (TRL's names) or ``prompt_ids``, ``chosen_ids``, ``rejected_ids``; each non-empty.

    Returns (``R`` rows, ``S`` columns, ``N`` triples):

    * ``input_ids``, ``position_ids`` long ``[R, S]``; ``attn_mask_startend_row_indices`` int32
      ``[R, 1, S, 1]`` (``causal=True``)
    * ``chosen_labels``, ``rejected_labels`` long ``[R, S]``, already shifted: at column ``t`` the
      token whose log-probability under the logits at ``t`` counts for the chosen (rejected)
      response, ``-100`` elsewhere. The last prompt token carries both the first chosen and the
      first rejected token.
    * ``pair_index`` long ``[R, S]``: the triple of each column (``-1`` on padding)
    * ``pair_row`` long ``[N]`` and ``prompt_spans``, ``chosen_spans``, ``rejected_spans`` long
      ``[N, 2]``: row and ``[start, end)`` columns of each triple's parts

    Use :func:`model_inputs` for the model's arguments, :func:`shared_sequence_logps` for DPO and
    :func:`response_end_values` for reward models.

    Example::

        >>> collate = ShareQuestionCollator(max_length=16)
        >>> b = collate([{"prompt_ids": [1, 2, 3, 4], "chosen_ids": [5, 6, 7], "rejected_ids": [8, 9, 10]}])
        >>> b["attn_mask_startend_row_indices"][0, 0, :, 0].tolist()
        [10, 10, 10, 10, 7, 7, 7, 10, 10, 10]
        >>> b["position_ids"].tolist()
        [[0, 1, 2, 3, 4, 5, 6, 4, 5, 6]]
        >>> b["chosen_labels"].tolist(), b["rejected_labels"].tolist()
        ([[-100, -100, -100, 5, 6, 7, -100, -100, -100, -100]], [[-100, -100, -100, 8, -100, -100, -100, 9, 10, -100]])
    """

    def __init__(self, max_length: int, pad_token_id: int = 0, *, packing: str = "bfd", padding: str = "longest",
                 pad_to_multiple_of: Optional[int] = None, truncation: bool = False):
        _check_common(max_length, pad_token_id, packing, padding, pad_to_multiple_of)
        if max_length < 3:
            raise ValueError(f"max_length must be >= 3 (a prompt and two responses), got {max_length}")
        self.max_length, self.pad_token_id = max_length, pad_token_id
        self.packing, self.padding, self.pad_to_multiple_of = packing, padding, pad_to_multiple_of
        self.truncation = truncation

    def _triple(self, f, i: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not isinstance(f, dict):
            raise TypeError(f"sample {i} must be a dict, got {type(f).__name__}")
        for keys in _TRIPLE_KEYS:
            if all(k in f for k in keys):
                break
        else:
            raise KeyError(f"sample {i} needs keys {_TRIPLE_KEYS[0]} or {_TRIPLE_KEYS[1]}, has {sorted(f)}")
        p, c, r = (_as_ids(f[k], f"sample {i} {k}") for k in keys)
        for k, t in zip(keys, (p, c, r)):
            if t.numel() == 0:
                raise ValueError(f"sample {i}: {k} is empty (the prompt and both responses need >= 1 token)")
        total = p.numel() + c.numel() + r.numel()
        if total > self.max_length:
            if not self.truncation:
                raise ValueError(f"sample {i} has {total} tokens (prompt {p.numel()} + chosen {c.numel()} + rejected "
                                 f"{r.numel()}) > max_length={self.max_length} (pass truncation=True to cut it)")
            keep = max(1, min(p.numel(), self.max_length - 2, self.max_length - c.numel() - r.numel()))
            p = p[p.numel() - keep:]
            room = self.max_length - keep
            if c.numel() + r.numel() > room:
                nc = min(c.numel(), max((room + 1) // 2, room - r.numel()))
                c, r = c[:nc], r[:min(r.numel(), room - nc)]
        return p, c, r

    def __call__(self, features: Sequence[dict]) -> Dict[str, torch.Tensor]:
        """Pack the triples into rows with :func:`pack_sequences` and collate them."""
        if len(features) == 0:
            raise ValueError("no samples to collate")
        triples = [self._triple(f, i) for i, f in enumerate(features)]
        rows = pack_sequences([sum(t.numel() for t in x) for x in triples], self.max_length, self.packing)
        return self._collate([[triples[i] for i in row] for row in rows])

    def collate_rows(self, rows: Sequence[Sequence[dict]]) -> Dict[str, torch.Tensor]:
        """Collate triples already grouped into rows (each row at most ``max_length`` tokens)."""
        if len(rows) == 0 or any(len(r) == 0 for r in rows):
            raise ValueError("collate_rows needs a non-empty list of non-empty rows")
        out, k = [], 0
        for r, row in enumerate(rows):
            ts = []
            for f in row:
                ts.append(self._triple(f, k))
                k += 1
            total = sum(t.numel() for x in ts for t in x)
            if total > self.max_length:
                raise ValueError(f"row {r} holds {total} tokens > max_length={self.max_length}")
            out.append(ts)
        return self._collate(out)

    def _collate(self, rows) -> Dict[str, torch.Tensor]:
        triples = [t for row in rows for t in row]
        nrows = len(rows)
        P = torch.tensor([t[0].numel() for t in triples], dtype=torch.long)
        C = torch.tensor([t[1].numel() for t in triples], dtype=torch.long)
        R = torch.tensor([t[2].numel() for t in triples], dtype=torch.long)
        L = P + C + R
        row_of = torch.repeat_interleave(torch.arange(nrows), torch.tensor([len(r) for r in rows]))
        lay = _RowLayout(L, row_of, nrows)
        s = _padded_len(int(lay.used.max()), self.max_length, self.padding, self.pad_to_multiple_of)
        ids = torch.cat([x for t in triples for x in t])

        seg, off = lay.seg, lay.off
        p, c, end = P[seg], (P + C)[seg], L[seg]  # per token: prompt end, chosen end, triple end (offsets)
        in_chosen = (off >= p) & (off < c)
        pos = torch.where(off >= c, off - C[seg], off)
        col0 = lay.col0[seg]
        lts = torch.where(in_chosen, col0 + c, col0 + end)

        # Pre-shifted targets: the logits at token t score the token after it in its own sequence.
        nxt = torch.cat([ids[1:], ids.new_zeros(1)])  # flat next token (only read where it is in the triple)
        chosen_t = torch.where((off >= p - 1) & (off < c - 1), nxt, IGNORE_INDEX)
        rej_t = torch.where((off >= c) & (off < end - 1), nxt, IGNORE_INDEX)
        first_rej = ids[lay.flat_first + P + C]  # first rejected token of each triple
        rej_t = torch.where(off == p - 1, first_rej[seg], rej_t)

        cols = torch.arange(s)
        input_ids = torch.full((nrows, s), self.pad_token_id, dtype=torch.long)
        position_ids = (cols[None, :] - lay.used[:, None]).clamp_min(0)
        out_lts = torch.full((nrows, s), s, dtype=torch.long)
        chosen_labels = torch.full((nrows, s), IGNORE_INDEX, dtype=torch.long)
        rejected_labels = torch.full((nrows, s), IGNORE_INDEX, dtype=torch.long)
        pair_index = torch.full((nrows, s), -1, dtype=torch.long)
        r_, c_ = lay.r, lay.c
        input_ids[r_, c_] = ids
        position_ids[r_, c_] = pos
        out_lts[r_, c_] = lts
        chosen_labels[r_, c_] = chosen_t
        rejected_labels[r_, c_] = rej_t
        pair_index[r_, c_] = seg

        o = lay.col0
        return {
            "input_ids": input_ids,
            "position_ids": position_ids,
            MASK_KEY: out_lts.to(torch.int32)[:, None, :, None].contiguous(),
            "chosen_labels": chosen_labels,
            "rejected_labels": rejected_labels,
            "pair_index": pair_index,
            "pair_row": row_of,
            "prompt_spans": torch.stack([o, o + P], 1),
            "chosen_spans": torch.stack([o + P, o + P + C], 1),
            "rejected_spans": torch.stack([o + P + C, o + L], 1),
        }


# --------------------------------------------------------------------------------------------------
# loss-side helpers


def model_inputs(batch: Dict[str, torch.Tensor], device=None) -> Dict[str, torch.Tensor]:
    """The model arguments of a collated batch: ``input_ids``, ``position_ids`` and the mask.

    (A :class:`ShareQuestionCollator` batch also holds loss-side tensors that a model must not
    receive.) ``device`` moves them there.
    """
    keys = ("input_ids", "position_ids", MASK_KEY)
    out = {k: batch[k] for k in keys if k in batch}
    if device is not None:
        out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    return out


def logp_positions(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """bool ``[R, S]``: the columns whose logits :func:`shared_sequence_logps` reads.

    Computing the LM head only there (``lm_head(hidden[logp_positions(batch)])``) saves the
    logits of prompt and padding tokens.
    """
    return (batch["chosen_labels"] != IGNORE_INDEX) | (batch["rejected_labels"] != IGNORE_INDEX)


def shared_sequence_logps(logits: torch.Tensor, batch: Dict[str, torch.Tensor], *, average: bool = False,
                          chunk_size: int = 4096) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-triple log-probabilities of the chosen and rejected responses from one shared forward.

    Args:
        logits: ``[R, S, V]`` (the model's output on a :class:`ShareQuestionCollator` batch), or
            ``[T, V]``: the logits at the ``T`` columns of :func:`logp_positions` (row-major).
        batch: the collated batch (uses ``chosen_labels``, ``rejected_labels``, ``pair_index``,
            ``pair_row``).
        average: mean over each response's tokens instead of the sum.
        chunk_size: rows of logits turned into float32 at a time.

    Returns:
        ``(chosen_logps, rejected_logps)``, float32 ``[N]``: ``sum_t log p(response_t | prompt,
        response_<t)``, equal (up to rounding) to what separate ``prompt + chosen`` and
        ``prompt + rejected`` sequences give. Differentiable in ``logits``.
    """
    need = logp_positions(batch).to(logits.device)
    if logits.dim() == 3:
        if logits.shape[:2] != need.shape:
            raise ValueError(f"logits have shape {tuple(logits.shape)}, the batch is {tuple(need.shape)}")
        logits = logits[need]
    elif logits.dim() == 2:
        t = int(need.sum())
        if logits.shape[0] != t:
            raise ValueError(f"logits [T, V] must have T = logp_positions(batch).sum() = {t} rows, "
                             f"got {logits.shape[0]}")
    else:
        raise ValueError(f"logits must be [R, S, V] or [T, V], got {tuple(logits.shape)}")
    n = batch["pair_row"].shape[0]
    pair = batch["pair_index"].to(logits.device)[need]
    chunks = [torch.logsumexp(logits[i:i + chunk_size].float(), -1) for i in range(0, logits.shape[0], chunk_size)]
    lse = torch.cat(chunks) if chunks else logits.new_zeros(0, dtype=torch.float32)
    outs = []
    for key in ("chosen_labels", "rejected_labels"):
        tgt = batch[key].to(logits.device)[need]
        valid = tgt != IGNORE_INDEX
        idx = valid.nonzero().squeeze(1)
        lp = logits[idx].gather(-1, tgt[idx, None]).squeeze(-1).float() - lse[idx]
        total = torch.zeros(n, dtype=torch.float32, device=logits.device).index_add(0, pair[idx], lp)
        if average:
            cnt = torch.zeros(n, dtype=torch.float32, device=logits.device).index_add(
                0, pair[idx], torch.ones_like(lp))
            total = total / cnt.clamp_min(1)
        outs.append(total)
    return outs[0], outs[1]


def response_end_values(values: torch.Tensor, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reward-model scores: ``values`` at the last token of each chosen and rejected response.

    Args:
        values: ``[R, S]`` or ``[R, S, K]`` per-token outputs (e.g. a value head's scores).
        batch: a :class:`ShareQuestionCollator` batch.

    Returns:
        ``(chosen, rejected)``, each ``[N]`` or ``[N, K]``; each equals the score of the separate
        ``prompt + response`` sequence at its last token.
    """
    row = batch["pair_row"].to(values.device)
    ce = batch["chosen_spans"][:, 1].to(values.device) - 1
    re_ = batch["rejected_spans"][:, 1].to(values.device) - 1
    return values[row, ce], values[row, re_]
