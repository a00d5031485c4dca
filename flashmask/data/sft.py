"""The SFT collator: documents packed into rows with a causal-document mask (:mod:`flashmask.data`)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from flashmask.data.packing import MASK_KEY, _as_ids, _check_common, _padded_len, _RowLayout, pack_sequences
from flashmask.losses import IGNORE_INDEX


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
