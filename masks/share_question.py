"""Share-question mask: one question followed by several answers that all read the question.

Used for DPO / reward models on packed (question, answer 1, answer 2, ...) samples, so the shared
question is encoded once. Definition: causal, and a query of an answer attends the question and
its own answer, never another answer; question tokens attend the question only. Causal, C=1:
question keys are seen until the end of the last answer (LTS = question + all answers), answer
keys until the end of their answer.

A sample's spec is ``[question_len, answer_1_len, answer_2_len, ...]``; tokens after the last
answer (``seqlen - sum(spec)``, e.g. padding) form one more document that sees neither the
question nor the answers.

::

    S = 10, spec = [4, 3, 3]     LTS = [10, 10, 10, 10, 7, 7, 7, 10, 10, 10]
    #.........
    ##........
    ###.......
    ####......
    #####.....
    ######....
    #######...
    ####...#..
    ####...##.
    ####...###

Example::

    >>> share_question(10, [4, 3, 3])[0, 0, :, 0].tolist()
    [10, 10, 10, 10, 7, 7, 7, 10, 10, 10]
"""
from __future__ import annotations

import torch

from . import _spec

CAUSAL = True


def _parse(seqlen, spec, batch_size):
    s = _spec.check_seqlen(seqlen)
    per = _spec.samples(spec, "share_question spec", 1, batch_size)
    for b, x in enumerate(per):
        if _spec.is_int(x) or len(x) == 0:
            raise ValueError(f"share_question spec of sample {b} must be [question_len, answer_len, ...], got {x!r}")
    segs = [_spec.lengths(x, "share_question lengths", s, b) for b, x in enumerate(per)]
    group_end = [sum(x) for x in per]  # end of the last answer
    return s, segs, group_end


def share_question(seqlen: int, spec, *, batch_size=None, device=None, validate: bool = True) -> torch.Tensor:
    """int32 ``[B, 1, seqlen, 1]``; ``spec`` is ``[q, a1, a2, ...]`` or a list of B of them."""
    s, segs, group_end = _parse(seqlen, spec, batch_size)
    _, end, index = _spec.segments(segs, s, device)
    g = torch.tensor(group_end, device=device).view(-1, 1).expand_as(end)
    lts = torch.where(index == 0, g, end)  # segment 0 is the question
    return _spec.finish([lts], CAUSAL, s, validate)


def share_question_mask_mod(seqlen: int, spec, *, batch_size=None, device=None):
    """Predicate: causal and (same segment, or key in the question and query in an answer)."""
    s, segs, group_end = _parse(seqlen, spec, batch_size)
    seg = _spec.ids(segs, device)
    pos = torch.arange(s, device=device)
    in_group = pos < torch.tensor(group_end, device=device).view(-1, 1)  # not in the tail
    is_question = (seg == 0) & in_group

    def mask_mod(b, h, q_idx, kv_idx):
        shared = is_question[b, kv_idx] & in_group[b, q_idx]
        return (kv_idx <= q_idx) & ((seg[b, q_idx] == seg[b, kv_idx]) | shared)

    return mask_mod
