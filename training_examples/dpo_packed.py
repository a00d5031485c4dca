#!/usr/bin/env python
"""DPO on shared (prompt | chosen | rejected) sequences with the flashmask attention backend.

Preference triples (``data/dpo.jsonl`` by default; any JSON/JSONL/Parquet/CSV file or a dataset
name with ``--data``, fields chosen with ``--prompt-field`` / ``--chosen-field`` /
``--rejected-field``) are tokenised (the prompt through the tokenizer's chat template when it has
one) and laid out by :class:`flashmask.data.ShareQuestionCollator` as
``[prompt | chosen | rejected]`` in one sequence, several triples packed per row of
``--max-length`` tokens. A share-question FlashMask mask keeps the rejected response from seeing
the chosen one while both see the prompt, and the positions of both responses continue from the
prompt: the prompt is encoded once, yet every response token gets exactly the log-probability it
would get in its own ``prompt + response`` sequence. Per-token log-probabilities of both responses
(:func:`flashmask.data.shared_sequence_logps`, computing the LM head only where needed) give the
DPO loss::

    loss = -log sigmoid(beta * ((logp_chosen - ref_chosen) - (logp_rejected - ref_rejected)))

with the reference log-probabilities from a frozen copy of the initial model (saved once as
``<output-dir>/reference`` so that ``--resume`` finds it). The policy is ``--model PATH`` (any local
Hugging Face causal LM with its tokenizer) or a randomly initialised Llama / Qwen2 preset;
``--sft-steps`` first trains it briefly on the chosen answers so that a random reference is not
uniform noise.

A progress bar and a log line show the loss, the preference accuracy and margin, tokens/s through
the policy (smoothed over the last 20 steps) and peak memory; ``--output-dir`` gets
``save_pretrained`` checkpoints, ``loss.csv`` and ``loss.png``.

Examples::

    # CPU, a few seconds: the loss falls from log(2) = 0.693
    python training_examples/dpo_packed.py --steps 20 --output-dir runs/dpo

    # GPU: a local Qwen2.5-0.5B-Instruct, packs of 32K tokens, with the CUDA kernels
    python training_examples/dpo_packed.py --device cuda --model ~/models/Qwen2.5-0.5B-Instruct \\
        --max-length 32768 --batch-size 1 --steps 50 --lr 1e-6 --gradient-checkpointing --output-dir runs/dpo-qwen
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
    p = example_utils.make_parser(__doc__, "dpo.jsonl", "preference triples", default_lr=1e-3, default_steps=20)
    p.add_argument("--prompt-field", default="prompt", help="field of the prompt (default: %(default)s)")
    p.add_argument("--chosen-field", default="chosen", help="field of the preferred answer (default: %(default)s)")
    p.add_argument("--rejected-field", default="rejected", help="field of the worse answer (default: %(default)s)")
    p.add_argument("--beta", type=float, default=0.1, help="DPO temperature beta (default: %(default)s)")
    p.add_argument("--average-logps", action="store_true",
                   help="use the mean per-token log-probability of each response instead of the sum")
    p.add_argument("--sft-steps", type=int, default=0,
                   help="SFT steps on prompt+chosen before DPO, so that the reference is not a random model "
                        "(default: %(default)s; skipped on --resume)")
    args = p.parse_args(argv)
    example_utils.check_args(p, args)
    if args.max_length < 3:
        p.error("--max-length must be >= 3")
    return args


def tokenize(example: Dict, tok, args) -> Dict[str, List[int]]:
    return {"prompt_ids": example_utils.prompt_ids(tok, example[args.prompt_field], not args.no_chat_template),
            "chosen_ids": example_utils.answer_ids(tok, example[args.chosen_field]),
            "rejected_ids": example_utils.answer_ids(tok, example[args.rejected_field])}


def load_triples(args, tok) -> List[Dict[str, List[int]]]:
    fields = [args.prompt_field, args.chosen_field, args.rejected_field]
    records = example_utils.load_records(args.data, fields, split=args.data_split, config=args.data_config,
                                         max_samples=args.max_samples)
    return [tokenize(r, tok, args) for r in records]


def triple_len(t: Dict) -> int:
    return len(t["prompt_ids"]) + len(t["chosen_ids"]) + len(t["rejected_ids"])


def response_logps(model, inputs: Dict[str, torch.Tensor], batch: Dict[str, torch.Tensor], need: torch.Tensor,
                   average: bool):
    """(chosen, rejected) log-probs ``[N]``: the decoder once, the LM head only at ``need`` columns."""
    from flashmask.data import shared_sequence_logps

    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    logits = model.get_output_embeddings()(hidden[need])
    return shared_sequence_logps(logits, batch, average=average)


def warm_up(args, policy, tok, stream: example_utils.PackedStream, padding: str) -> None:
    """A short SFT on prompt + chosen (its own optimizer, thrown away afterwards)."""
    from flashmask.data import PackedSFTCollator

    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    sft = PackedSFTCollator(args.max_length, pad_token_id=tok.pad_token_id, padding=padding)
    doc = lambda t: {"input_ids": t["prompt_ids"] + t["chosen_ids"],  # noqa: E731
                     "completion_mask": [0] * len(t["prompt_ids"]) + [1] * len(t["chosen_ids"])}
    for step in range(1, args.sft_steps + 1):
        rows = stream.rows(args.batch_size)
        batch = {k: v.to(args.device) for k, v in sft.collate_rows([[doc(t) for t in r] for r in rows]).items()}
        loss = policy(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.sft_steps:
            print(f"sft {step:5d} | loss {float(loss.detach()):.4f}", flush=True)


def reference_model(args, policy, attn: str):
    """The frozen reference: the policy as DPO starts, saved once to ``<output-dir>/reference``;
    on ``--resume`` it is loaded from beside the checkpoint."""
    if args.resume:
        path = os.path.join(os.path.dirname(os.path.abspath(args.resume)), "reference")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--resume: no reference model at {path} (written by the run that made the "
                                    "checkpoint)")
        reference, _ = example_utils.load_pretrained(path, attn_implementation=attn, dtype=args.dtype,
                                                     device=args.device, tokenizer=False)
    else:
        reference = copy.deepcopy(policy)
        if args.output_dir:
            example_utils.save_pretrained(reference, os.path.join(args.output_dir, "reference"))
    return reference.eval().requires_grad_(False)


def main(argv: Optional[List[str]] = None) -> Dict:
    """Run the example; returns ``example_utils.train``'s summary plus ``accuracy`` per step."""
    args = parse_args(argv)
    example_utils.resolve_device_dtype(args)
    import flashmask.integrations.transformers as fm_hf
    from flashmask.data import ShareQuestionCollator, logp_positions, model_inputs

    attn = fm_hf.ATTN_IMPLEMENTATION
    policy, tok = example_utils.load_model_and_tokenizer(args, attn)
    triples = load_triples(args, tok)
    stream = example_utils.PackedStream(triples, triple_len, args.max_length, args.seed)
    print(f"dpo_packed: {args.model_desc} on {args.device}, attn_implementation={attn} "
          f"[{example_utils.backend_note(args.device, args.dtype)}], {len(triples)} preference triples"
          f"{f' ({stream.dropped} longer than a pack skipped)' if stream.dropped else ''}, "
          f"packs of {args.max_length} tokens x {args.batch_size}, beta={args.beta}", flush=True)
    padding = "max_length" if args.device.type == "cuda" else "longest"
    if args.sft_steps > 0 and not args.resume:
        warm_up(args, policy, tok, stream, padding)
    reference = reference_model(args, policy, attn)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    collate = ShareQuestionCollator(args.max_length, pad_token_id=tok.pad_token_id, padding=padding)

    def step(_):
        rows = stream.rows(args.batch_size)
        batch = collate.collate_rows(rows)
        inputs = model_inputs(batch, args.device)
        need = logp_positions(batch).to(args.device)
        with torch.no_grad():
            ref_c, ref_r = response_logps(reference, inputs, batch, need, args.average_logps)
        pol_c, pol_r = response_logps(policy, inputs, batch, need, args.average_logps)
        margin = args.beta * ((pol_c - ref_c) - (pol_r - ref_r))
        loss = -F.logsigmoid(margin).mean()
        loss.backward()
        margin = margin.detach()
        extras = {"accuracy": float((margin > 0).float().mean()), "margin": float(margin.mean()),
                  "pairs": margin.numel()}
        return loss, sum(triple_len(t) for r in rows for t in r), extras

    res = example_utils.train(args, "dpo_packed", policy, tok, opt, stream, step, describe=lambda e: (
        f"acc {e['accuracy']:.2f} | margin {e['margin']:+.4f} | {e['pairs']} pairs"))
    res["accuracy"] = [r["accuracy"] for r in res["history"]]
    print(f"done: loss {res['first_loss']:.4f} -> {res['last_loss']:.4f}, "
          f"peak mem {example_utils.peak_memory_str(args.device)}", flush=True)
    return res


if __name__ == "__main__":
    main()
