"""All-gather-KV context parallelism: queries sharded in balanced chunks, K/V gathered.

Every rank holds the tokens of its chunks (see :func:`flashmask.distributed.make_plan`): q, k, v
``[B, L, H, D]`` with ``L = S / P`` (v may have a head dim ``Dv`` of its own). Forward:

1. K and V are all-gathered (``[P * L]`` tokens in all-gather order: rank 0's chunks, then
   rank 1's, ...). The plan's chunk masks list their columns in that order, so nothing is
   reordered.
2. For every own chunk (global rows ``[r0, r1)``) the unchanged kernels run the chunk's rows
   against all keys with the chunk's mask: the global column intervals shifted by ``-r0`` and
   clamped, causal written as an interval (:func:`flashmask.distributed.intervals.slice_rows`).
   Tiles that the mask hides entirely are skipped by the kernels as usual, so a chunk costs its
   unmasked work.

Backward: dQ stays local; every rank's dK/dV over all ``S`` keys (accumulated over its chunks
in float32 by default) is **reduce-scattered**, so each rank receives the summed gradient of its
own tokens' keys and values.

Overlap: the heads are cut into ``head_groups`` groups of KV heads (with their query and mask
heads). All groups' all-gathers are issued asynchronously at once, and group ``g``'s attention
runs while the K/V of the groups after it are still arriving; in the backward, group ``g``'s
reduce-scatter runs while group ``g + 1``'s gradients are computed. The result does not depend on
``head_groups``.

Memory per rank and layer: the gathered K and V (``S * Hk * Dqk`` and ``S * Hk * Dv``) are kept
for the backward, and the backward holds float32 dK/dV over ``S`` keys for one head group at a
time before the reduce-scatter.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from flashmask import _checks
from flashmask.distributed import _comm, _local
from flashmask.distributed.plan import ContextParallelPlan

__all__ = ["allgather_kv_attention"]


def _head_groups(hk: int, want: int) -> int:
    """The largest divisor of ``hk`` that is at most ``want``."""
    want = max(1, min(int(want), hk))
    return max(g for g in range(1, want + 1) if hk % g == 0)


def _mask_heads(mask: Optional[torch.Tensor], hq: int, hk: int, g: int, groups: int) -> Optional[torch.Tensor]:
    if mask is None or mask.shape[1] == 1:
        return mask
    hm = mask.shape[1]
    if hm not in (hq, hk):
        raise ValueError(f"startend_row_indices has {hm} mask heads; it must be 1, Hk={hk} or Hq={hq}")
    per = hm // groups
    return mask[:, g * per:(g + 1) * per].contiguous()


class _AllGatherKVAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: ContextParallelPlan, scale: float, arch, deterministic: bool,
                groups: int, grad_dtype, softcap: float, sinks):
        b, n, hq, d = q.shape
        hk, dv = k.shape[2], v.shape[-1]
        world, group = plan.world, plan.group
        hkg, hqg = hk // groups, hq // groups
        # Sequence-major buffers: the all-gather concatenates along dim 0 = tokens.
        k_sm, v_sm = k.transpose(0, 1), v.transpose(0, 1)  # [L, B, Hk, D]
        pending = []
        for g in range(groups):
            heads = slice(g * hkg, (g + 1) * hkg)
            ks, vs = k_sm[:, :, heads].contiguous(), v_sm[:, :, heads].contiguous()
            kb = ks.new_empty((world * n,) + tuple(ks.shape[1:]))
            vb = vs.new_empty((world * n,) + tuple(vs.shape[1:]))
            # (the inputs stay referenced until the wait: the collective may still be reading them)
            pending.append((kb, vb, _comm.all_gather(kb, ks, group, async_op=True),
                            _comm.all_gather(vb, vs, group, async_op=True), ks, vs))
        out = q.new_empty(b, n, hq, dv)
        lse = None
        gathered = []
        for g, (kb, vb, wk, wv, _, _) in enumerate(pending):
            wk.wait()
            wv.wait()
            kg, vg = kb.transpose(0, 1), vb.transpose(0, 1)  # [B, S, Hk/G, D] views
            gathered += [kb, vb]
            qh = slice(g * hqg, (g + 1) * hqg)
            for (lo, hi, _, _), mask in zip(plan.chunks, plan.chunk_masks):
                m = _mask_heads(mask, hq, hk, g, groups)
                o, chunk_lse = _local.fwd(q[:, lo:hi, qh], kg, vg, m, scale, arch, softcap,
                                          None if sinks is None else sinks[qh])
                if lse is None:
                    lse = torch.empty(b, hq, n, dtype=chunk_lse.dtype, device=q.device)
                out[:, lo:hi, qh] = o
                lse[:, qh, lo:hi] = chunk_lse
        ctx.save_for_backward(q, out, lse, sinks, *gathered)
        ctx.plan, ctx.scale, ctx.arch, ctx.deterministic = plan, scale, arch, deterministic
        ctx.softcap = softcap
        ctx.groups, ctx.grad_dtype, ctx.kv_dtype = groups, grad_dtype, k.dtype
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, out, lse, sinks, *gathered = ctx.saved_tensors
        plan, groups = ctx.plan, ctx.groups
        b, n, hq, d = q.shape
        hk = gathered[0].shape[2] * groups
        hkg, hqg = hk // groups, hq // groups
        dq = torch.empty_like(q)
        # this rank's rows' share of the sinks' gradient (the ranks' shares sum to the whole, as for any parameter)
        sink_acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dsinks = None if sinks is None else torch.zeros(hq, dtype=sink_acc, device=q.device)
        acc_dtype = ctx.kv_dtype if ctx.grad_dtype is None else torch.promote_types(ctx.kv_dtype, ctx.grad_dtype)
        pending = []
        for g in range(groups):
            kb, vb = gathered[2 * g], gathered[2 * g + 1]
            kg, vg = kb.transpose(0, 1), vb.transpose(0, 1)
            qh = slice(g * hqg, (g + 1) * hqg)
            acc_k = torch.zeros(kb.shape, dtype=acc_dtype, device=kb.device)  # [S, B, Hk/G, D]
            acc_v = torch.zeros(vb.shape, dtype=acc_dtype, device=vb.device)
            for (lo, hi, _, _), mask in zip(plan.chunks, plan.chunk_masks):
                m = _mask_heads(mask, hq, hk, g, groups)
                dqc, dkc, dvc, dsc = _local.bwd(dout[:, lo:hi, qh].contiguous(), q[:, lo:hi, qh], kg, vg,
                                                out[:, lo:hi, qh].contiguous(), lse[:, qh, lo:hi].contiguous(), m,
                                                ctx.scale, ctx.arch, ctx.deterministic, ctx.softcap,
                                                None if sinks is None else sinks[qh])
                dq[:, lo:hi, qh] = dqc
                if dsinks is not None:
                    dsinks[qh] += dsc.to(sink_acc)
                acc_k += dkc.transpose(0, 1)
                acc_v += dvc.transpose(0, 1)
            rk = acc_k.new_empty((n,) + tuple(acc_k.shape[1:]))
            rv = acc_v.new_empty((n,) + tuple(acc_v.shape[1:]))
            pending.append((rk, rv, _comm.reduce_scatter(rk, acc_k, plan.group, async_op=True),
                            _comm.reduce_scatter(rv, acc_v, plan.group, async_op=True), acc_k, acc_v))
        dk = q.new_empty(b, n, hk, gathered[0].shape[-1], dtype=ctx.kv_dtype)
        dv = q.new_empty(b, n, hk, gathered[1].shape[-1], dtype=ctx.kv_dtype)
        for g, (rk, rv, wk, wv, _, _) in enumerate(pending):
            wk.wait()
            wv.wait()
            heads = slice(g * hkg, (g + 1) * hkg)
            dk[:, :, heads] = rk.transpose(0, 1)
            dv[:, :, heads] = rv.transpose(0, 1)
        return dq, dk, dv, None, None, None, None, None, None, None, None if sinks is None else dsinks.to(sinks.dtype)


def allgather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ContextParallelPlan, *,
                           softmax_scale: Optional[float] = None, backend: str = "auto", deterministic: bool = False,
                           head_groups: int = 2, grad_dtype: Optional[torch.dtype] = torch.float32,
                           return_lse: bool = False, softcap: float = 0.0, sinks: Optional[torch.Tensor] = None):
    """Exact attention of this rank's query chunks against all keys, K/V all-gathered.

    Args:
        q: ``[B, L, Hq, Dqk]``, k ``[B, L, Hk, Dqk]``, v ``[B, L, Hk, Dv]``: this rank's tokens in
            the plan's local order (``L = S / P``; e.g. ``plan.shard(x)`` of the global tensors, or a
            model's activations on a batch sharded by :func:`flashmask.distributed.shard_packed_batch`).
        plan: from :func:`flashmask.distributed.make_plan` with ``mode="allgather_kv"`` (it holds
            the mask, the causal flag and the process group).
        softmax_scale, backend, deterministic: as :func:`flashmask.flashmask_attention`.
        head_groups: KV-head groups pipelined against the collectives (clipped to a divisor of Hk).
        grad_dtype: dtype of the dK/dV accumulation and reduce-scatter (``None``: the inputs').
        return_lse: also return the LSE ``[B, Hq, L]`` (not differentiable).
        softcap, sinks: as :func:`flashmask.flashmask_attention` (every rank holds all heads of its
            queries, so ``sinks`` is the whole ``[Hq]``); this rank's gradient of ``sinks`` is its
            rows' share, to be summed over the group like any parameter's.

    Returns:
        ``out [B, L, Hq, Dv]`` (this rank's rows of the single-process result, in its local order),
        and ``lse`` if asked. Differentiable in q, k and v.

    Example::

        plan = make_plan(mask, causal=True, group=cp_group)            # once per batch
        out = allgather_kv_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan)
    """
    if plan.mode != "allgather_kv":
        raise ValueError(f"allgather_kv_attention needs a plan made with mode='allgather_kv', got {plan.mode!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B, L, H, D], got shape {tuple(t.shape)}")
    b, n, hq, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[1] != n or k.shape[-1] != d:
        raise ValueError(f"q, k, v must share batch and local tokens (and q, k the head dim), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(f"q, k and v must share a floating-point dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    hk = k.shape[2]
    if hq % hk:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number of key/value heads ({hk})")
    if n != plan.local_len:
        raise ValueError(f"this rank holds {n} tokens but the plan gives {plan.local_len} per rank "
                         f"(S={plan.seqlen} over {plan.world} ranks)")
    plan.to(q.device)
    mask = plan.startend_row_indices
    if mask is not None:
        if mask.shape[0] != b:
            raise ValueError(f"the plan's mask has batch {mask.shape[0]} but q has batch {b}")
        if mask.shape[1] not in (1, hk, hq):
            raise ValueError(f"the plan's mask has {mask.shape[1]} heads; it must be 1, Hk={hk} or Hq={hq}")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    softcap = _checks.softcap_value(softcap)
    _checks.check_sinks(sinks, q)
    arch = _local.use_kernels(q, k, v, backend)  # None: the reference path
    groups = _head_groups(hk, head_groups)
    out, lse = _AllGatherKVAttention.apply(q, k, v, plan, scale, arch, bool(deterministic), groups, grad_dtype,
                                           softcap, sinks)
    return (out, lse) if return_lse else out
