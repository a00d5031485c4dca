"""Ulysses context parallelism: an all-to-all between the sequence and the heads.

Each of the ``P`` ranks holds ``S / P`` consecutive tokens of q, k and v with all heads. An
all-to-all turns ``[B, S/P, H, D]`` into ``[B, S, H/P, D]``: the whole sequence for ``H / P`` of
the heads. The rank then runs ordinary :func:`flashmask.flashmask_attention` (kernels on GPU,
reference path on CPU) with the **unchanged** global mask, and a second all-to-all brings the
output back to ``[B, S/P, Hq, D]``. The backward is the same two all-to-alls reversed around
the attention's own backward. Communication per layer: q, k, v and out once each (and their
gradients), ``O(S * H * D / P)`` per rank, independent of the mask.

Heads: ``Hq`` must be a multiple of ``P``. When ``Hk`` is not (GQA with few KV heads), every
KV head is repeated ``r = P / gcd(Hk, P)`` times (its gradient is summed back; ``Hk * r`` still
divides ``Hq``). Mask heads: ``Hm = 1`` is used as is; ``Hm = Hq`` or
``Hm = Hk`` is cut to the rank's heads (repeated with the KV heads first where needed).

Example (2 processes, gloo or NCCL)::

    S_local = S // 2
    q = q_full[:, rank * S_local:(rank + 1) * S_local]           # [B, S/2, Hq, D], likewise k, v
    out = ulysses_attention(q, k, v, masks.causal_document(S, docs), causal=True)   # [B, S/2, Hq, D]
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from flashmask import _checks
from flashmask.attention import flashmask_attention
from flashmask.distributed import _comm

__all__ = ["ulysses_attention", "ulysses_heads", "seq_to_heads", "heads_to_seq"]


def ulysses_heads(num_heads_q: int, num_heads_k: int, world: int) -> int:
    """How many times each KV head is repeated so that the KV heads split evenly over ``world``
    ranks; raises ``ValueError`` if the query heads cannot be split."""
    if num_heads_q % world:
        raise ValueError(f"Ulysses splits the heads over the group: the number of query heads ({num_heads_q}) must "
                         f"be a multiple of the group size ({world}); use mode='allgather_kv' instead")
    if num_heads_k < 1 or num_heads_q % num_heads_k:
        raise ValueError(f"the number of query heads ({num_heads_q}) must be a multiple of the number of key/value "
                         f"heads ({num_heads_k})")
    # P | Hq = Hk * g implies r = P / gcd(Hk, P) divides g: the repeated KV heads still divide Hq.
    return world // math.gcd(num_heads_k, world)


class _SeqToHeads(torch.autograd.Function):
    """``[B, S/P, H, D]`` (all heads of my tokens) -> ``[B, S, H/P, D]`` (all tokens of my heads)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, g):
        return heads_to_seq(g, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return seq_to_heads(g, ctx.group), None


def seq_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """The forward all-to-all (not differentiable; see :func:`ulysses_attention`)."""
    world, _ = _comm.world_and_rank(group)
    b, n, h, d = x.shape
    if world == 1:
        return x
    send = x.reshape(b, n, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()  # [P, B, n, H/P, D]
    recv = torch.empty_like(send)
    _comm.all_to_all(recv, send, group)  # recv[p]: rank p's tokens, my heads
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * n, h // world, d)


def heads_to_seq(y: torch.Tensor, group=None) -> torch.Tensor:
    """The inverse all-to-all: ``[B, S, H/P, D]`` -> ``[B, S/P, H, D]``."""
    world, _ = _comm.world_and_rank(group)
    b, s, hp, d = y.shape
    if world == 1:
        return y
    n = s // world
    send = y.reshape(b, world, n, hp, d).permute(1, 0, 2, 3, 4).contiguous()  # [P, B, n, H/P, D]
    recv = torch.empty_like(send)
    _comm.all_to_all(recv, send, group)  # recv[p]: my tokens, rank p's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n, world * hp, d)


def _mask_for_rank(mask: Optional[torch.Tensor], hq: int, hk: int, r: int, world: int, rank: int):
    if mask is None or mask.shape[1] == 1:
        return mask
    hm = mask.shape[1]
    if hm == hq:
        per = hq // world
    elif hm == hk:
        mask = mask.repeat_interleave(r, dim=1) if r > 1 else mask
        per = hk * r // world
    else:
        raise ValueError(f"startend_row_indices has {hm} mask heads; it must be 1, Hk={hk} or Hq={hq}")
    return mask[:, rank * per:(rank + 1) * per].contiguous()


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      startend_row_indices: Optional[torch.Tensor] = None, *, causal: bool = False,
                      group=None, softmax_scale: Optional[float] = None, backend: str = "auto",
                      deterministic: bool = False, softcap: float = 0.0,
                      sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exact attention over a sequence split in ``P`` equal contiguous parts, one per rank.

    Args:
        q: ``[B, S/P, Hq, Dqk]``, this rank's tokens ``[rank * S/P, (rank + 1) * S/P)``.
        k, v: ``[B, S/P, Hk, Dqk]`` and ``[B, S/P, Hk, Dv]``, the same tokens (``Dv`` may differ from
            ``Dqk``).
        startend_row_indices: the **global** mask ``[B, Hm, S, C]`` (same on every rank), or None.
        causal, softmax_scale, backend, deterministic: as :func:`flashmask.flashmask_attention`.
        group: the context-parallel process group (``None``: the default group).
        softcap: as :func:`flashmask.flashmask_attention`.
        sinks: ``[Hq]``, all query heads (as :func:`flashmask.flashmask_attention`); each rank uses
            those of its heads, so its gradient of ``sinks`` is nonzero on them only: sum it over the
            group like any parameter's.

    Returns:
        ``[B, S/P, Hq, Dv]``: this rank's rows of the single-process result. Differentiable in
        q, k and v.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B, S/P, H, D], got shape {tuple(t.shape)}")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"Ulysses needs q, k, v over the same batch and local tokens, and k, v with the same heads, "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim Dqk, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    world, rank = _comm.world_and_rank(group)
    b, n, hq, d = q.shape
    hk = k.shape[2]
    r = ulysses_heads(hq, hk, world)
    s = n * world
    if startend_row_indices is not None and startend_row_indices.shape[2] != s:
        raise ValueError(f"the mask has Sk={startend_row_indices.shape[2]} columns but the {world} ranks hold "
                         f"{world} x {n} = {s} tokens (every rank must hold S / P tokens)")
    softcap = _checks.softcap_value(softcap)  # (checked before any collective, on every rank)
    _checks.check_sinks(sinks, q)
    mask = _mask_for_rank(startend_row_indices, hq, hk, r, world, rank)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    qf, kf, vf = (_SeqToHeads.apply(t, group) for t in (q, k, v))
    per = hq // world  # the all-to-all gives rank p the query heads [p * per, (p + 1) * per)
    local_sinks = None if sinks is None else sinks[rank * per:(rank + 1) * per]
    out = flashmask_attention(qf, kf, vf, mask, causal=causal, softmax_scale=softmax_scale, backend=backend,
                              deterministic=deterministic, softcap=softcap, sinks=local_sinks)
    return _HeadsToSeq.apply(out, group)
