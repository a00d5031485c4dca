"""Private helpers shared by the family builders: argument checks and per-sample spec parsing.

A family with per-sample structure takes either one sample's spec (e.g. ``[4, 3, 3]``) or a list
of them (``[[4, 3, 3], [10]]``). ``samples`` tells the two apart by nesting depth, so the same
call works for scalars (depth 0: ``prefix_len``), length lists (depth 1) and lists of tuples
(depth 2: ``qk_sparse`` regions).
"""
from __future__ import annotations

import numbers
from typing import List, Optional, Sequence

import torch


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_seqlen(seqlen) -> int:
    if not is_int(seqlen) or seqlen < 1:
        raise ValueError(f"seqlen must be a positive int, got {seqlen!r}")
    return int(seqlen)


def check_batch_size(batch_size) -> int:
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return int(batch_size)


def plain(spec):
    # Tensors and numpy arrays become nested lists, so one code path handles every input kind.
    return spec.tolist() if hasattr(spec, "tolist") and not is_int(spec) else spec


def _depth(x) -> int:
    """Nesting depth: int -> 0, list of ints -> 1, ...; an empty list counts as depth 1."""
    if is_int(x):
        return 0
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise ValueError(f"expected an int or a (nested) list of ints, got {x!r}")
    return 1 + max((_depth(e) for e in x), default=0)


def samples(spec, name: str, sample_depth: int, batch_size: Optional[int]) -> list:
    """Split ``spec`` into a list of per-sample specs (one sample, or a batch of them).

    A single sample is replicated ``batch_size`` times; a batch must match ``batch_size`` when
    both are given.
    """
    spec = plain(spec)
    d = _depth(spec)
    if d <= sample_depth:
        out = [spec]
        if batch_size is not None:
            out = out * check_batch_size(batch_size)
        return out
    if d != sample_depth + 1:
        raise ValueError(f"{name} is nested too deeply: expected one sample's spec or a list of them, got {spec!r}")
    if len(spec) == 0:
        raise ValueError(f"{name} is an empty batch")
    if batch_size is not None and check_batch_size(batch_size) != len(spec):
        raise ValueError(f"{name} gives {len(spec)} samples but batch_size={batch_size}")
    return list(spec)


def lengths(sample, name: str, seqlen: int, b: int) -> List[int]:
    """Check one sample's list of lengths and append the tail ``seqlen - sum`` if positive."""
    if is_int(sample) or any(not is_int(x) for x in sample):
        raise ValueError(f"{name} of sample {b} must be a list of ints, got {sample!r}")
    lens = [int(x) for x in sample]
    if any(x < 0 for x in lens):
        raise ValueError(f"{name} of sample {b} has a negative length: {lens}")
    total = sum(lens)
    if total > seqlen:
        raise ValueError(f"{name} of sample {b} sum to {total} > seqlen={seqlen}")
    return lens + ([seqlen - total] if total < seqlen else [])


def segments(per_sample: List[List[int]], seqlen: int, device=None):
    """Per-token segment bounds for samples whose lengths each sum to ``seqlen``.

    Returns ``(start, end, index)``, each int64 ``[B, S]``: the segment of token t of sample b is
    ``[start[b, t], end[b, t])`` and is the ``index[b, t]``-th segment of that sample. Built with
    one ``repeat_interleave`` over all samples' segments (no loop over tokens or samples).
    """
    bsz = len(per_sample)
    counts = torch.tensor([len(s) for s in per_sample], device=device)
    lens = torch.tensor([x for s in per_sample for x in s], dtype=torch.long, device=device)
    # Every sample sums to seqlen, so global cumulative ends are b*S + the local end.
    ends = torch.cumsum(lens, 0)
    seg = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)  # [B*S]
    offset = torch.arange(bsz, device=device).repeat_interleave(seqlen) * seqlen
    end = ends[seg] - offset
    start = end - lens[seg]
    first = torch.cumsum(counts, 0) - counts  # index of each sample's first segment
    index = seg - first.repeat_interleave(seqlen)
    return start.view(bsz, seqlen), end.view(bsz, seqlen), index.view(bsz, seqlen)


def finish(lts_like: list, causal: bool, seqlen: int, validate: bool) -> torch.Tensor:
    """Stack per-token vectors ``[B, S]`` into int32 ``[B, 1, S, C]`` and optionally validate."""
    from .format import validate as _validate

    out = torch.stack([t.to(torch.int32) for t in lts_like], dim=-1).unsqueeze(1).contiguous()
    if validate:
        _validate(out, causal, seqlen)
    return out


def ids(per_sample: List[List[int]], device=None) -> torch.Tensor:
    """Segment id of every token, int64 ``[B, S]`` (for the dense ``*_mask_mod`` definitions).

    Deliberately a different, simpler construction than ``segments`` (one repeat_interleave per
    sample), so that the dense definitions do not share the builders' index arithmetic.
    """
    rows = [torch.repeat_interleave(torch.arange(len(s)), torch.tensor(s, dtype=torch.long)) for s in per_sample]
    return torch.stack(rows).to(device)
