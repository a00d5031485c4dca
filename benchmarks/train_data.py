"""Synthetic packed rows for the end-to-end benchmark (benchmarks/bench_train.py) and what they hold."""
from __future__ import annotations

import statistics
from typing import List

import torch

from benchmarks.flops import total_pairs


def synthetic_batches(num: int, batch: int, seqlen: int, vocab_size: int, doc_len, seed: int) -> List[dict]:
    """``num`` batches of ``batch`` rows of exactly ``seqlen`` tokens: random ids, documents of
    uniform random length in ``doc_len = (min, max)`` (the last one cut to fill the row), collated
    by :class:`flashmask.data.PackedSFTCollator` (CPU tensors)."""
    from flashmask.data import PackedSFTCollator
    collate = PackedSFTCollator(seqlen, pad_token_id=0, packing="sequential", padding="max_length")
    g = torch.Generator().manual_seed(seed)
    lo, hi = int(doc_len[0]), int(doc_len[1])
    out = []
    for _ in range(num):
        rows = []
        for _ in range(batch):
            docs, used = [], 0
            while used < seqlen:
                n = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), seqlen - used)
                docs.append({"input_ids": torch.randint(0, vocab_size, (n,), generator=g)})
                used += n
            rows.append(docs)
        out.append(collate.collate_rows(rows))
    return out


def data_stats(batches: List[dict]) -> dict:
    """Mean documents per row and attended-pair density of the causal-document masks."""
    from flashmask.data import MASK_KEY
    docs, dens = [], []
    for b in batches:
        startend = b[MASK_KEY]
        bsz, _, s, _ = startend.shape
        docs.append(float((b["position_ids"] == 0).sum()) / bsz)
        dens.append(total_pairs(startend, True, batch=bsz, heads=1, seqlen_q=s, seqlen_k=s) / (bsz * s * s))
    return {"docs_per_row": statistics.mean(docs), "density": statistics.mean(dens)}
