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
(:func:`flashmask.losses.linear_token_logps`: the LM head only at the response tokens, in chunks
of ``--loss-chunk``), summed per response, give the DPO loss::

    loss = -log sigmoid(beta * ((logp_chosen - ref_chosen) - (logp_rejected - ref_rejected)))

with the reference log-probabilities from a frozen copy of the initial model (saved once as
``<output-dir>/reference`` so that ``--resume`` finds it). The policy is ``--model PATH`` (any local
Hugging Face causal LM with its tokenizer) or a randomly initialised Llama / Qwen2 preset;
``--sft-steps`` first trains it briefly on the chosen answers so that a random reference is not
uniform noise.

A progress bar and a log line show the loss, the preference accuracy (the share of pairs whose
margin is positive, a tie counting as half) and margin, tokens/s through
the policy (smoothed over the last 20 steps) and peak memory; ``--output-dir`` gets
``save_pretrained`` checkpoints, ``loss.csv`` and ``loss.png``.

Examples::

    # CPU, a few seconds: the loss falls from log(2) = 0.693
    python -m training_examples.dpo_packed --steps 20 --output-dir runs/dpo

    # GPU: a local Qwen2.5-0.5B-Instruct, packs of 32K tokens, with the CUDA kernels
    python -m training_examples.dpo_packed --device cuda --model ~/models/Qwen2.5-0.5B-Instruct \\
        --max-length 32768 --batch-size 1 --steps 50 --lr 1e-6 --gradient-checkpointing --output-dir runs/dpo-qwen

    # 2 GPUs: every row split over both (context parallelism), policy and reference sharded with FSDP2
    torchrun --nproc-per-node 2 -m training_examples.dpo_packed --cp 2 --model ~/models/Qwen2.5-0.5B-Instruct \\
        --max-length 131072 --batch-size 1 --steps 50 --lr 1e-6 --gradient-checkpointing

With several processes each rank computes the log-probabilities of its own tokens; the per-response
sums are all-reduced over the context-parallel group (differentiably), so every rank of the group
computes the same loss.
"""
from __future__ import annotations

import argparse
import copy
import os
from typing import Dict, List, Optional

import torch

from training_examples.checkpoints import save_pretrained
from training_examples.cli import check_args, make_parser
from training_examples.dpo_loss import LOGPS_METHOD, dpo_step, preference_accuracy, response_logps
from training_examples.models import backend_note, load_model_and_tokenizer, load_pretrained, prepare_model
from training_examples.packing import PackedStream
from training_examples.parallel import Parallel, dp_mean, next_rows, run_parallel
from training_examples.prompts import answer_ids, prompt_ids
from training_examples.records import load_records
from training_examples.train_log import packs_str
from training_examples.trainer import causal_lm_step, report, to_device, train


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = make_parser(__doc__, "dpo.jsonl", "preference triples", default_lr=1e-3, default_steps=20)
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
    check_args(p, args)
    if args.max_length < 3:
        p.error("--max-length must be >= 3")
    return args


def tokenize(example: Dict, tok, args) -> Dict[str, List[int]]:
    return {"prompt_ids": prompt_ids(tok, example[args.prompt_field], not args.no_chat_template),
            "chosen_ids": answer_ids(tok, example[args.chosen_field]),
            "rejected_ids": answer_ids(tok, example[args.rejected_field])}


def load_triples(args, tok) -> List[Dict[str, List[int]]]:
    fields = [args.prompt_field, args.chosen_field, args.rejected_field]
    records = load_records(args.data, fields, split=args.data_split, config=args.data_config,
                           max_samples=args.max_samples)
    return [tokenize(r, tok, args) for r in records]


def triple_len(t: Dict) -> int:
    return len(t["prompt_ids"]) + len(t["chosen_ids"]) + len(t["rejected_ids"])


def warm_up(args, policy, tok, stream: PackedStream, padding: str, par: Parallel) -> None:
    """A short SFT on prompt + chosen (its own optimizer, thrown away afterwards)."""
    from flashmask.data import PackedSFTCollator

    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    sft = PackedSFTCollator(args.max_length, pad_token_id=tok.pad_token_id, padding=padding)
    doc = lambda t: {"input_ids": t["prompt_ids"] + t["chosen_ids"],  # noqa: E731
                     "completion_mask": [0] * len(t["prompt_ids"]) + [1] * len(t["chosen_ids"])}
    for step in range(1, args.sft_steps + 1):
        _, rows = next_rows(stream, args, par)
        batch = to_device(sft.collate_rows([[doc(t) for t in r] for r in rows]), args.device)
        loss = causal_lm_step(policy, batch, args, par)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if par.main and (step % args.log_every == 0 or step == args.sft_steps):
            print(f"sft {step:5d} | loss {float(loss):.4f}", flush=True)


def reference_model(args, policy, attn: str):
    """The frozen reference, unsharded: a copy of the policy (made before any warm-up, which
    :func:`copy_weights` then brings over), or on ``--resume`` the one saved beside the checkpoint."""
    if args.resume:
        path = os.path.join(os.path.dirname(os.path.abspath(args.resume)), "reference")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--resume: no reference model at {path} (written by the run that made the "
                                    "checkpoint)")
        reference, _ = load_pretrained(path, attn_implementation=attn, dtype=args.dtype, device=args.device,
                                       tokenizer=False)
    else:
        reference = copy.deepcopy(policy)
    return reference.eval().requires_grad_(False)


@torch.no_grad()
def copy_weights(dst, src) -> None:
    """``dst``'s parameters := ``src``'s (the same architecture, sharded alike or not at all)."""
    for (name, a), (name_src, b) in zip(dst.named_parameters(), src.named_parameters()):
        assert name == name_src, (name, name_src)
        a.copy_(b)


def main(argv: Optional[List[str]] = None) -> Dict:
    """Run the example; returns the summary of :func:`training_examples.trainer.train` plus ``accuracy``
    per step."""
    return run_parallel(parse_args(argv), run)


def run(args, par: Parallel) -> Dict:
    import flashmask.integrations.transformers as fm_hf
    from flashmask.data import ShareQuestionCollator
    from flashmask.distributed.fsdp import install_forward_method

    attn = fm_hf.ATTN_IMPLEMENTATION
    policy, tok = load_model_and_tokenizer(args, attn)
    reference = reference_model(args, policy, attn)
    prepare_model(policy, args, par)
    prepare_model(reference, args, par, train=False)
    for m in (policy, reference):
        install_forward_method(m, LOGPS_METHOD, response_logps)
    triples = load_triples(args, tok)
    stream = PackedStream(triples, triple_len, args.max_length, args.seed)
    if par.main:
        print(f"dpo_packed: {args.model_desc} on {args.device}, attn_implementation="
              f"{policy.config._attn_implementation} [{backend_note(args.device, args.dtype)}], "
              f"{par.describe()}, {len(triples)} preference triples"
              f"{f' ({stream.dropped} longer than a pack skipped)' if stream.dropped else ''}, "
              f"{packs_str(args, par)}, beta={args.beta}", flush=True)
    padding = "max_length" if args.device.type == "cuda" else "longest"
    if args.sft_steps > 0 and not args.resume:
        warm_up(args, policy, tok, stream, padding, par)
        copy_weights(reference, policy)
    if args.output_dir and not args.resume:
        save_pretrained(reference, os.path.join(args.output_dir, "reference"), par)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)  # after sharding
    collate = ShareQuestionCollator(args.max_length, pad_token_id=tok.pad_token_id, padding=padding)

    def step(_):
        rows_all, rows = next_rows(stream, args, par)
        loss, margin = dpo_step(policy, reference, collate.collate_rows(rows), args, par)
        loss, acc, mean_margin = dp_mean([loss, preference_accuracy(margin), margin.mean()], par, args.device)
        extras = {"accuracy": acc, "margin": mean_margin, "pairs": sum(len(r) for r in rows_all)}
        return torch.tensor(loss), sum(triple_len(t) for r in rows_all for t in r), extras

    res = train(args, "dpo_packed", policy, tok, opt, stream, step, describe=lambda e: (
        f"acc {e['accuracy']:.2f} | margin {e['margin']:+.4f} | {e['pairs']} pairs"), par=par)
    res["accuracy"] = [r["accuracy"] for r in res["history"]]
    report(res, par)
    return res


if __name__ == "__main__":
    main()
