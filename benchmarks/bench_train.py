"""End to end: a packed SFT training step of a 0.5B-3B transformers model, per attention backend.

A randomly initialised transformers model (``training_examples.models.build_model``; ``--arch
llama|qwen2`` presets ``0.5b`` = Qwen2-0.5B shape, ``1b`` = Llama-3.2-1B shape, ``3b`` =
Llama-3.2-3B shape (head dim 128); ``--arch gemma3`` preset ``1b`` = Gemma-3-1B shape (head dim
256, a 512-token sliding window on 5 layers of 6); ``--arch gemma2`` preset ``2b`` = Gemma-2-2B's
widths (head dim 256, logit soft-capping 50 on the scores and 30 on the final logits, a 4096-token
window on every other layer) with 8 layers; ``--arch gpt_oss`` preset ``20b`` = GPT-OSS-20B's
widths (head dim 64, attention sinks, a 128-token window on every other layer) with 8 layers and
one expert (a dense MLP); ``--arch deepseek_v3`` presets ``16h`` / ``32h`` = DeepSeek-V3's
multi-head latent attention with 16 / 32 heads (q/k head dim 192, v head dim 128) and dense MLPs;
``--arch llama4`` preset ``scout`` = Llama 4 Scout's attention (chunks of 8192 on 3 layers of 4) with
8 layers and dense MLPs; ``tiny`` of each for CPU tests; ``--layers`` sets the depth) trains with
AdamW in bf16 on synthetic packed rows: random token ids, documents of random lengths packed to
exactly the context length by :class:`flashmask.data.PackedSFTCollator` (``position_ids`` restart
at every document, label ``-100`` on every document's first token, and the causal-document mask
``attn_mask_startend_row_indices``). Every method trains the same model (same seed) on the same
batches under the same mask:

* ``flashmask``: ``attn_implementation="fm_colmask"`` (:mod:`flashmask.integrations.transformers`),
  the collator's ``attn_mask_startend_row_indices`` passed to the model;
* ``sdpa_dense``: ``attn_implementation="sdpa"`` with an explicit 4-D ``[B, 1, S, S]`` mask
  expanded from the same ``startend_row_indices`` (additive in the model dtype by default, so that
  every layer uses the one tensor; ``--dense-mask bool``: SDPA converts it on every call); "does not
  fit" when that mask would take more than ``--dense-mem-fraction`` of the free memory;
* ``flex``: ``attn_implementation="flex_attention"`` with a ``BlockMask`` made by
  ``create_block_mask`` from a ``mask_mod`` read from the same ``startend_row_indices``
  (``--flex-mask position_ids``: transformers builds the packed block mask itself from the
  restarting ``position_ids``, checked against ours before timing);
* ``eager_dense``: ``attn_implementation="eager"`` (the scores materialised) with the additive
  masks of ``sdpa_dense``; "does not fit" when the masks and two ``[B, H, S, S]`` tensors of one
  layer would take more than ``--dense-mem-fraction`` of the free memory.

Gemma 2 and GPT-OSS: transformers runs their soft-capping and sinks with eager attention and
flex_attention (a ``score_mod``; the sinks by renormalising the output with the LSE), and refuses
SDPA, which can compute neither: ``sdpa_dense`` is an ``n/a`` row for them, and their default
methods are flashmask, flex and eager_dense. The chunked loss applies the final logit
soft-capping as the model's own head does.

A model whose layers attend differently (Gemma 3: a causal sliding window on its sliding layers,
global attention on the others; Qwen2 with ``--sliding-window``) gets the window on top of the
document mask on its sliding layers with every method: flashmask's backend merges the window the
model passes to each layer into the mask; ``sdpa_dense`` and ``flex`` get one mask per layer type
(a dict ``{layer type: mask}``, the form the model's forward accepts), each built from the same
``startend_row_indices`` with the window merged in (``masks.convert.merge_window``, as flashmask
does). Before timing, the dense and flex masks the model will see (flex: ours, or transformers'
with ``--flex-mask position_ids``) are compared, element by element and per layer type, with the
document-causal (and sliding-window) mask of a small packed row computed from its documents.

A step = building the method's mask from the batch (the collator's ``startend_row_indices`` is
the data pipeline's; the dense mask and the block mask are built per batch, as they would be in
training), forward, loss, backward, ``optimizer.step()``, ``zero_grad``. After ``--warmup-steps``
(compilation for flex), ``--steps`` steps are timed one by one (``torch.cuda.synchronize`` +
``perf_counter``); peak memory is ``torch.cuda.max_memory_allocated`` over the timed steps (reset
before the first), so it includes weights, gradients and AdamW states. ``--find-max`` then
doubles the context of each method from the largest ``--seqlens`` until a step fails (OOM, or a
dense mask that does not fit) or ``--max-seqlen`` is passed, and reports the longest that trained.

Examples::

    python -m benchmarks.bench_train                                   # 0.5b, 8K and 32K, 3 methods
    python -m benchmarks.bench_train --model-size 1b --gradient-checkpointing --find-max
    python -m benchmarks.bench_train --methods flashmask,flex --seqlens 8k,32k,64k --steps 10
    python -m benchmarks.bench_train --arch gemma3 --seqlens 32k,128k --methods flashmask,flex \
        --doc-len 8192,32768 --gradient-checkpointing --steps 3 --warmup-steps 2
    python -m benchmarks.bench_train --arch gemma2 --seqlens 8k,32k --gradient-checkpointing  # + eager, flex
    python -m benchmarks.bench_train --arch gpt_oss --seqlens 8k,32k --gradient-checkpointing
    python -m benchmarks.bench_train --arch gemma3 --seqlens 32k --methods flashmask,flex --profile  # attention's share

``--profile`` runs one more step per row under ``torch.profiler`` (:mod:`benchmarks.step_profile`)
and reports its GPU time split into attention kernels and the rest, with a Chrome trace per row.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional

import torch

from benchmarks.cli import DTYPES, add_testing_args, parse_choice_list, parse_int_list
from benchmarks.cuda_memory import cleanup, peak_since, reset_peak
from benchmarks.dense_masks import dense_fit, eager_fit
from benchmarks.errors import format_error, is_fatal_cuda_error, status_of
from benchmarks.flex import configure_dynamo
from benchmarks.methods import Skip
from benchmarks.output import default_out_dir, environment, write_results
from benchmarks.report import fmt_len, format_table, shorten, table_cell
from benchmarks.step_profile import profile_step
from benchmarks.timing import sync
from benchmarks.train_data import data_stats, synthetic_batches
from benchmarks.train_masks import (
    MASK_METHODS,
    check_hf_packed_block_mask,
    check_layer_masks,
    layer_windows,
    mask_inputs,
)
from flashmask.losses import decoder_of, final_logit_softcap
from training_examples.byte_tokenizer import VOCAB_SIZE
from training_examples.models import ARCHS, DEFAULT_SIZE, WINDOW_ARCHS, arch_sizes
from training_examples.models import build_model as build_preset

TRAIN_METHODS = MASK_METHODS
# The transformers attn_implementation of each method (fm_colmask: flashmask.integrations.transformers).
ATTN_IMPLEMENTATION = {"flashmask": "fm_colmask", "sdpa_dense": "sdpa", "flex": "flex_attention",
                       "eager_dense": "eager"}
# The methods of a run without --methods: the attention implementations transformers runs each model with.
DEFAULT_METHODS = {"gemma2": ("flashmask", "flex", "eager_dense"), "gpt_oss": ("flashmask", "flex", "eager_dense")}
OTHER_DEFAULT_METHODS = ("flashmask", "sdpa_dense", "flex")
# Models whose attention SDPA cannot compute: transformers refuses attn_implementation="sdpa" for them.
NO_SDPA = {"gemma2": "SDPA has no logit soft-capping (Gemma 2's attn_logit_softcapping)",
           "gpt_oss": "SDPA has no attention sinks (GPT-OSS's s_aux: its sdpa path would drop them)"}
FIELDS = ("model", "params", "seqlen", "batch", "method", "attn_implementation", "status", "find_max",
          "tokens_per_s", "ms_per_step", "ms_min", "mask_ms", "peak_mem_gib", "peak_mem_bytes", "first_step_s",
          "loss_first", "loss_last", "docs_per_row", "density", "profiled_ms", "kernel_ms", "attn_kernel_ms",
          "attn_share", "notes")
MAX_SEQLEN = 1 << 20  # 1M tokens: a 0.5B model with gradient checkpointing runs out of memory there on 80 GB
_FALLBACK_WARNING = "flashmask: using the reference path"
PROFILE_TOP = 25  # --profile: the kernels (name, ms, count) taking the most time, kept in train.json


def _preset_text(dims: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in dims.items())


def build_parser() -> argparse.ArgumentParser:
    sizes = {a: arch_sizes(a) for a in ARCHS}
    all_sizes = sorted({k for v in sizes.values() for k in v})
    epilog = "Model presets per arch: " + "; ".join(
        f"{a if a != 'llama' else 'llama/qwen2'} {k} ({_preset_text(d)})"
        for a, v in sizes.items() if a != "qwen2" for k, d in v.items())
    p = argparse.ArgumentParser(
        prog="bench_train.py",
        description="Packed SFT training step (tokens/s, peak memory) of a randomly initialised transformers model "
                    "with flashmask, SDPA with a dense mask, and FlexAttention as transformers attention backends.",
        epilog=epilog, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-size", default=None, choices=all_sizes,
                   help="preset of --arch; llama/qwen2: 0.5b = Qwen2-0.5B shape, 1b = Llama-3.2-1B shape (both head "
                        "dim 64), 3b = Llama-3.2-3B shape (head dim 128); gemma3: 1b = Gemma-3-1B shape; "
                        "deepseek_v3: 16h / 32h = its attention with 16 / 32 heads; tiny/small: tests. Default: "
                        + ", ".join(f"{a} {k}" for a, k in DEFAULT_SIZE.items()))
    p.add_argument("--arch", default="llama", choices=list(ARCHS), help="transformers model class")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: the preset's; gemma3 keeps one global layer in 6, so with fewer "
                        "than 6 layers every layer slides)")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="gemma2, gemma3, gpt_oss: the window of their sliding layers (default the preset's); qwen2: a "
                        "window on every layer")
    p.add_argument("--vocab-size", type=int, default=32000, help="embedding and LM head rows (>= 320)")
    p.add_argument("--seqlens", default="8192,32768", help="context lengths (tokens per packed row); 'k' = 1024")
    p.add_argument("--batch", type=int, default=1, help="packed rows per step")
    p.add_argument("--methods", default=None,
                   help=f"comma list of {', '.join(TRAIN_METHODS)}; default: {','.join(OTHER_DEFAULT_METHODS)}, and "
                        f"{','.join(DEFAULT_METHODS['gemma2'])} for gemma2 and gpt_oss (which SDPA cannot run)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (compilation, allocator)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="parameter and compute dtype")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in backward")
    p.add_argument("--keep-attention", action="store_true",
                   help="with --gradient-checkpointing: flashmask's layers keep their attention output and the "
                        "recompute skips the attention (flashmask.checkpointing.keep_attention_context); the other "
                        "methods recompute it (the same policy leaves transformers' compiled flex_attention alone)")
    p.add_argument("--doc-len", default="128,4096",
                   help="MIN,MAX document length (uniform); the last document of a row is cut to fill it")
    p.add_argument("--loss", default="chunked", choices=["chunked", "full"],
                   help="chunked: LM head + cross-entropy per --loss-chunk tokens, recomputed in backward (the "
                        "[S, vocab] logits never exist whole); full: model(..., labels=...).loss")
    p.add_argument("--loss-chunk", type=int, default=4096, help="tokens per chunk of the chunked loss")
    p.add_argument("--find-max", action="store_true",
                   help="for each method, double the context from the largest --seqlens until a step fails")
    p.add_argument("--max-seqlen", type=int, default=MAX_SEQLEN, help="upper bound of --find-max")
    p.add_argument("--dense-mask", default="additive", choices=["additive", "bool"],
                   help="sdpa_dense: the 4-D mask given to the model (bool: SDPA makes an additive copy per call); "
                        "eager_dense always gets the additive one (eager attention adds the mask to the scores)")
    p.add_argument("--dense-mem-fraction", type=float, default=0.5,
                   help="sdpa_dense runs only if its S^2 masks fit in this share of the free memory, eager_dense "
                        "only if its masks and one layer's S^2 attention weights do")
    p.add_argument("--flex-mask", default="block_mask", choices=["block_mask", "position_ids"],
                   help="flex: pass a BlockMask built from the library mask, or only position_ids (transformers "
                        "builds the packed block mask inside the forward)")
    p.add_argument("--flex-block-mask", default="compile", choices=["compile", "eager", "auto"],
                   help="how create_block_mask runs for --flex-mask block_mask (eager materialises S x S)")
    p.add_argument("--alloc-conf", default="expandable_segments:True",
                   help="PYTORCH_CUDA_ALLOC_CONF for this run when the environment sets none ('' = the default "
                        "allocator); expandable segments avoid fragmentation OOMs at long contexts")
    p.add_argument("--out", default=None, help="folder for train.csv / train.json; default runs/train")
    p.add_argument("--seed", type=int, default=0, help="model init and data")
    p.add_argument("--profile", action="store_true",
                   help="one more step per row under torch.profiler: its GPU time split into attention kernels "
                        "and the rest (benchmarks/step_profile.py), and a Chrome trace trace_METHOD_S.json in --out")
    add_testing_args(p)
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.seqlens = parse_int_list(args.seqlens)
        methods = DEFAULT_METHODS.get(args.arch, OTHER_DEFAULT_METHODS)
        args.methods = parse_choice_list(args.methods or ",".join(methods), TRAIN_METHODS, "methods")
        args.doc_len = parse_int_list(args.doc_len)
    except ValueError as e:
        parser.error(str(e))
    if len(args.doc_len) != 2 or args.doc_len[0] > args.doc_len[1]:
        parser.error(f"--doc-len takes MIN,MAX with MIN <= MAX, got {args.doc_len}")
    for name in ("batch", "steps", "loss_chunk", "max_seqlen"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    min_vocab = VOCAB_SIZE  # the model config's pad/bos/eos ids are 256-258
    if args.vocab_size < min_vocab:
        parser.error(f"--vocab-size must be >= {min_vocab}")
    if args.warmup_steps < 0:
        parser.error("--warmup-steps must be >= 0")
    sizes = arch_sizes(args.arch)
    if args.model_size is None:
        args.model_size = DEFAULT_SIZE[args.arch]
    elif args.model_size not in sizes:
        parser.error(f"--model-size {args.model_size} is not a preset of --arch {args.arch}; choose from "
                     f"{sorted(sizes)}")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    if args.sliding_window is not None and (args.arch not in WINDOW_ARCHS or args.sliding_window < 1):
        parser.error(f"--sliding-window takes a value >= 1 with --arch {', '.join(WINDOW_ARCHS)}, got "
                     f"{args.sliding_window} with --arch {args.arch}")
    if args.keep_attention and not args.gradient_checkpointing:
        parser.error("--keep-attention needs --gradient-checkpointing (it changes what the recompute skips)")
    if args.flex_no_compile:
        args.flex_block_mask = "eager"  # transformers compiles flex_attention itself in any case
    if args.out is None:
        args.out = default_out_dir("train")
    return args


# --------------------------------------------------------------------------------------------
# Model, masks, loss, step
# --------------------------------------------------------------------------------------------

def build_model(args, method: str, seqlen: int, device: torch.device, dtype: torch.dtype):
    """``training_examples.models.build_model`` (created directly on a CUDA device), in training mode."""
    if method == "flashmask":
        import flashmask.integrations.transformers as fm_hf  # registers the backend
        assert fm_hf.ATTN_IMPLEMENTATION == ATTN_IMPLEMENTATION["flashmask"]
    ctx = torch.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        model = build_preset(args.arch, args.model_size, attn_implementation=ATTN_IMPLEMENTATION[method],
                             max_length=seqlen, vocab_size=args.vocab_size, dtype=dtype, device=device,
                             seed=args.seed, sliding_window=args.sliding_window, num_layers=args.layers)
    model.config.use_cache = False
    if args.gradient_checkpointing:
        kw = {"use_reentrant": False}
        if args.keep_attention and method == "flashmask":
            from flashmask.checkpointing import keep_attention_context
            kw["context_fn"] = keep_attention_context
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    model.train()
    return model


def attention_dims(cfg) -> tuple:
    """``(query heads, key/value heads, q/k head dim, v head dim)`` of a transformers config."""
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if getattr(cfg, "qk_nope_head_dim", None) is not None:  # multi-head latent attention (DeepSeek-V2/V3)
        return heads, kv_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, kv_heads, hd, hd


def check_method(method: str, args, model, seqlen: int, device: torch.device, dtype: torch.dtype) -> List[str]:
    """Checks before building anything big; returns notes for the row. Raises :class:`Skip`
    (an ``n/a`` row: the dense mask does not fit) or ``RuntimeError``."""
    cfg = model.config
    windows = layer_windows(cfg)
    notes = []
    for kind, what in (("sliding_attention", "sliding window"), ("chunked_attention", "chunks of")):
        if windows is not None and kind in windows:
            notes.append(f"{what} {int(windows[kind])} on {cfg.layer_types.count(kind)}/{len(cfg.layer_types)} layers")
    notes += option_notes(method, model)
    if args.keep_attention:  # the policy keeps the kernels' output; the reference path's ops are recomputed
        import flashmask
        kept = (method == "flashmask" and args.flashmask_backend != "reference" and device.type == "cuda"
                and flashmask.cuda.available())
        notes.append("attention kept" if kept else "attention recomputed")
    if method == "flashmask":
        import flashmask
        from flashmask import _checks
        if args.flashmask_backend == "cuda":
            if not flashmask.cuda.available():
                raise RuntimeError(f"flashmask CUDA kernels unavailable: {flashmask.cuda.unavailable_reason()}")
            heads, kv_heads, dqk, dv = attention_dims(cfg)
            q = torch.empty(1, 8, heads, dqk, dtype=dtype, device=device)
            k = torch.empty(1, 8, kv_heads, dqk, dtype=dtype, device=device)
            v = torch.empty(1, 8, kv_heads, dv, dtype=dtype, device=device)
            reason = _checks.kernel_unsupported_reason(q, k, v)
            if reason is None and device.type == "cuda":
                reason = flashmask.cuda.build_unsupported_reason(q, dv)
            if reason is not None:
                raise RuntimeError(f"flashmask CUDA kernels cannot run this model: {reason}")
        elif not (device.type == "cuda" and flashmask.cuda.available()):
            notes.append("flashmask reference path")
    elif method == "sdpa_dense":
        n_masks = 1 if windows is None else len(windows)
        fits, note = dense_fit(args.batch * n_masks, 1, seqlen, seqlen, dtype, device, args.dense_mem_fraction,
                               additive=args.dense_mask == "additive")
        if not fits:
            raise Skip(note + ("" if n_masks == 1 else f"; one mask per layer type: {n_masks}"))
        notes.append(f"{args.dense_mask} mask" + ("" if n_masks == 1 else f" per layer type ({n_masks})"))
    elif method == "eager_dense":
        n_masks = 1 if windows is None else len(windows)
        fits, note = eager_fit(args.batch, cfg.num_attention_heads, n_masks, seqlen, seqlen, dtype, device,
                               args.dense_mem_fraction)
        if not fits:
            raise Skip(note)
        notes.append("additive mask" + ("" if n_masks == 1 else f" per layer type ({n_masks})")
                     + "; S^2 attention weights per layer")
    elif method == "flex":
        from transformers.utils import is_torch_flex_attn_available
        if not is_torch_flex_attn_available():
            raise Skip("n/a (this torch/transformers has no flex_attention)")
        h = cfg.num_attention_heads
        if h & (h - 1):
            notes.append(f"transformers repeats K/V for flex ({h} heads: not a power of 2)")
        notes.append("BlockMask from position_ids (transformers)" if args.flex_mask == "position_ids"
                     else f"BlockMask {args.flex_block_mask}")
    return notes


def option_notes(method: str, model) -> List[str]:
    """What the row's method does with the model's soft-capping and attention sinks (every method
    offered computes them: SDPA, which cannot, is n/a for such models)."""
    cfg = model.config
    notes = []
    if getattr(cfg, "attn_logit_softcapping", None):
        how = {"flex": " (score_mod)", "eager_dense": " (tanh on the scores)"}.get(method, "")
        notes.append(f"attention softcap {cfg.attn_logit_softcapping:g}{how}")
    if getattr(cfg, "final_logit_softcapping", None):
        notes.append(f"final logit softcap {cfg.final_logit_softcapping:g}")
    if any(n.endswith("self_attn.sinks") for n, _ in model.named_parameters()):
        how = {"flex": " (output renormalised by the LSE, after the kernel)",
               "eager_dense": " (an extra softmax column)"}.get(method, "")
        notes.append(f"sinks{how}")
    return notes


def _ce_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
            softcap: Optional[float] = None):
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def chunked_lm_loss(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, chunk: int,
                    softcap: Optional[float] = None) -> torch.Tensor:
    """The causal-LM loss of transformers (labels shifted inside, mean over labels != -100, logits
    in float32), computed ``chunk`` tokens at a time with the logits recomputed in backward.
    ``softcap``: the model's final logit soft-capping (Gemma 2: ``softcap * tanh(logits / softcap)``)."""
    from torch.utils.checkpoint import checkpoint
    y = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100).reshape(-1)
    h = hidden.reshape(-1, hidden.shape[-1])
    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, h.shape[0], chunk):
        total = total + checkpoint(_ce_sum, h[i:i + chunk], head.weight, head.bias, y[i:i + chunk], softcap,
                                   use_reentrant=False)
    return total / (y != -100).sum().clamp_min(1)


def train_step(model, opt, batch: dict, mask_kw: dict, args) -> torch.Tensor:
    inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **mask_kw)
    if args.loss == "full":
        loss = model(labels=batch["labels"], **inputs).loss
    else:
        hidden = decoder_of(model)(**inputs).last_hidden_state
        loss = chunked_lm_loss(hidden, model.get_output_embeddings(), batch["labels"], args.loss_chunk,
                               final_logit_softcap(model))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def masked_step(method: str, model, opt, batch: dict, args, device, dtype, windows) -> torch.Tensor:
    """One step with the method's mask built from ``batch`` first, as a timed step is."""
    return train_step(model, opt, batch, mask_inputs(method, args, batch, device, dtype, windows), args)


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------

def run_one(method: str, seqlen: int, batches: List[dict], args, device: torch.device, dtype: torch.dtype,
            where: dict) -> dict:
    """Train ``method`` on ``batches`` (warmup + timed); returns the measured fields. ``where['stage']``
    says how far it got (for the message of an exception)."""
    if method == "sdpa_dense" and args.arch in NO_SDPA:
        raise Skip(f"{NO_SDPA[args.arch]}; transformers refuses attn_implementation='sdpa' for this model")
    where["stage"] = "model"
    model = build_model(args, method, seqlen, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    where["params"] = params
    notes = check_method(method, args, model, seqlen, device, dtype)
    windows = layer_windows(model.config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if method in ("sdpa_dense", "eager_dense", "flex"):
        where["stage"] = "checking the masks"
        notes.append(check_layer_masks(method, model, args, seqlen, device, dtype))
    if method == "flex" and args.flex_mask == "position_ids":
        where["stage"] = "checking transformers' block mask"
        check_hf_packed_block_mask(model, args, {k: v.to(device) for k, v in batches[0].items()}, device, dtype)
        notes.append("checked against the library mask")
    times, mask_times, losses = [], [], []
    first_step_s = None
    with warnings.catch_warnings():
        if method == "flashmask" and args.flashmask_backend == "cuda":
            # No silent reference path on a GPU: its warning becomes an error. flashmask warns once per
            # reason and process, so forget the reasons already given (by an earlier run of this process).
            getattr(sys.modules.get("flashmask.attention"), "_warned", set()).clear()
            warnings.filterwarnings("error", message=_FALLBACK_WARNING)
        for i, cpu_batch in enumerate(batches):
            timed = i >= args.warmup_steps
            label = f"step {i + 1}/{len(batches)}" + ("" if timed else " (warmup)")
            where["stage"] = label
            if i == args.warmup_steps:
                reset_peak(device)
            batch = {k: v.to(device) for k, v in cpu_batch.items()}
            sync(device)
            t0 = time.perf_counter()
            mask_kw = mask_inputs(method, args, batch, device, dtype, windows)
            sync(device)
            t1 = time.perf_counter()
            loss = float(train_step(model, opt, batch, mask_kw, args))
            sync(device)
            t2 = time.perf_counter()
            batch = mask_kw = None  # free this step's mask before the next one is built
            losses.append(loss)
            if i == 0:
                first_step_s = t2 - t0
            if timed:
                times.append(t2 - t0)
                mask_times.append(t1 - t0)
            print(f"    {label:18s} {(t2 - t0) * 1e3:10.1f} ms  (mask {(t1 - t0) * 1e3:.1f} ms)  loss {loss:.4f}",
                  flush=True)
    peak = peak_since(device, 0)
    prof = {}
    if args.profile:
        where["stage"] = "profiled step"
        batch = {k: v.to(device) for k, v in batches[-1].items()}
        trace = Path(args.out) / f"trace_{method}_{fmt_len(seqlen)}.json"
        step = functools.partial(masked_step, method, model, opt, batch, args, device, dtype, windows)
        split = profile_step(step, device, trace, top=PROFILE_TOP)
        batch = None
        prof = {"profiled_ms": split["wall_ms"], "kernel_ms": split["total_ms"],
                "attn_kernel_ms": split["attention_ms"], "attn_share": split["attention_share"],
                "profile_top": split["top"]}
        top = ", ".join(f"{shorten(n, 48)} {ms:.1f} ms x{c}" for n, ms, c in split["top"][:3])
        print(f"    profiled step      {split['wall_ms']:10.1f} ms  (GPU {split['total_ms']:.1f} ms, attention "
              f"{split['attention_ms']:.1f} ms)  top: {top}", flush=True)
    del model, opt
    tokens = args.batch * seqlen
    return {**prof, "params": params, "tokens_per_s": tokens * len(times) / sum(times),
            "ms_per_step": 1e3 * statistics.mean(times), "ms_min": 1e3 * min(times),
            "mask_ms": 1e3 * statistics.mean(mask_times), "peak_mem_bytes": peak,
            "peak_mem_gib": None if peak is None else peak / 2 ** 30, "first_step_s": first_step_s,
            "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
            "step_ms": [1e3 * t for t in times], "notes": "; ".join(notes)}


def model_name(args) -> str:
    return f"{args.arch}-{args.model_size}" + ("" if args.layers is None else f"-{args.layers}l")


def try_run(method: str, seqlen: int, batches: List[dict], stats: dict, args, device, dtype,
            find_max: bool = False) -> dict:
    """One row; never raises. An OOM, a mask that does not fit or any error becomes the row's status."""
    row = {"model": model_name(args), "seqlen": seqlen, "batch": args.batch, "method": method,
           "attn_implementation": ATTN_IMPLEMENTATION[method], "find_max": find_max, **stats}
    where = {"stage": "setup"}
    fatal = False
    try:
        row.update(run_one(method, seqlen, batches, args, device, dtype, where), status="ok")
    except Skip as e:
        row.update(status="n/a", notes=str(e))
    except Exception as e:
        row.update(status=status_of(e), notes=f"{where['stage']}: {format_error(e)}")
        fatal = is_fatal_cuda_error(e)
    row.setdefault("params", where.get("params"))
    row["fatal"] = fatal
    cleanup()  # the model, optimizer and masks of this run are gone: free the cache for the next
    return row


def _progress(r: dict) -> None:
    what = f"{fmt_len(r['seqlen']):>5s} {r['method']:10s}" + (" [find-max]" if r.get("find_max") else "")
    if r["status"] == "ok":
        peak = "-" if r.get("peak_mem_gib") is None else f"{r['peak_mem_gib']:.2f} GiB"
        res = (f"{r['tokens_per_s']:10.0f} tok/s {r['ms_per_step']:9.1f} ms/step  peak {peak}  "
               f"first step {r['first_step_s']:.1f} s")
    else:
        res = r["status"]
    notes = f"  [{r['notes']}]" if r.get("notes") else ""
    print(f"  -> {what} {res}{notes}", flush=True)


def summary_table(rows: List[dict]) -> str:
    """One line per (S, method): tokens/s, ms/step, mask ms, peak GiB, first-step loss, and how many
    times faster flashmask trains (its tokens/s over the method's)."""
    fm = {r["seqlen"]: r for r in rows if r["method"] == "flashmask" and r["status"] == "ok"}
    table = []
    for r in rows:
        ref = fm.get(r["seqlen"])
        speed = "-"
        if r["method"] != "flashmask" and ref is not None and r["status"] == "ok":
            speed = f"{ref['tokens_per_s'] / r['tokens_per_s']:.2f}x"
        table.append([fmt_len(r["seqlen"]), r["method"] + (" *" if r.get("find_max") else ""),
                      table_cell(r, "tokens_per_s", "{:,.0f}"), table_cell(r, "ms_per_step", "{:.1f}"),
                      table_cell(r, "mask_ms", "{:.1f}"), table_cell(r, "peak_mem_gib", "{:.2f}"),
                      table_cell(r, "loss_first", "{:.4f}"), speed, shorten(r.get("notes"))])
    headers = ["S", "method", "tok/s", "ms/step", "mask ms", "peak GiB", "loss0", "fm speedup", "notes"]
    return format_table(headers, table, align="rlrrrrrrl")


def profile_table(rows: List[dict]) -> str:
    """``--profile``: per (S, method), the profiled step's wall time, its GPU time, the attention
    kernels' part of it and the rest, and the most a free attention could speed the step up."""
    table = []
    for r in rows:
        if r.get("kernel_ms") is None:
            continue
        share = r.get("attn_share")
        table.append([fmt_len(r["seqlen"]), r["method"], f"{r['profiled_ms']:.1f}", f"{r['kernel_ms']:.1f}",
                      f"{r['attn_kernel_ms']:.1f}", "-" if share is None else f"{100 * share:.1f}%",
                      f"{r['kernel_ms'] - r['attn_kernel_ms']:.1f}",
                      "-" if share is None or share >= 1 else f"{1 / (1 - share):.2f}x"])
    headers = ["S", "method", "step ms", "GPU ms", "attention ms", "attention", "other ms", "free-attention bound"]
    return format_table(headers, table, align="rlrrrrrr")


def find_max(method: str, rows: List[dict], args, device, dtype, add) -> dict:
    """Double the context of ``method`` from the largest --seqlens until a step fails or --max-seqlen
    is passed. Returns ``{"longest_seqlen", "stopped"}``."""
    top = max(args.seqlens)
    ok = [r["seqlen"] for r in rows if r["method"] == method and r["status"] == "ok"]
    tried_top = any(r["method"] == method and r["seqlen"] == top for r in rows)
    longest = max(ok) if ok else None
    if tried_top and top not in ok:
        return {"longest_seqlen": longest, "stopped": f"{fmt_len(top)} did not train"}
    s = top * 2 if tried_top else top
    while s <= args.max_seqlen:
        print(f"== find-max: {method} at S={fmt_len(s)}", flush=True)
        batches = synthetic_batches(args.warmup_steps + args.steps, args.batch, s, args.vocab_size, args.doc_len,
                                    args.seed + s)
        row = try_run(method, s, batches, data_stats(batches), args, device, dtype, find_max=True)
        batches = None
        add(row)
        if row["status"] != "ok":
            return {"longest_seqlen": longest, "stopped": f"{fmt_len(s)}: {row['status']}"}
        longest = s
        s *= 2
    return {"longest_seqlen": longest, "stopped": f"bound --max-seqlen {fmt_len(args.max_seqlen)} reached"}


def run(args) -> list:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_train.py: no CUDA device is available (use --device cpu for a smoke run)")
    dtype = DTYPES[args.dtype]
    alloc_env = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    if device.type == "cuda" and args.alloc_conf and not any(os.environ.get(k) for k in alloc_env) \
            and not torch.cuda.is_initialized():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf  # read when the allocator starts
    if "flex" in args.methods:
        configure_dynamo()
    preset = dict(arch_sizes(args.arch)[args.model_size])
    if args.layers is not None:
        preset["layers"] = args.layers
    if args.sliding_window is not None:
        preset["sliding_window"] = args.sliding_window
    meta = {"script": "bench_train", "args": dict(vars(args)), "env": environment(device), "model_size": preset}
    try:
        import transformers
        meta["env"]["transformers"] = transformers.__version__
    except ImportError as e:
        raise SystemExit(f"bench_train.py needs transformers: {e}")
    env = meta["env"]
    env.update({k: os.environ[k] for k in alloc_env if k in os.environ})
    if device.type == "cuda":
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    print(f"device {env.get('gpu', device)} | torch {env['torch']} | transformers {env['transformers']} | "
          f"flashmask kernels {env.get('flashmask_kernels')} | {model_name(args)} {args.dtype} "
          f"vocab {args.vocab_size} | batch {args.batch} | docs {args.doc_len[0]}-{args.doc_len[1]} tokens | "
          f"{args.warmup_steps} warmup + {args.steps} timed steps | loss {args.loss}"
          + (" | gradient checkpointing" if args.gradient_checkpointing else "")
          + (" keeping the attention outputs" if args.keep_attention else ""), flush=True)

    rows: list = []
    fatal = None
    t_start = time.perf_counter()

    def add(row):
        nonlocal fatal
        if row.pop("fatal", False):
            fatal = row["notes"]
        rows.append(row)
        _progress(row)
        write_results(args.out, "train", rows, FIELDS, meta)  # partial results survive a crash

    for s in args.seqlens:
        if fatal:
            break
        batches = synthetic_batches(args.warmup_steps + args.steps, args.batch, s, args.vocab_size, args.doc_len,
                                    args.seed + s)
        stats = data_stats(batches)
        print(f"== S={fmt_len(s)}: {stats['docs_per_row']:.1f} documents per row, "
              f"density {stats['density']:.4f}", flush=True)
        for method in args.methods:
            if fatal:
                break
            print(f"  {method} (attn_implementation={ATTN_IMPLEMENTATION[method]})", flush=True)
            add(try_run(method, s, batches, stats, args, device, dtype))
        batches = None
    if args.find_max:
        meta["find_max"] = {}
        for method in args.methods:
            if fatal:
                break
            meta["find_max"][method] = find_max(method, rows, args, device, dtype, add)
    if fatal:
        print(f"\nstopped early: the CUDA context is unusable after: {fatal}", flush=True)
        meta["stopped_early"] = fatal
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    csv_path, json_path = write_results(args.out, "train", rows, FIELDS, meta)
    print()
    print(summary_table(rows))
    if args.profile:
        print("\nprofiled step (GPU time of the kernels; on a CPU, of the operators):")
        print(profile_table(rows))
    if meta.get("find_max"):
        print()
    for method, fm in meta.get("find_max", {}).items():
        longest = "none" if fm["longest_seqlen"] is None else f"{fmt_len(fm['longest_seqlen'])} tokens"
        print(f"longest context trained with {method} (* rows): {longest} ({fm['stopped']})")
    print(f"\n{len(rows)} rows in {meta['elapsed_s']:.0f} s -> {csv_path}, {json_path}")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
