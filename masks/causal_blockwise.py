"""Causal blockwise mask: causal blocks that see only themselves, then a final part that sees all.

Used e.g. for in-context-learning style packing: several independent demonstration blocks, then
a final segment (the test query / answer) that reads every block. Definition: causal, and query
i attends key j iff they are in the same block, or i is in the final part (the tokens after
``sum(block_lens)``). Causal, C=2: a key of a block ending at e is masked for rows
``[e, T)`` with T = sum(block_lens) -- the later blocks -- and seen again by the final part;
written LTS = LTE = S when that range is empty (the last block, the final part).

::

    S = 10, block_lens = [4, 3] (rows 7-9 are the final part)
    #.........     LTS = [4, 4, 4, 4, 10, 10, 10, 10, 10, 10]
    ##........     LTE = [7, 7, 7, 7, 10, 10, 10, 10, 10, 10]
    ###.......
    ####......
    ....#.....
    ....##....
    ....###...
    ########..
    #########.
    ##########

If the blocks fill the whole sequence there is no final part (this is then causal_document).

Example::

    >>> causal_blockwise(10, [4, 3])[0, 0, :, 1].tolist()
    [7, 7, 7, 7, 10, 10, 10, 10, 10, 10]
"""
from __future__ import annotations

import torch

from . import _spec

CAUSAL = True


def _parse(seqlen, block_lens, batch_size):
    s = _spec.check_seqlen(seqlen)
    per = _spec.samples(block_lens, "block_lens", 1, batch_size)
    segs = [_spec.lengths(x, "block_lens", s, b) for b, x in enumerate(per)]
    return s, segs, [sum(x) for x in per]


def causal_blockwise(seqlen: int, block_lens, *, batch_size=None, device=None, validate: bool = True) -> torch.Tensor:
    """int32 ``[B, 1, seqlen, 2]`` (LTS, LTE); ``block_lens`` is one list or a list of B lists."""
    s, segs, final_start = _parse(seqlen, block_lens, batch_size)
    _, end, _ = _spec.segments(segs, s, device)
    t = torch.tensor(final_start, device=device).view(-1, 1).expand_as(end)
    empty = end >= t  # rows [end, T) hold no later block: nothing to mask
    lts = torch.where(empty, s, end)
    lte = torch.where(empty, s, t)
    return _spec.finish([lts, lte], CAUSAL, s, validate)


def causal_blockwise_mask_mod(seqlen: int, block_lens, *, batch_size=None, device=None):
    """Predicate: causal and (same block, or the query is in the final part)."""
    s, segs, final_start = _parse(seqlen, block_lens, batch_size)
    seg = _spec.ids(segs, device)
    in_final = torch.arange(s, device=device) >= torch.tensor(final_start, device=device).view(-1, 1)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((seg[b, q_idx] == seg[b, kv_idx]) | in_final[b, q_idx])

    return mask_mod
