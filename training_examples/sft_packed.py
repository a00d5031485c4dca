#!/usr/bin/env python
"""Packed supervised fine-tuning with the flashmask attention backend for transformers.

Instruction/response pairs from a local JSONL file (``data/sft.jsonl`` by default, loaded with
``datasets``) are tokenised byte by byte (see ``example_utils.ByteTokenizer``) as
``<bos>User: {instruction}\\nAssistant: {response}<eos>`` and packed into rows of
``--max-length`` tokens by :class:`flashmask.data.PackedSFTCollator`. Every document attends only
to itself (a causal-document FlashMask mask, O(S) memory, no dense mask), its ``position_ids``
restart at 0, and the loss covers the response tokens, never a prediction across two documents.
The model is a randomly initialised Llama or Qwen2 running ``attn_implementation="fm_colmask"``.

Each log line shows the step, the loss, real (non-padding) tokens per second and peak memory
(CUDA ``max_memory_allocated``, or the process' peak RSS on CPU).

Examples::

    # CPU, a few seconds: the loss falls from ~5.8 (ln 320)
    python training_examples/sft_packed.py --steps 30

    # GPU: a Qwen2-0.5B-shaped model on packs of 32K tokens with the CUDA kernels
    python training_examples/sft_packed.py --device cuda --arch qwen2 --model-size 0.5b \\
        --max-length 32768 --batch-size 1 --steps 100 --lr 3e-4 --gradient-checkpointing
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_utils  # noqa: E402  (also puts the repository root on sys.path)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = example_utils.make_parser(__doc__, "sft.jsonl", "JSONL file with 'instruction' and 'response' fields",
                                  default_lr=3e-3, default_steps=30)
    p.add_argument("--loss-on-prompt", action="store_true", help="also train on the instruction tokens")
    p.add_argument("--attn-implementation", default=None,
                   help="transformers attention backend; default: the flashmask backend 'fm_colmask'. 'sdpa' "
                        "(transformers builds a dense packed mask from the restarting position_ids) is there "
                        "for comparison")
    args = p.parse_args(argv)
    example_utils.check_args(p, args)
    return args


def tokenize(example: Dict, tok: example_utils.ByteTokenizer, loss_on_prompt: bool) -> Dict[str, List[int]]:
    prompt = tok.encode(example_utils.prompt_text(example["instruction"]), bos=True)
    response = tok.encode(example["response"], eos=True)
    mask = [1 if loss_on_prompt else 0] * len(prompt) + [1] * len(response)
    return {"input_ids": prompt + response, "completion_mask": mask}


def main(argv: Optional[List[str]] = None) -> Dict:
    """Run the example; returns ``{"losses": [...], "first_loss", "last_loss", "tokens_per_s"}``."""
    args = parse_args(argv)
    example_utils.resolve_device_dtype(args)
    import flashmask.integrations.transformers as fm_hf
    from flashmask.data import PackedSFTCollator

    tok = example_utils.ByteTokenizer()
    docs = [tokenize(ex, tok, args.loss_on_prompt) for ex in example_utils.load_jsonl(args.data)]
    attn = args.attn_implementation or fm_hf.ATTN_IMPLEMENTATION
    model = example_utils.build_model(args.arch, args.model_size, attn_implementation=attn, max_length=args.max_length,
                               vocab_size=tok.vocab_size, dtype=args.dtype, device=args.device, seed=args.seed,
                               sliding_window=args.sliding_window)
    model.train()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    nparams = sum(p.numel() for p in model.parameters())
    print(f"sft_packed: {args.arch}-{args.model_size} ({nparams / 1e6:.2f}M params, {args.dtype}) on {args.device}, "
          f"attn_implementation={attn} [{example_utils.backend_note(args.device, args.dtype)}], {len(docs)} documents, "
          f"packs of {args.max_length} tokens x {args.batch_size}", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    collate = PackedSFTCollator(args.max_length, pad_token_id=tok.pad_token_id,
                                padding="max_length" if args.device.type == "cuda" else "longest")
    it, pending = example_utils.stream(docs, args.seed), []
    meter, losses, rates = example_utils.Meter(args.device), [], []
    for step in range(1, args.steps + 1):
        rows = example_utils.take_rows(it, lambda d: len(d["input_ids"]), args.max_length, args.batch_size, pending)
        batch = {k: v.to(args.device, non_blocking=True) for k, v in collate.collate_rows(rows).items()}
        out = model(**batch, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
        meter.add(sum(len(d["input_ids"]) for row in rows for d in row))
        if step % args.log_every == 0 or step == args.steps:
            rate = meter.rate()
            rates.append(rate)
            print(f"step {step:5d} | loss {losses[-1]:.4f} | {rate:,.0f} tokens/s | {sum(len(r) for r in rows)} docs "
                  f"| peak mem {example_utils.peak_memory_str(args.device)}", flush=True)
    print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, peak mem {example_utils.peak_memory_str(args.device)}",
          flush=True)
    return example_utils.summary_dict(losses, {"tokens_per_s": rates[-1] if rates else None})


if __name__ == "__main__":
    main()
