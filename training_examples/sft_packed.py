#!/usr/bin/env python
"""Packed supervised fine-tuning with the flashmask attention backend for transformers.

Instruction/response pairs (``data/sft.jsonl`` by default; any JSON/JSONL/Parquet/CSV file or a
dataset name with ``--data``, fields chosen with ``--instruction-field`` / ``--response-field``)
are tokenised as ``prompt + response + eos`` (the prompt through the tokenizer's chat template
when it has one) and packed into rows of ``--max-length`` tokens by
:class:`flashmask.data.PackedSFTCollator`. Every document attends only to itself (a
causal-document FlashMask mask, O(S) memory, no dense mask), its ``position_ids`` restart at 0,
and the loss covers the response tokens, never a prediction across two documents.

The model is ``--model PATH`` (any local Hugging Face causal LM with its tokenizer) or a randomly
initialised Llama / Qwen2 preset with a byte-level tokenizer, running
``attn_implementation="fm_colmask"``. A progress bar and a log line show the loss, tokens/s
(smoothed over the last 20 steps) and peak memory; ``--output-dir`` gets ``save_pretrained``
checkpoints, ``loss.csv`` and ``loss.png``; ``--resume`` continues a run.

Examples::

    # CPU, a few seconds: the loss falls from ~5.8 (ln 320)
    python -m training_examples.sft_packed --steps 30 --output-dir runs/sft

    # continue to 60 steps, then fine-tune the result further on your own data
    python -m training_examples.sft_packed --steps 60 --resume runs/sft
    python -m training_examples.sft_packed --model runs/sft/checkpoint-60 --data my_pairs.parquet

    # GPU: a local Qwen2.5-0.5B on packs of 32K tokens with the CUDA kernels
    python -m training_examples.sft_packed --device cuda --model ~/models/Qwen2.5-0.5B \\
        --max-length 32768 --batch-size 1 --steps 100 --lr 1e-5 --gradient-checkpointing \\
        --output-dir runs/sft-qwen --save-every 50

    # 2 GPUs: packs of 256K tokens, each split over both (context parallelism), FSDP2
    torchrun --nproc-per-node 2 -m training_examples.sft_packed --cp 2 --model ~/models/Qwen2.5-0.5B \\
        --max-length 262144 --batch-size 1 --steps 100 --lr 1e-5 --gradient-checkpointing

With several processes (``torchrun --nproc-per-node N``) the parameters are sharded with FSDP2
over all N; ``--cp C`` splits every packed row over C ranks (``--cp-mode``), and the N / C
data-parallel groups each take ``--batch-size`` rows per step. The LM head and the loss run in
chunks of ``--loss-chunk`` tokens (no ``[S, vocab]`` logits); ``--offload on`` keeps the activation
checkpoints in host memory and runs the MLPs in chunks of ``--mlp-chunk`` tokens (no ``[S,
intermediate]`` temporaries). Rank 0 prints tokens/s per GPU and the peak memory of the fullest GPU.
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional

import torch

from training_examples.cli import check_args, make_parser
from training_examples.models import backend_note, load_model_and_tokenizer, prepare_model
from training_examples.packing import PackedStream
from training_examples.parallel import Parallel, env_world_size, next_rows, run_parallel
from training_examples.prompts import answer_ids, prompt_ids
from training_examples.records import load_records
from training_examples.train_log import packs_str
from training_examples.trainer import causal_lm_step, report, to_device, train


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = make_parser(__doc__, "sft.jsonl", "instruction/response pairs", default_lr=3e-3, default_steps=30)
    p.add_argument("--instruction-field", default="instruction", help="field of the prompt (default: %(default)s)")
    p.add_argument("--response-field", default="response", help="field of the answer (default: %(default)s)")
    p.add_argument("--loss-on-prompt", action="store_true", help="also train on the instruction tokens")
    p.add_argument("--attn-implementation", default=None,
                   help="transformers attention backend; default: the flashmask backend 'fm_colmask'. 'sdpa' "
                        "(transformers builds a dense packed mask from the restarting position_ids) is there "
                        "for comparison")
    args = p.parse_args(argv)
    check_args(p, args)
    if args.attn_implementation and env_world_size() > 1:
        p.error("--attn-implementation: several processes use the context-parallel backend 'fm_cp'")
    return args


def tokenize(example: Dict, tok, args) -> Dict[str, List[int]]:
    prompt = prompt_ids(tok, example[args.instruction_field], not args.no_chat_template)
    response = answer_ids(tok, example[args.response_field])
    mask = [1 if args.loss_on_prompt else 0] * len(prompt) + [1] * len(response)
    return {"input_ids": prompt + response, "completion_mask": mask}


def load_documents(args, tok) -> List[Dict[str, List[int]]]:
    records = load_records(args.data, [args.instruction_field, args.response_field], split=args.data_split,
                           config=args.data_config, max_samples=args.max_samples)
    return [tokenize(r, tok, args) for r in records]


def main(argv: Optional[List[str]] = None) -> Dict:
    """Run the example; returns the summary of :func:`training_examples.trainer.train` (losses, tokens_per_s,
    checkpoint, ...)."""
    return run_parallel(parse_args(argv), run)


def run(args, par: Parallel) -> Dict:
    import flashmask.integrations.transformers as fm_hf
    from flashmask.data import PackedSFTCollator

    attn = args.attn_implementation or fm_hf.ATTN_IMPLEMENTATION
    model, tok = load_model_and_tokenizer(args, attn)
    prepare_model(model, args, par)
    docs = load_documents(args, tok)
    size = lambda d: len(d["input_ids"])  # noqa: E731
    stream = PackedStream(docs, size, args.max_length, args.seed)
    if par.main:
        print(f"sft_packed: {args.model_desc} on {args.device}, attn_implementation="
              f"{model.config._attn_implementation} [{backend_note(args.device, args.dtype)}], "
              f"{par.describe()}, {len(docs)} documents"
              f"{f' ({stream.dropped} longer than a pack skipped)' if stream.dropped else ''}, "
              f"{packs_str(args, par)}", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)  # after sharding
    collate = PackedSFTCollator(args.max_length, pad_token_id=tok.pad_token_id,
                                padding="max_length" if args.device.type == "cuda" else "longest")

    def step(_):
        rows_all, rows = next_rows(stream, args, par)
        batch = to_device(collate.collate_rows(rows), args.device)
        loss = causal_lm_step(model, batch, args, par)
        return loss, sum(size(d) for row in rows_all for d in row), {"docs": sum(len(r) for r in rows_all)}

    res = train(args, "sft_packed", model, tok, opt, stream, step,
                              describe=lambda extras: f"{extras['docs']} docs", par=par)
    report(res, par)
    return res


if __name__ == "__main__":
    main()
