#!/usr/bin/env python
"""DPO on shared (prompt | chosen | rejected) sequences with the flashmask attention backend.

Preference triples from a local JSONL file (``data/dpo.jsonl`` by default, loaded with
``datasets``) are tokenised byte by byte (see ``example_utils.ByteTokenizer``) and laid out by
:class:`flashmask.data.ShareQuestionCollator` as ``[prompt | chosen | rejected]`` in one
sequence, several triples packed per row of ``--max-length`` tokens. A share-question FlashMask
mask keeps the rejected response from seeing the chosen one while both see the prompt, and the
positions of both responses continue from the prompt: the prompt is encoded once, yet every
response token gets exactly the log-probability it would get in its own ``prompt + response``
sequence. Per-token log-probabilities of both responses
(:func:`flashmask.data.shared_sequence_logps`, computing the LM head only where needed) give the
DPO loss::

    loss = -log sigmoid(beta * ((logp_chosen - ref_chosen) - (logp_rejected - ref_rejected)))

with the reference log-probabilities from a frozen copy of the initial model. The policy is a
randomly initialised Llama or Qwen2 (``attn_implementation="fm_colmask"``); ``--sft-steps``
first trains it briefly on the chosen answers so that the reference is not uniform noise.

Each log line shows the step, the loss, the preference accuracy and margin, real (non-padding)
tokens per second through the policy and peak memory (CUDA ``max_memory_allocated``, or the
process' peak RSS on CPU).

Examples::

    # CPU, a few seconds: the loss falls from log(2) = 0.693
    python training_examples/dpo_packed.py --steps 20

    # GPU: a Qwen2-0.5B-shaped model, packs of 32K tokens, with the CUDA kernels
    python training_examples/dpo_packed.py --device cuda --arch qwen2 --model-size 0.5b \\
        --max-length 32768 --batch-size 1 --steps 50 --lr 1e-5 --gradient-checkpointing
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_utils  # noqa: E402  (also puts the repository root on sys.path)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = example_utils.make_parser(__doc__, "dpo.jsonl", "JSONL file with 'prompt', 'chosen' and 'rejected' fields",
                                  default_lr=1e-3, default_steps=20)
    p.add_argument("--beta", type=float, default=0.1, help="DPO temperature beta (default: %(default)s)")
    p.add_argument("--average-logps", action="store_true",
                   help="use the mean per-token log-probability of each response instead of the sum")
    p.add_argument("--sft-steps", type=int, default=0,
                   help="SFT steps on prompt+chosen before DPO, so that the reference is not a random model "
                        "(default: %(default)s)")
    args = p.parse_args(argv)
    example_utils.check_args(p, args)
    if args.max_length < 3:
        p.error("--max-length must be >= 3")
    return args


def tokenize(example: Dict, tok: example_utils.ByteTokenizer) -> Dict[str, List[int]]:
    return {"prompt_ids": tok.encode(example_utils.prompt_text(example["prompt"]), bos=True),
            "chosen_ids": tok.encode(example["chosen"], eos=True),
            "rejected_ids": tok.encode(example["rejected"], eos=True)}


def triple_len(t: Dict) -> int:
    return len(t["prompt_ids"]) + len(t["chosen_ids"]) + len(t["rejected_ids"])


def response_logps(model, inputs: Dict[str, torch.Tensor], batch: Dict[str, torch.Tensor], need: torch.Tensor,
                   average: bool):
    """(chosen, rejected) log-probs ``[N]``: the decoder once, the LM head only at ``need`` columns."""
    from flashmask.data import shared_sequence_logps

    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    logits = model.get_output_embeddings()(hidden[need])
    return shared_sequence_logps(logits, batch, average=average)


def main(argv: Optional[List[str]] = None) -> Dict:
    """Run the example; returns ``{"losses": [...], "first_loss", "last_loss", "accuracy", "tokens_per_s"}``."""
    args = parse_args(argv)
    example_utils.resolve_device_dtype(args)
    import flashmask.integrations.transformers as fm_hf
    from flashmask.data import PackedSFTCollator, ShareQuestionCollator, logp_positions, model_inputs

    tok = example_utils.ByteTokenizer()
    triples = [tokenize(ex, tok) for ex in example_utils.load_jsonl(args.data)]
    policy = example_utils.build_model(args.arch, args.model_size, attn_implementation=fm_hf.ATTN_IMPLEMENTATION,
                                max_length=args.max_length, vocab_size=tok.vocab_size, dtype=args.dtype,
                                device=args.device, seed=args.seed, sliding_window=args.sliding_window)
    policy.train()
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    nparams = sum(p.numel() for p in policy.parameters())
    print(f"dpo_packed: {args.arch}-{args.model_size} ({nparams / 1e6:.2f}M params, {args.dtype}) on {args.device}, "
          f"attn_implementation={fm_hf.ATTN_IMPLEMENTATION} [{example_utils.backend_note(args.device, args.dtype)}], "
          f"{len(triples)} preference triples, packs of {args.max_length} tokens x {args.batch_size}, "
          f"beta={args.beta}", flush=True)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    padding = "max_length" if args.device.type == "cuda" else "longest"
    it, pending = example_utils.stream(triples, args.seed), []

    if args.sft_steps > 0:  # a short warm-up on prompt + chosen
        sft = PackedSFTCollator(args.max_length, pad_token_id=tok.pad_token_id, padding=padding)
        docs = lambda t: {"input_ids": t["prompt_ids"] + t["chosen_ids"],  # noqa: E731
                          "completion_mask": [0] * len(t["prompt_ids"]) + [1] * len(t["chosen_ids"])}
        for step in range(1, args.sft_steps + 1):
            rows = example_utils.take_rows(it, triple_len, args.max_length, args.batch_size, pending)
            batch = {k: v.to(args.device) for k, v in sft.collate_rows([[docs(t) for t in r] for r in rows]).items()}
            loss = policy(**batch, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % args.log_every == 0 or step == args.sft_steps:
                print(f"sft {step:5d} | loss {float(loss.detach()):.4f}", flush=True)
        opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)

    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    collate = ShareQuestionCollator(args.max_length, pad_token_id=tok.pad_token_id, padding=padding)
    meter, losses, accs, rates = example_utils.Meter(args.device), [], [], []
    for step in range(1, args.steps + 1):
        rows = example_utils.take_rows(it, triple_len, args.max_length, args.batch_size, pending)
        batch = collate.collate_rows(rows)
        inputs = model_inputs(batch, args.device)
        need = logp_positions(batch).to(args.device)
        with torch.no_grad():
            ref_c, ref_r = response_logps(reference, inputs, batch, need, args.average_logps)
        pol_c, pol_r = response_logps(policy, inputs, batch, need, args.average_logps)
        margin = args.beta * ((pol_c - ref_c) - (pol_r - ref_r))
        loss = -F.logsigmoid(margin).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        accs.append(float((margin.detach() > 0).float().mean()))
        meter.add(sum(triple_len(t) for r in rows for t in r))
        if step % args.log_every == 0 or step == args.steps:
            rate = meter.rate()
            rates.append(rate)
            print(f"step {step:5d} | loss {losses[-1]:.4f} | acc {accs[-1]:.2f} | margin "
                  f"{float(margin.detach().mean()):+.4f} | {rate:,.0f} tokens/s | {margin.numel()} pairs | "
                  f"peak mem {example_utils.peak_memory_str(args.device)}", flush=True)
    print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, peak mem {example_utils.peak_memory_str(args.device)}",
          flush=True)
    return example_utils.summary_dict(losses, {"accuracy": accs, "tokens_per_s": rates[-1] if rates else None})


if __name__ == "__main__":
    main()
