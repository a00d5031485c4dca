"""QK-sparse mask: causal attention with rectangles of (query rows x keys) dropped.

Models query/key sparsification (dropping some queries' access to a span of keys, e.g. tokens
pruned from the context of a span of queries). A sample's spec is a list of regions
``(key_start, key_end, row_start, row_end)``: queries in ``[row_start, row_end)`` do not attend
keys in ``[key_start, key_end)``. Definition: causal, and not inside any region. Key ranges of
one sample must not overlap (each key column holds one interval). Causal, C=2: for a key j of a
region, LTS[j] = max(row_start, j) (rows above the diagonal are masked anyway), LTE[j] =
max(row_end, LTS[j]); keys outside every region get LTS = LTE = S.

::

    S = 10, regions = [(2, 6, 2, 5), (6, 8, 6, 8)]
    #.........     LTS = [10, 10, 2, 3, 4, 5, 6, 7, 10, 10]
    ##........     LTE = [10, 10, 5, 5, 5, 5, 8, 8, 10, 10]
    ##........
    ##........
    ##........
    ######....
    ######....
    ######....
    #########.
    ##########

Example::

    >>> qk_sparse(10, [(2, 6, 2, 5), (6, 8, 6, 8)])[0, 0, :, 0].tolist()
    [10, 10, 2, 3, 4, 5, 6, 7, 10, 10]
"""
from __future__ import annotations

import torch

from . import _spec

CAUSAL = True


def _parse(seqlen, regions, batch_size):
    s = _spec.check_seqlen(seqlen)
    regions = _spec.plain(regions)
    if not isinstance(regions, (list, tuple)):
        raise ValueError(f"regions must be a list of (key_start, key_end, row_start, row_end), got {regions!r}")
    # A region is 4 ints, so a non-empty list whose items are all lists of regions (or empty
    # lists) is a batch; this also reads ``[[]]`` as one sample without regions.
    seq = (list, tuple)
    if regions and all(isinstance(r, seq) and (not r or isinstance(r[0], seq)) for r in regions):
        per = list(regions)
        if batch_size is not None and _spec.check_batch_size(batch_size) != len(per):
            raise ValueError(f"regions gives {len(per)} samples but batch_size={batch_size}")
    else:
        per = [regions] * (1 if batch_size is None else _spec.check_batch_size(batch_size))
    out = []
    for b, rs in enumerate(per):
        if _spec.is_int(rs):
            raise ValueError(f"regions of sample {b} must be a list of (key_start, key_end, row_start, row_end)")
        kept = []
        for r in rs:
            if _spec.is_int(r) or len(r) != 4 or any(not _spec.is_int(v) for v in r):
                raise ValueError(f"region {r!r} of sample {b} must be 4 ints (key_start, key_end, row_start, row_end)")
            ks, ke, q0, q1 = (int(v) for v in r)
            if not (0 <= ks <= ke <= s and 0 <= q0 <= q1 <= s):
                raise ValueError(f"region {r!r} of sample {b} needs 0 <= key_start <= key_end <= {s} "
                                 f"and 0 <= row_start <= row_end <= {s}")
            if ks < ke:  # an empty key range masks nothing
                kept.append((ks, ke, q0, q1))
        kept.sort()
        for a, c in zip(kept, kept[1:]):
            if c[0] < a[1]:
                raise ValueError(f"regions {a} and {c} of sample {b} overlap in keys; each key may be in one region")
        out.append(kept)
    return s, out


def _table(per, s, device):
    """Regions as int64 ``[B, R, 4]``, padded with regions past the end (S+1) that match nothing."""
    r = max(1, max(len(x) for x in per))
    pad = (s + 1, s + 1, 0, 0)
    return torch.tensor([x + [pad] * (r - len(x)) for x in per], dtype=torch.long, device=device)


def qk_sparse(seqlen: int, regions, *, batch_size=None, device=None, validate: bool = True) -> torch.Tensor:
    """int32 ``[B, 1, seqlen, 2]`` (LTS, LTE); ``regions`` is one list of 4-tuples or B of them."""
    s, per = _parse(seqlen, regions, batch_size)
    tab = _table(per, s, device)  # sorted by key_start within each sample
    j = torch.arange(s, device=device).expand(len(per), s).contiguous()
    # The only region that can hold key j is the last one starting at or before j.
    k = (torch.searchsorted(tab[..., 0].contiguous(), j, right=True) - 1).clamp(min=0)
    reg = torch.gather(tab, 1, k.unsqueeze(-1).expand(-1, -1, 4))  # [B, S, 4]
    inside = (reg[..., 0] <= j) & (j < reg[..., 1])
    lts = torch.maximum(reg[..., 2], j)
    lte = torch.maximum(reg[..., 3], lts)
    return _spec.finish([torch.where(inside, lts, s), torch.where(inside, lte, s)], CAUSAL, s, validate)


def qk_sparse_mask_mod(seqlen: int, regions, *, batch_size=None, device=None):
    """Predicate: ``kv_idx <= q_idx`` and (q, kv) in no region."""
    s, per = _parse(seqlen, regions, batch_size)
    tab = _table(per, s, device)
    ks, ke, q0, q1 = tab.unbind(-1)  # each [B, R]

    def mask_mod(b, h, q_idx, kv_idx):
        q, kv = q_idx.unsqueeze(-1), kv_idx.unsqueeze(-1)  # broadcast against the region axis
        hit = (ks[b] <= kv) & (kv < ke[b]) & (q0[b] <= q) & (q < q1[b])
        return (kv_idx <= q_idx) & ~hit.any(-1)

    return mask_mod
