"""Shard a packed batch over the context-parallel group, and the attention call that goes with it.

Every rank of a context-parallel group loads the same packed batch (e.g. from
:class:`flashmask.data.PackedSFTCollator`) and keeps its share of the tokens:

    >>> local, plan = shard_packed_batch(batch, group=cp_group, mode="allgather_kv")   # doctest: +SKIP
    >>> hidden = model.model(input_ids=local["input_ids"], position_ids=local["position_ids"])   # doctest: +SKIP

What :func:`shard_packed_batch` does, in this order:

1. **Shift the labels before sharding**: ``shift_labels[t] = labels[t + 1]`` (-100 at the end),
   so that the target of the last token of a shard (the first token of another rank's shard)
   is not lost. The output has ``shift_labels`` (transformers' name for already-shifted targets),
   not ``labels``, and ``num_items_in_batch``: the number of targets != -100 in the whole batch,
   so that every rank normalises its partial loss sum by the global count.
2. Take the mask from ``attn_mask_startend_row_indices``, else derive the document mask from
   ``cu_seq_lens_q`` or from restarting ``position_ids`` (a document starts wherever the position
   does not grow by exactly 1, docs/format.md), else plain causal.
3. Pad the row to a length the mode can split (:func:`pad_packed_batch`; all-gather-KV: a
   multiple of ``num_chunks * align``, by default ``8 * P * align``): padding is one more
   document at the end that no real token sees, with label -100.
4. Plan (:func:`flashmask.distributed.make_plan`) and keep this rank's tokens of every per-token
   tensor ``[B, S]``. Position ids stay global (RoPE sees the true positions).

The plan holds the mask; :func:`context_parallel_attention` (or the transformers backend of
:mod:`flashmask.distributed.hf`) runs each layer's attention with it.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from flashmask.data import MASK_KEY
from flashmask.distributed import _comm
from flashmask.distributed.allgather_kv import allgather_kv_attention
from flashmask.distributed.plan import MODES, ContextParallelPlan, make_plan
from flashmask.distributed.ulysses import ulysses_attention
from flashmask.losses import IGNORE_INDEX
from masks.format import check_tensor as check_mask_tensor
from masks.packed import check_cu_seqlens, cu_seqlens_starts, document_starts, from_position_ids, from_starts

#: Per-token keys that :func:`shard_packed_batch` shards (besides any other ``[B, S]`` tensor).
TOKEN_KEYS = ("input_ids", "position_ids", "shift_labels")

__all__ = ["context_parallel_attention", "shard_packed_batch", "pad_packed_batch", "shift_labels",
           "document_mask_from_position_ids", "MASK_KEY", "IGNORE_INDEX"]


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ContextParallelPlan, *,
                               softmax_scale: Optional[float] = None, backend: str = "auto",
                               deterministic: bool = False, head_groups: int = 2, softcap: float = 0.0,
                               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's rows of the single-process attention, for either mode of ``plan``.

    q ``[B, L, Hq, Dqk]``, k ``[B, L, Hk, Dqk]``, v ``[B, L, Hk, Dv]``: this rank's ``L = S / P``
    tokens in the plan's local order. Returns ``[B, L, Hq, Dv]``, differentiable in q, k, v. ``head_groups`` is used by
    all-gather-KV only (see :func:`allgather_kv_attention`). ``softcap`` and ``sinks`` (``[Hq]``, all
    query heads) as :func:`flashmask.flashmask_attention`; this rank's gradient of ``sinks`` is its
    share, summed over the group like any parameter's (FSDP2 does).
    """
    if plan.startend_row_indices is not None:
        check_mask_tensor(plan.startend_row_indices, batch_size=q.shape[0], name="the plan's startend_row_indices")
    plan.to(q.device)  # the masks follow the activations (a no-op after the first layer)
    if plan.mode == "ulysses":
        return ulysses_attention(q, k, v, plan.startend_row_indices, causal=plan.causal, group=plan.group,
                                 softmax_scale=softmax_scale, backend=backend, deterministic=deterministic,
                                 softcap=softcap, sinks=sinks)
    return allgather_kv_attention(q, k, v, plan, softmax_scale=softmax_scale, backend=backend,
                                  deterministic=deterministic, head_groups=head_groups, softcap=softcap, sinks=sinks)


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``[B, S]`` next-token targets: ``out[:, t] = labels[:, t + 1]``, ``ignore_index`` at the end.

    Example::

        >>> shift_labels(torch.tensor([[5, 6, 7, -100, 9]])).tolist()
        [[6, 7, -100, 9, -100]]
    """
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)


def document_mask_from_position_ids(position_ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """int32 ``[B, 1, S, C]`` document mask: a document starts at token 0 and wherever the position
    does not grow by exactly 1 (:func:`masks.from_position_ids`, docs/format.md). Causal: C=1
    (LTS = document end); else C=2."""
    return from_position_ids(position_ids, causal, validate=False)


def _pad_mask(mask: Optional[torch.Tensor], causal: bool, s: int, s_new: int, bsz: int,
              device) -> Optional[torch.Tensor]:
    """Extend a mask with ``s_new - s`` padding keys that no real row sees. Real columns keep their
    values (all <= s, so the padding rows below them stay masked wherever the column reaches the end)."""
    pad = s_new - s
    if pad == 0:
        return mask
    if mask is None:
        if causal:
            return None  # the padding keys come after every real row: the causal triangle hides them
        mask = torch.stack([torch.full((bsz, 1, s), s, dtype=torch.int32, device=device),
                            torch.zeros(bsz, 1, s, dtype=torch.int32, device=device)], -1)
    b, hm, _, c = mask.shape
    if causal:  # C=1: LTS = s_new; C=2: the empty interval [s_new, s_new)
        cols = [s_new] * c
    elif c == 2:  # LTS = s_new, UTE = s: real rows [0, s) never see them
        cols = [s_new, s]
    else:  # C=4: [s_new, s_new) and [0, s)
        cols = [s_new, s_new, 0, s]
    tail = torch.tensor(cols, dtype=mask.dtype, device=mask.device).view(1, 1, 1, c).expand(b, hm, pad, c)
    return torch.cat([mask, tail], dim=2).contiguous()


def pad_packed_batch(batch: Dict[str, torch.Tensor], multiple: int, *, causal: bool = True,
                     pad_token_id: int = 0, mask_key: str = MASK_KEY) -> Dict[str, torch.Tensor]:
    """Pad every ``[B, S]`` tensor (and the mask) of a batch to a multiple of ``multiple`` tokens.

    Padding is one extra document at the end of each row: ``input_ids`` = ``pad_token_id``,
    positions 0, 1, 2, ..., labels / shift_labels -100, and mask columns that no real row sees
    (the real rows' outputs are unchanged; the padding rows' outputs carry no loss). Tensors that
    are not ``[B, S]`` pass through. The mask must already be in the batch (or ``None``: plain causal).
    """
    ids = batch["input_ids"]
    bsz, s = ids.shape
    s_new = -(-s // int(multiple)) * int(multiple)
    if s_new == s:
        return dict(batch)
    pad = s_new - s
    out = {}
    for key, t in batch.items():
        if key == mask_key:
            out[key] = _pad_mask(t, causal, s, s_new, bsz, ids.device)
        elif isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape == (bsz, s):
            if key == "position_ids":
                tail = torch.arange(pad, device=t.device, dtype=t.dtype).expand(bsz, pad)
            elif key in ("labels", "shift_labels"):
                tail = torch.full((bsz, pad), IGNORE_INDEX, device=t.device, dtype=t.dtype)
            elif key == "input_ids":
                tail = torch.full((bsz, pad), pad_token_id, device=t.device, dtype=t.dtype)
            else:
                tail = torch.zeros((bsz, pad), device=t.device, dtype=t.dtype)
            out[key] = torch.cat([t, tail], 1)
        else:
            out[key] = t
    if mask_key not in out and not causal:
        out[mask_key] = _pad_mask(None, causal, s, s_new, bsz, ids.device)
    return out


def shard_packed_batch(batch: Dict[str, torch.Tensor], *, group=None, mode: str = "allgather_kv",
                       causal: bool = True, num_chunks: Optional[int] = None, align: int = 128,
                       strategy: str = "greedy", pad_token_id: int = 0,
                       mask_key: str = MASK_KEY) -> Tuple[Dict[str, torch.Tensor], ContextParallelPlan]:
    """This rank's share of a packed batch, and the plan its attention layers use.

    Args:
        batch: ``input_ids [B, S]``; optional ``position_ids [B, S]`` (default ``arange``),
            ``labels [B, S]`` (unshifted, as for a transformers causal LM) or ``shift_labels``,
            the mask ``attn_mask_startend_row_indices [B, Hm, S, C]`` (else derived from
            ``cu_seq_lens_q`` or restarting ``position_ids``), any other ``[B, S]`` tensors. A
            2-D ``attention_mask`` must be all ones (pad with a padding document instead).
        group: the context-parallel process group (``None``: the default group).
        mode: ``"allgather_kv"`` or ``"ulysses"``.
        causal: the attention's causal flag (True for a causal LM).
        num_chunks, align, strategy: all-gather-KV chunking (:func:`flashmask.distributed.balance_chunks`).
        pad_token_id: the input id of padding tokens, if the row must be padded.

    Returns:
        ``(local, plan)``: ``local`` has ``input_ids``, ``position_ids`` (global positions),
        ``shift_labels`` (if labels were given) and every other ``[B, S]`` tensor cut to this
        rank's ``S' / P`` tokens (``S'`` = S padded), ``num_items_in_batch`` (global count of
        targets != -100, int64 scalar tensor); no labels and no mask (the plan holds it, and
        ``plan.seqlen`` is ``S'``).

    Example (2 ranks, a causal-document row of 8 tokens, Ulysses)::

        batch = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]), "labels": ids}
        local, plan = shard_packed_batch(batch, group=cp_group, mode="ulysses")
        # rank 0: local["input_ids"] == ids[:, :4], local["shift_labels"] == labels[:, 1:5]
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if "input_ids" not in batch:
        raise ValueError("the batch needs input_ids [B, S]")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(ids.shape)}")
    bsz, s = ids.shape
    b = {k: v for k, v in batch.items()}
    am = b.pop("attention_mask", None)
    if am is not None and not bool(am.bool().all()):
        raise NotImplementedError("context parallelism does not take a padding attention_mask; pack with a "
                                  "padding document instead (PackedSFTCollator does)")
    if "position_ids" not in b or b["position_ids"] is None:
        b["position_ids"] = torch.arange(s, device=ids.device).expand(bsz, s).contiguous()
    if b["position_ids"].shape != (bsz, s):
        b["position_ids"] = b["position_ids"].reshape(-1, s).expand(bsz, s).contiguous()
    labels = b.pop("labels", None)
    if labels is not None:
        if "shift_labels" in b:
            raise ValueError("give labels or shift_labels, not both")
        b["shift_labels"] = shift_labels(labels)
    num_items = None
    if "shift_labels" in b:
        num_items = (b["shift_labels"] != IGNORE_INDEX).sum()
    mask = b.get(mask_key)
    if mask is not None:
        check_mask_tensor(mask, batch_size=bsz, name=mask_key)  # the rule of flashmask_attention
    cu = b.pop("cu_seq_lens_q", None)
    b.pop("cu_seq_lens_k", None)
    for key in ("max_length_q", "max_length_k"):
        b.pop(key, None)
    if mask is None:
        if cu is not None:
            check_cu_seqlens(cu, bsz * s, "cu_seq_lens_q")
        starts = (cu_seqlens_starts(cu, bsz, s, device=ids.device) if cu is not None
                  else document_starts(b["position_ids"]))
        if cu is not None or bool(starts[:, 1:].any()):  # one document per row needs no mask
            mask = from_starts(starts, causal)
    b[mask_key] = mask
    world, _ = _comm.world_and_rank(group)
    # all-gather-KV: room for the balancer's finest default chunking (8 chunks per rank)
    multiple = world if mode == "ulysses" else (num_chunks or 8 * world) * align
    b = pad_packed_batch(b, multiple, causal=causal, pad_token_id=pad_token_id, mask_key=mask_key)
    mask = b.pop(mask_key)
    s_new = b["input_ids"].shape[1]
    plan = make_plan(mask, causal, s_new, group=group, mode=mode, num_chunks=num_chunks, align=align,
                     strategy=strategy)
    plan.position_ids = b["position_ids"]  # to check a model's sliding window against (ContextParallelPlan.windowed)
    local = {}
    for key, t in b.items():
        if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape == (bsz, s_new):
            local[key] = plan.shard(t)
        else:
            local[key] = t
    if num_items is not None:
        local["num_items_in_batch"] = num_items
    return local, plan
