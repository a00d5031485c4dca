"""The masks each method of the end-to-end benchmark (benchmarks/bench_train.py) gives a
transformers model, per layer type, and the checks that they are the packed-document mask.

flashmask gets the collator's ``startend_row_indices``; ``sdpa_dense`` and ``eager_dense`` a dense
mask expanded from it; ``flex`` a ``BlockMask`` from a ``mask_mod`` reading it (or transformers' own
from the restarting ``position_ids``). On a model with sliding-window layers each layer type gets
its own mask, the window (or Llama 4's chunks) merged in as flashmask's backend merges it.
"""
from __future__ import annotations

import argparse
import inspect
from typing import Optional

import torch

from benchmarks.dense_masks import dense_mask
from benchmarks.flex import FLEX_MASK_MODS, build_block_mask
from benchmarks.train_data import synthetic_batches

# The methods whose masks are built here (flashmask's is the batch's own).
MASK_METHODS = ("flashmask", "sdpa_dense", "flex", "eager_dense")


class Chunk(int):
    """The chunk size of a chunked-attention layer type (Llama 4), told apart from a window."""

    def __repr__(self) -> str:
        return f"Chunk({int(self)})"


def layer_windows(cfg) -> Optional[dict]:
    """``{layer type: sliding window, Chunk(size) or None}`` of a model with sliding-window layers
    (Gemma 3, Qwen2 with a window) or chunked-attention ones (Llama 4), in the order of
    ``cfg.layer_types``; ``None`` when every layer attends alike."""
    types = list(dict.fromkeys(getattr(cfg, "layer_types", None) or []))
    if "sliding_attention" not in types and "chunked_attention" not in types:
        return None
    other = [t for t in types if t not in ("full_attention", "sliding_attention", "chunked_attention")]
    if other:
        raise RuntimeError(f"layer types {other} of this model have no mask here (full_attention, "
                           "sliding_attention and chunked_attention only)")
    limits = {"full_attention": None}
    for kind, field, make in (("sliding_attention", "sliding_window", int),
                              ("chunked_attention", "attention_chunk_size", Chunk)):
        if kind in types:
            if getattr(cfg, field, None) is None:
                raise RuntimeError(f"the model has {kind} layers but config.{field} is None")
            limits[kind] = make(getattr(cfg, field))
    return {t: limits[t] for t in types}


def layer_startends(startend: torch.Tensor, windows: Optional[dict],
                    position_ids: Optional[torch.Tensor] = None) -> dict:
    """The mask of each layer type: ``startend`` itself, with the causal window ``w`` (key ``j``
    seen from query ``i`` iff ``i - w < j <= i``, transformers' rule) merged in on sliding layers, and
    the chunks of ``position_ids`` (:func:`masks.merge_chunks`) on chunked ones, as flashmask's
    backend merges them. ``{None: startend}`` when every layer attends alike."""
    from masks.convert import merge_chunks, merge_window
    if windows is None:
        return {None: startend}
    s = startend.shape[2]

    def limited(w):
        if w is None or w >= s:
            return startend
        if isinstance(w, Chunk):
            return merge_chunks(startend, int(w), s, position_ids)
        return merge_window(startend, True, (w - 1, 0), s)

    return {t: limited(w) for t, w in windows.items()}


def mask_inputs(method: str, args, batch: dict, device: torch.device, dtype: torch.dtype,
                windows: Optional[dict] = None) -> dict:
    """The mask arguments of the model for one batch (on ``device``), built as the method needs.

    ``windows`` (:func:`layer_windows`): sdpa_dense, eager_dense and flex then pass
    ``attention_mask`` as a dict ``{layer type: mask}``; flashmask's backend gets the window from
    the model in every layer. eager_dense gets the additive mask whatever ``--dense-mask`` says:
    eager attention adds the mask to the scores.
    """
    from flashmask.data import MASK_KEY
    startend = batch[MASK_KEY]
    bsz, _, s, _ = startend.shape
    if method == "flashmask":
        return {MASK_KEY: startend}
    if method == "flex" and args.flex_mask == "position_ids":
        return {}
    if method not in ("sdpa_dense", "eager_dense", "flex"):
        raise ValueError(f"unknown method {method!r}; choose from {MASK_METHODS}")
    out = {}
    for layer_type, se in layer_startends(startend, windows, position_ids=batch.get("position_ids")).items():
        if method == "eager_dense":
            out[layer_type] = dense_mask(se, True, s, dtype=dtype)
        elif method == "sdpa_dense":
            out[layer_type] = dense_mask(se, True, s, dtype=dtype if args.dense_mask == "additive" else torch.bool)
        else:
            mm = FLEX_MASK_MODS.get(se, True, s, None, tag=layer_type)
            out[layer_type], _ = build_block_mask(mm, None if bsz == 1 else bsz, None, s, s, device,
                                                  args.flex_block_mask)
    return {"attention_mask": out[None] if windows is None else out}


def hf_layer_masks(model, batch: dict, device: torch.device, dtype: torch.dtype,
                   windows: Optional[dict]) -> dict:
    """The masks transformers makes from the batch's restarting ``position_ids`` for the model's
    attention implementation, per layer type (:func:`layer_startends`' keys)."""
    from transformers import masking_utils
    pos = batch["position_ids"]
    bsz, s = pos.shape
    params = inspect.signature(masking_utils.create_causal_mask).parameters
    kw = {"config": model.config, "attention_mask": None, "position_ids": pos,
          "cache" if "cache" in params else "past_key_values": None}
    emb = torch.empty(bsz, s, 1, dtype=dtype, device=device)  # only its shape, dtype and device are read
    kw["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = emb
    if "cache_position" in params:
        kw["cache_position"] = torch.arange(s, device=device)
    if windows is None:
        return {None: masking_utils.create_causal_mask(**kw)}
    out = {}
    for layer_type, w in windows.items():
        make = (masking_utils.create_causal_mask if w is None else masking_utils.create_chunked_causal_mask
                if isinstance(w, Chunk) else masking_utils.create_sliding_window_causal_mask)
        out[layer_type] = make(**kw)
    return out


def _layer_name(layer_type: Optional[str]) -> str:
    return "every layer's" if layer_type is None else f"the {layer_type} layers'"


def check_hf_packed_block_mask(model, args, batch: dict, device: torch.device, dtype: torch.dtype) -> None:
    """``--flex-mask position_ids``: raise unless transformers' block masks from the restarting
    position_ids equal (block by block, partial and full blocks, per layer type) ours."""
    windows = layer_windows(model.config)
    theirs = hf_layer_masks(model, batch, device, dtype, windows)
    ours = mask_inputs("flex", argparse.Namespace(**{**vars(args), "flex_mask": "block_mask"}), batch, device,
                       dtype, windows)["attention_mask"]
    if windows is None:
        ours = {None: ours}
    bsz = batch["position_ids"].shape[0]

    def blocks(bm):
        full = bm.full_kv_num_blocks
        return bm.to_dense().expand(bsz, -1, -1, -1), None if full is None else full.expand(bsz, -1, -1)

    for layer_type, bm in theirs.items():
        if bm is None or not hasattr(bm, "to_dense"):
            raise RuntimeError(f"transformers made no BlockMask from position_ids for {_layer_name(layer_type)} "
                               f"attention (got {type(bm).__name__})")
        (a, fa), (b, fb) = blocks(bm), blocks(ours[layer_type])
        if not torch.equal(a.bool(), b.bool()) or (fa is not None and fb is not None and not torch.equal(fa, fb)):
            raise RuntimeError(f"transformers' block mask from position_ids for {_layer_name(layer_type)} attention "
                               "differs from the packed-document mask")


def expected_mask(position_ids: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """bool ``[B, S, S]``: query ``i`` sees key ``j`` iff both are in the same document (documents
    start where ``position_ids`` is 0), ``j <= i`` and, with a ``window``, ``i - window < j``; with a
    :class:`Chunk`, both positions in the same chunk of that many."""
    doc = (position_ids == 0).cumsum(-1)
    i = torch.arange(position_ids.shape[-1], device=position_ids.device)
    seen = (doc[:, :, None] == doc[:, None, :]) & (i[None, :] <= i[:, None])
    if isinstance(window, Chunk):
        chunk = position_ids // int(window)
        seen &= chunk[:, :, None] == chunk[:, None, :]
    elif window is not None:
        seen &= i[:, None] - i[None, :] < window
    return seen


def _block_table(num: torch.Tensor, idx: torch.Tensor, nk: int) -> torch.Tensor:
    """bool ``[B, H, Q blocks, nk]`` from a BlockMask's (count, indices) pair."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    out = torch.zeros(*idx.shape[:-1], nk + 1, dtype=torch.bool, device=idx.device)
    return out.scatter_(-1, torch.where(valid, idx.long(), nk), True)[..., :nk]


def block_mask_as_dense(bm, bsz: int, s: int) -> torch.Tensor:
    """bool ``[B, S, S]``: what FlexAttention computes with ``bm`` (head 0): its full blocks, and its
    partial blocks where the mask_mod is True; every other block is skipped."""
    from torch.nn.attention.flex_attention import create_mask
    qb, kb = bm.BLOCK_SIZE
    nk = -(-s // kb)

    def elements(t):
        t = t.expand(bsz, -1, -1, -1)[:, 0]
        return t.repeat_interleave(qb, -2).repeat_interleave(kb, -1)[:, :s, :s]

    partial = elements(_block_table(bm.kv_num_blocks, bm.kv_indices, nk))
    full = torch.zeros_like(partial)
    if bm.full_kv_num_blocks is not None:
        full = elements(_block_table(bm.full_kv_num_blocks, bm.full_kv_indices, nk))
    mod = create_mask(bm.mask_mod, bsz, 1, s, s, device=bm.kv_num_blocks.device)[:, 0]
    return full | (partial & mod)


def check_layer_masks(method: str, model, args, seqlen: int, device: torch.device, dtype: torch.dtype) -> str:
    """Before timing: the masks ``method`` gives the model (sdpa_dense: the dense masks; flex: our
    block masks, or transformers' with ``--flex-mask position_ids``), per layer type, on a small
    packed row (up to 2048 tokens, 4 windows or 4 chunks) whose documents are longer than the window,
    equal element by element :func:`expected_mask`. Raises ``RuntimeError``; returns a note."""
    windows = layer_windows(model.config)
    limits = [w for w in (windows or {}).values() if w is not None]
    widest = max([w for w in limits if not isinstance(w, Chunk)], default=0)
    chunk = max([w for w in limits if isinstance(w, Chunk)], default=0)
    s = min(seqlen, max(2048, 4 * widest, 4 * chunk))
    batch = synthetic_batches(1, min(args.batch, 2), s, args.vocab_size, (max(1, s // 8), max(1, s // 2)),
                              args.seed + 1)[0]
    batch = {k: v.to(device) for k, v in batch.items()}
    if method == "flex" and args.flex_mask == "position_ids":
        given = hf_layer_masks(model, batch, device, dtype, windows)
    else:
        small = argparse.Namespace(**{**vars(args), "flex_block_mask": "eager"})
        given = mask_inputs(method, small, batch, device, dtype, windows)["attention_mask"]
        given = {None: given} if windows is None else given
    pos = batch["position_ids"]
    for layer_type, mask in given.items():
        want = expected_mask(pos, None if windows is None else windows[layer_type])
        if hasattr(mask, "mask_mod"):
            got = block_mask_as_dense(mask, pos.shape[0], s)
        elif isinstance(mask, torch.Tensor):
            got = (mask if mask.dtype == torch.bool else mask == 0).expand(pos.shape[0], -1, -1, -1)[:, 0]
        else:
            raise RuntimeError(f"{method}: {_layer_name(layer_type)} mask is a {type(mask).__name__}")
        if not torch.equal(got, want):
            bad = int((got != want).sum())
            raise RuntimeError(f"{method}: {_layer_name(layer_type)} mask differs from the packed-document "
                               f"mask{'' if layer_type != 'sliding_attention' else ' with the sliding window'} at "
                               f"{bad} of {want.numel()} (query, key) pairs of a {s}-token row")
    return f"masks checked on a {s}-token row" + ("" if windows is None else " per layer type")
