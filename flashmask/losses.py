"""The LM head and cross-entropy in chunks of tokens: no ``[S, vocab]`` logits tensor, ever.

At long context the logits dominate memory: 1M tokens x a 32K vocabulary is 64 GiB in bfloat16
and twice that in float32, more than the model's activations. :func:`linear_cross_entropy`
computes ``cross_entropy(hidden @ weight.T + bias, targets)`` ``chunk_size`` tokens at a time.
Forward and backward are one pass: while the loss of a chunk is computed, so is its gradient
(``softmax - one_hot``, scaled by the normalisation), which goes straight into ``d hidden`` (one
``[chunk, H]`` GEMM) and a float32 ``d weight`` accumulator; the backward only multiplies the
saved gradients by the incoming scalar. So the peak is one chunk's float32 logits plus
``d hidden`` (the size of ``hidden``) and ``d weight`` (float32, the size of the head), and the
LM head costs 3 GEMMs, as unchunked.

Numerics follow transformers: logits in the weight's dtype, upcast to float32 for the softmax;
targets equal to ``ignore_index`` (-100) add nothing.

Example::

    >>> h = torch.randn(6, 8, requires_grad=True); w = torch.randn(11, 8, requires_grad=True)
    >>> y = torch.tensor([1, 2, -100, 4, 5, 6])
    >>> loss = linear_cross_entropy(h, w, y, chunk_size=4)
    >>> ref = torch.nn.functional.cross_entropy(h @ w.T, y)
    >>> bool(torch.allclose(loss, ref, atol=1e-5))
    True
"""
from __future__ import annotations

from typing import Optional, Union

import torch

#: The label of a token without a target (transformers' and ``cross_entropy``'s ``ignore_index``);
#: the one definition, also importable as ``flashmask.data.IGNORE_INDEX``.
IGNORE_INDEX = -100

__all__ = ["linear_cross_entropy", "causal_lm_loss", "linear_token_logps", "final_logit_softcap", "IGNORE_INDEX"]


class _HeadGrads:
    """The gradients of ``hidden``, ``weight`` and ``bias`` of an LM head, accumulated chunk by
    chunk from ``d loss / d logits`` (the weight's and bias's in ``acc``); ``None`` where not needed."""

    def __init__(self, hidden, weight, acc, need_h: bool, need_w: bool, need_b: bool):
        self.dh = torch.empty_like(hidden) if need_h else None
        self.dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        self.db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None

    def add(self, rows: slice, d, hc, weight) -> None:
        """Rows ``rows`` of the tokens: ``d`` their ``[c, V]`` gradient of the logits (in ``acc``),
        ``hc`` their hidden states."""
        dl = d.to(hc.dtype)
        if self.dh is not None:
            self.dh[rows] = dl @ weight
        if self.dw is not None:
            self.dw.add_(dl.t() @ hc)
        if self.db is not None:
            self.db.add_(d.sum(0))


def _capped(logits: torch.Tensor, cap: float, need_grad: bool):
    """``(cap * tanh(logits / cap), d capped / d logits)`` in place over ``logits`` (Gemma 2's final
    logit soft-capping); ``(logits, None)`` for ``cap == 0``; the derivative only if ``need_grad``."""
    if not cap:
        return logits, None
    t = logits.div_(cap).tanh_()
    dcap = 1 - t * t if need_grad else None
    return t.mul_(cap), dcap


def _check_softcap(logit_softcap) -> float:
    value = 0.0 if logit_softcap is None else logit_softcap
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < float("inf")):
        raise ValueError(f"logit_softcap must be None or a finite float >= 0, got {logit_softcap!r}")
    return float(value)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size: int, ignore_index: int, normalizer, cap: float):
        n, h = hidden.shape
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32  # softmax dtype
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        need_any = need_h or need_w or need_b
        total = torch.zeros((), dtype=acc, device=hidden.device)
        if isinstance(normalizer, torch.Tensor):
            scale = (1.0 / normalizer.to(device=hidden.device, dtype=acc))
        else:
            scale = torch.tensor(1.0 / float(normalizer), dtype=acc, device=hidden.device)
        grads = _HeadGrads(hidden, weight, acc, need_h, need_w, need_b)
        for i in range(0, n, chunk_size):
            hc, yc = hidden[i:i + chunk_size], targets[i:i + chunk_size]
            logits = torch.nn.functional.linear(hc, weight, bias).to(acc)  # [c, V], the only big buffer
            logits, dcap = _capped(logits, cap, need_any)  # (dcap: a second one, with a cap)
            valid = yc != ignore_index
            safe_y = torch.where(valid, yc, 0).unsqueeze(1)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe_y).squeeze(1)
            total += torch.where(valid, lse - picked, 0.0).sum()
            if need_any:
                # d loss / d logits = (softmax - one_hot) * valid / normalizer, in place over the logits
                g = logits.sub_(lse.unsqueeze(1)).exp_()
                g.scatter_add_(1, safe_y, torch.full_like(picked, -1.0).unsqueeze(1))
                g.mul_((valid.to(g.dtype) * scale).unsqueeze(1))
                if dcap is not None:
                    g.mul_(dcap)
                grads.add(slice(i, i + chunk_size), g, hc, weight)
            del logits, dcap
        ctx.save_for_backward(*(t for t in (grads.dh, grads.dw, grads.db) if t is not None))
        ctx.which = (need_h, need_w, need_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total * scale

    @staticmethod
    def backward(ctx, grad):
        saved = list(ctx.saved_tensors)
        out = []
        for need, dtype in zip(ctx.which, ctx.dtypes):
            if need:
                t = saved.pop(0)
                out.append((t * grad).to(dtype))
            else:
                out.append(None)
        return out[0], out[1], out[2], None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, *, chunk_size: int = 4096,
                         ignore_index: int = IGNORE_INDEX, reduction: str = "mean",
                         normalizer: Optional[Union[float, torch.Tensor]] = None,
                         logit_softcap: Optional[float] = None) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, targets)`` without materialising the logits.

    Args:
        hidden: ``[N, H]`` (or ``[..., H]``, flattened).
        weight: ``[V, H]`` (the LM head, tied or not); bias: ``[V]`` or None.
        targets: int64 ``[N]`` (or ``[...]``): class per token, ``ignore_index`` for none.
        chunk_size: tokens per chunk; the peak extra memory is about ``chunk_size * V * 6`` bytes.
        reduction: ``"mean"`` (over targets != ignore_index) or ``"sum"``.
        normalizer: divide the sum by this instead (e.g. the number of targets of the whole
            batch when this process holds a shard of it: context parallelism, gradient
            accumulation); overrides ``reduction``.
        logit_softcap: the logits become ``logit_softcap * tanh(logits / logit_softcap)`` before the
            softmax (Gemma 2's ``config.final_logit_softcapping``); None or 0: off.

    Returns:
        A float32 scalar (float64 for float64 inputs). Differentiable in ``hidden``, ``weight`` and ``bias``.
    """
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden has size {hidden.shape[-1]} but weight is {tuple(weight.shape)} [V, H]")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden states but {y.shape[0]} targets")
    if y.dtype.is_floating_point or y.dtype == torch.bool:
        raise TypeError(f"targets must be integer class ids, got {y.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if normalizer is None:
        if reduction == "mean":
            normalizer = (y != ignore_index).sum().clamp_min(1)
        elif reduction == "sum":
            normalizer = 1.0
        else:
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    cap = _check_softcap(logit_softcap)
    return _LinearCrossEntropy.apply(h, weight, bias, y.long(), int(chunk_size), int(ignore_index), normalizer, cap)


def causal_lm_loss(hidden: torch.Tensor, lm_head: torch.nn.Module, labels: Optional[torch.Tensor] = None, *,
                   shift_labels: Optional[torch.Tensor] = None,
                   num_items_in_batch: Optional[Union[int, torch.Tensor]] = None, chunk_size: int = 4096,
                   ignore_index: int = IGNORE_INDEX, logit_softcap: Optional[float] = None) -> torch.Tensor:
    """The causal-LM loss of transformers' ``ForCausalLM`` models, chunked.

    ``hidden`` ``[B, S, H]`` is the decoder's output (after the final norm); ``lm_head`` a
    ``Linear`` (``weight`` ``[V, H]``). Give ``labels`` ``[B, S]`` (shifted here: position ``t``
    predicts ``labels[t + 1]``) or already-shifted ``shift_labels`` (e.g. from
    :func:`flashmask.distributed.shard_packed_batch`). The mean runs over targets != -100, or the
    sum is divided by ``num_items_in_batch`` when given (as transformers does). ``logit_softcap``:
    the model's final logit soft-capping (:func:`final_logit_softcap` of the model), as
    :func:`linear_cross_entropy`.

    Example::

        hidden = model.model(input_ids=ids, position_ids=pos).last_hidden_state
        loss = causal_lm_loss(hidden, model.lm_head, labels)   # == model(..., labels=labels).loss
    """
    if (labels is None) == (shift_labels is None):
        raise ValueError("give exactly one of labels and shift_labels")
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)
    if shift_labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {tuple(shift_labels.shape)} do not match the hidden states {tuple(hidden.shape)}")
    return linear_cross_entropy(hidden, lm_head.weight, shift_labels.to(hidden.device),
                                getattr(lm_head, "bias", None), chunk_size=chunk_size, ignore_index=ignore_index,
                                normalizer=num_items_in_batch, logit_softcap=logit_softcap)


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder of a transformers causal LM (the model without its LM head, returning
    ``last_hidden_state``): ``model.get_decoder()``, or ``model.model`` where that gives the causal LM
    itself (Llama 4's text model on transformers 5.x)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None or dec is model:
        dec = getattr(model, "model", None)
    if dec is None:
        raise ValueError(f"cannot find the decoder of {type(model).__name__} (no get_decoder() or .model)")
    return dec


def final_logit_softcap(model: torch.nn.Module) -> Optional[float]:
    """The final logit soft-capping of a transformers causal LM (``config.final_logit_softcapping``:
    Gemma 2, and Gemma 3 where set), or None: what the chunked losses must apply to equal the model's
    own logits."""
    return getattr(getattr(model, "config", None), "final_logit_softcapping", None)


class _LinearTokenLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size: int, ignore_index: int, cap: float):
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        n = hidden.shape[0]
        out = torch.zeros(n, dtype=acc, device=hidden.device)
        lse_all = torch.empty(n, dtype=acc, device=hidden.device)
        for i in range(0, n, chunk_size):
            yc = targets[i:i + chunk_size]
            logits, _ = _capped(torch.nn.functional.linear(hidden[i:i + chunk_size], weight, bias).to(acc), cap, False)
            valid = yc != ignore_index
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, torch.where(valid, yc, 0).unsqueeze(1)).squeeze(1)
            out[i:i + chunk_size] = torch.where(valid, picked - lse, 0.0)
            lse_all[i:i + chunk_size] = lse
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse_all)
        ctx.chunk_size, ctx.ignore_index, ctx.cap = chunk_size, ignore_index, cap
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets, lse_all = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = lse_all.dtype
        grads = _HeadGrads(hidden, weight, acc, need_h, need_w, need_b)
        c = ctx.chunk_size
        for i in range(0, hidden.shape[0], c):
            hc, yc = hidden[i:i + c], targets[i:i + c]
            valid = yc != ctx.ignore_index
            gc = torch.where(valid, grad[i:i + c].to(acc), 0.0)
            # d logp[y] / d logits = one_hot(y) - softmax; times the incoming gradient, in place
            logits, dcap = _capped(torch.nn.functional.linear(hc, weight, bias).to(acc), ctx.cap, True)
            d = logits.sub_(lse_all[i:i + c].unsqueeze(1)).exp_()
            d.scatter_add_(1, torch.where(valid, yc, 0).unsqueeze(1), torch.full_like(gc, -1.0).unsqueeze(1))
            d.mul_(-gc.unsqueeze(1))
            if dcap is not None:
                d.mul_(dcap)
            grads.add(slice(i, i + c), d, hc, weight)
        dw, db = grads.dw, grads.db
        return (grads.dh, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype),
                None, None, None, None)


def linear_token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, *, chunk_size: int = 4096,
                       ignore_index: int = IGNORE_INDEX, logit_softcap: Optional[float] = None) -> torch.Tensor:
    """Per-token ``log_softmax(hidden @ weight.T + bias)[target]`` without materialising the logits
    (with ``logit_softcap``, of the capped logits, as :func:`linear_cross_entropy`).

    For DPO and reward models, which need the log-probability of every response token rather
    than one mean. ``hidden`` ``[..., H]``, ``targets`` ``[...]`` (``ignore_index`` gives 0).
    Returns float32 (float64 for float64 inputs) ``[...]``, differentiable in ``hidden``,
    ``weight`` and ``bias``. The forward keeps one chunk's logits at a time and saves only the
    per-token log-sum-exp; the backward recomputes each chunk's logits (4 GEMMs in all).

    Under context parallelism each rank gets the log-probabilities of its own tokens; sum them
    over a sequence's response mask (sharded like the tokens) and all-reduce the sums over the
    group with ``torch.distributed.nn.functional.all_reduce`` (differentiable).

    Example::

        >>> h = torch.randn(2, 5, 8, dtype=torch.float64); w = torch.randn(11, 8, dtype=torch.float64)
        >>> y = torch.randint(0, 11, (2, 5))
        >>> ref = torch.log_softmax(h @ w.T, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        >>> bool(torch.allclose(linear_token_logps(h, w, y, chunk_size=3), ref))
        True
    """
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden has size {hidden.shape[-1]} but weight is {tuple(weight.shape)} [V, H]")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match the hidden states {tuple(hidden.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    cap = _check_softcap(logit_softcap)
    out = _LinearTokenLogps.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1).long(),
                                  int(chunk_size), int(ignore_index), cap)
    return out.view(targets.shape)
