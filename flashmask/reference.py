"""The pure-PyTorch reference path: exact attention with a FlashMask mask, on any device and dtype.

It is the oracle of the tests and the fallback where the CUDA kernels cannot run. It expands the
mask a chunk of query rows at a time (O(chunk * Sk) memory per chunk), so it is exact but not
fast; gradients come from autograd.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from masks.format import to_dense


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        startend_row_indices: Optional[torch.Tensor] = None, *, causal: bool = False,
                        softmax_scale: Optional[float] = None, chunk_size: int = 1024,
                        softcap: float = 0.0,
                        sinks: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention; returns ``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq])``.

    Inputs as :func:`flashmask.flashmask_attention` (no checks here: callers validate): q and k
    ``[.., Dqk]``, v ``[.., Dv]``; ``softmax_scale`` defaults to ``1 / sqrt(Dqk)``. Half
    inputs are computed in float32, float64 in float64; ``out`` has the input dtype, ``lse`` is
    float32 (float64 for float64 inputs). Rows that no key may attend give ``out = 0`` and
    ``lse = +inf`` with zero gradients; non-finite inputs that reach a visible score propagate
    as NaN (as in ``torch.nn.functional.scaled_dot_product_attention``).

    ``softcap > 0``: each scaled score s becomes ``softcap * tanh(s / softcap)`` before the mask
    (Gemma 2; an infinite score is then capped to ``+-softcap`` as tanh does). ``sinks`` ``[Hq]``:
    one more logit per query head in every row's softmax denominator, with no value (GPT-OSS);
    the LSE includes it, and a row that no key may attend gets ``out = 0`` and ``lse = sinks[h]``.
    Both are differentiable (``sinks`` in the compute dtype, its gradient in its own).
    """
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    acc = _compute_dtype(q.dtype)
    # [B, H, S, D] in the compute dtype; K/V heads repeated for the query heads of their group.
    qh = q.transpose(1, 2).to(acc)
    kh = k.transpose(1, 2).to(acc).repeat_interleave(hq // hk, dim=1)
    vh = v.transpose(1, 2).to(acc).repeat_interleave(hq // hk, dim=1)
    # [1, H, 1, 1]: the sink logit of each query head, differentiable
    sink = None if sinks is None else sinks.to(acc).view(1, hq, 1, 1)
    if sq == 0 or sk == 0:
        # Nothing to attend (no key: every row is empty) or no row at all. The result still comes
        # out of q, k and v through autograd, so that backward() runs and gives zero gradients.
        s = torch.matmul(qh, kh.transpose(-1, -2))  # [B, H, Sq, 0] or [B, H, 0, Sk]
        out = torch.matmul(s, vh).transpose(1, 2).to(q.dtype)  # zeros (a sum over no key)
        empty_lse = float("inf") if sink is None else sink.squeeze(-1)
        return out, s.sum(-1) + empty_lse
    outs, lses = [], []
    for r0 in range(0, sq, chunk_size):
        rows = slice(r0, min(sq, r0 + chunk_size))
        allowed = to_dense(startend_row_indices, causal, seqlen_q=sq, seqlen_k=sk, rows=rows)
        allowed = allowed.to(q.device)
        if allowed.shape[1] not in (1, hq):
            allowed = allowed.repeat_interleave(hq // allowed.shape[1], dim=1)
        s = torch.matmul(qh[:, :, rows], kh.transpose(-1, -2)) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~allowed, float("-inf"))
        # A row is empty when the mask hides every key (out 0, lse +inf), not when its scores
        # underflow: a visible key whose score is -inf, +inf or NaN (non-finite inputs) gives NaN,
        # as softmax does. The row max only stabilises the exponentials: softmax does not depend
        # on it, so it is detached, and it is 0 on empty rows so that no -inf - -inf appears there.
        empty = ~allowed.any(dim=-1, keepdim=True)
        m = s.amax(dim=-1, keepdim=True).detach()
        if sink is None:
            m = torch.where(empty, torch.zeros_like(m), m)
        else:
            # The sink joins the row max; on an empty row it is the max (0 where it is not finite).
            sink_m = sink.detach().expand_as(m)
            m = torch.where(empty, torch.where(torch.isfinite(sink_m), sink_m, 0.0), torch.maximum(m, sink_m))
        e = torch.exp(s - m)
        denom = e.sum(dim=-1, keepdim=True)
        if sink is None:
            safe = torch.where(empty, torch.ones_like(denom), denom)
            lse = torch.where(empty, torch.full_like(denom, float("inf")), m + torch.log(safe))
        else:
            # With a sink no row is empty in the softmax: an empty row puts all its weight on the
            # sink (out 0, lse = sink).
            safe = denom + torch.exp(sink - m)
            lse = m + torch.log(safe)
        out = torch.matmul(e, vh) / safe
        outs.append(torch.where(empty, torch.zeros_like(out), out))  # even where V holds inf or NaN
        lses.append(lse.squeeze(-1))
    out = torch.cat(outs, dim=2).transpose(1, 2).to(q.dtype)
    return out, torch.cat(lses, dim=2)
