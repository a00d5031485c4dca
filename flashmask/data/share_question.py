"""The DPO / reward-model collator: prompt, chosen and rejected in one sequence, the prompt encoded
once (:mod:`flashmask.data`)."""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from flashmask.data.packing import MASK_KEY, _as_ids, _check_common, _padded_len, _RowLayout, pack_sequences
from flashmask.losses import IGNORE_INDEX

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
