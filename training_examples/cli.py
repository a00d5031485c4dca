"""The examples' command line: one parser for model, data, training, long-context and output options,
and the checks of their values (each bad value exits with a message naming the option)."""
from __future__ import annotations

import argparse
import os

import torch

from training_examples.checkpoints import find_checkpoint
from training_examples.models import MODEL_SIZES
from training_examples.parallel import env_world_size

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def parse_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose from {sorted(table)}")
    return table[name]


def make_parser(doc: str, data_file: str, data_help: str, *, default_lr: float,
                default_steps: int) -> argparse.ArgumentParser:
    """The examples' argument parser: model, data, training and output options."""
    p = argparse.ArgumentParser(description=doc,
                                epilog="Model presets: " + ", ".join(
                                    f"{k}={v[2]} layers x {v[0]} hidden" for k, v in MODEL_SIZES.items()),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, metavar="PATH",
                   help="a local Hugging Face causal LM directory (config, weights, tokenizer), e.g. a "
                        "downloaded Qwen2.5-0.5B or a checkpoint of this script; default: a random preset")
    m.add_argument("--arch", choices=["llama", "qwen2"], default="llama",
                   help="preset family when no --model is given (default: %(default)s)")
    m.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny",
                   help="preset size when no --model is given: tiny (CPU tests), small, 0.5b (Qwen2-0.5B "
                        "shape), 1b (Llama-3.2-1B shape), 3b (Llama-3.2-3B shape, head dim 128); default: tiny")
    m.add_argument("--sliding-window", type=int, default=None,
                   help="qwen2 preset only: a sliding-window attention of this many tokens in every layer")
    m.add_argument("--no-chat-template", action="store_true",
                   help="format prompts as 'User: ...\\nAssistant: ' even if the tokenizer has a chat template")
    d = p.add_argument_group("data")
    d.add_argument("--data", default=os.path.join(DATA_DIR, data_file), metavar="FILE|NAME",
                   help=f"{data_help}: a .json/.jsonl/.parquet/.csv file (or glob, or directory), or a "
                        f"dataset name when online (default: data/{data_file})")
    d.add_argument("--data-split", default="train", help="dataset split (default: %(default)s)")
    d.add_argument("--data-config", default=None, help="dataset configuration name, for a named dataset")
    d.add_argument("--max-samples", type=int, default=None, help="use only the first N samples")
    t = p.add_argument_group("training")
    t.add_argument("--max-length", type=int, default=512,
                   help="tokens per packed row (the pack length); e.g. 32768 on a GPU (default: 512)")
    t.add_argument("--batch-size", type=int, default=2, help="packed rows per step (default: 2)")
    t.add_argument("--steps", type=int, default=default_steps,
                   help=f"optimizer steps in all, counting resumed ones (default: {default_steps})")
    t.add_argument("--lr", type=float, default=default_lr, help=f"AdamW learning rate (default: {default_lr})")
    t.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    t.add_argument("--dtype", type=parse_dtype, default=None,
                   help="parameter/compute dtype: float32, bfloat16 or float16 (default: bfloat16 on cuda, "
                        "float32 on cpu); the kernels need bfloat16/float16")
    t.add_argument("--seed", type=int, default=0, help="seed for model init and data order (default: 0)")
    t.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute layer activations in backward (for long packs on a GPU)")
    add_long_context_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--output-dir", default=None,
                   help="where checkpoints (checkpoint-STEP/, save_pretrained) and the loss curve (loss.csv, "
                        "loss.png) go; default: none are written")
    o.add_argument("--save-every", type=int, default=0,
                   help="also save a checkpoint every N steps (default: only at the end)")
    o.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a checkpoint-STEP directory, or from the latest one in an output dir")
    o.add_argument("--log-every", type=int, default=1, help="print a progress line every N steps (default: 1)")
    o.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress bar on stderr (auto: only on a terminal)")
    return p


def add_long_context_args(p: argparse.ArgumentParser) -> None:
    """Options for long rows: several GPUs (context parallelism, FSDP2), offloaded checkpoints, chunked MLPs
    and loss."""
    g = p.add_argument_group("long context", "several GPUs: torchrun --nproc-per-node N -m MODULE --cp C (FSDP2 "
                                             "over all N, each row split over C of them, N/C data-parallel groups)")
    g.add_argument("--cp", type=int, default=1,
                   help="context-parallel size: the ranks that share one packed row; must divide the number of "
                        "processes (default: %(default)s)")
    g.add_argument("--cp-mode", choices=["allgather_kv", "ulysses"], default="allgather_kv",
                   help="allgather_kv: query chunks balanced by unmasked work, K/V gathered (any head counts); "
                        "ulysses: all-to-all sequence <-> heads (query heads divisible by --cp) "
                        "(default: %(default)s)")
    g.add_argument("--cp-align", type=int, default=128,
                   help="allgather_kv: rows per chunk are a multiple of this; a row is padded to a multiple of "
                        "8 x cp x this (default: %(default)s)")
    g.add_argument("--offload", choices=["off", "on", "auto"], default="off",
                   help="activation checkpointing of every layer with the checkpoints (layer inputs) in pinned "
                        "host memory; auto: only when they would take more than a quarter of the GPU; implies "
                        "--gradient-checkpointing (default: %(default)s)")
    g.add_argument("--keep-attention", action="store_true",
                   help="with --gradient-checkpointing or --offload: each layer keeps its attention output for the "
                        "backward, whose recompute of the layer then skips the attention (one [S, heads x head "
                        "dim] tensor more per layer, on the GPU)")
    g.add_argument("--mlp-chunk", type=int, default=None, metavar="T",
                   help="run every layer's MLP T tokens at a time (this process's tokens under --cp), each chunk "
                        "checkpointed, so that no [S, intermediate] temporaries exist; exact; 0: off (default: "
                        "65536 with --offload on/auto, else off)")
    g.add_argument("--loss-chunk", type=int, default=8192,
                   help="tokens per chunk of the LM head + loss, so that no [S, vocab] logits exist; 0: one "
                        "chunk (one process: the model's own loss) (default: %(default)s)")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject option values the examples cannot use (exits through ``p.error``)."""
    if args.device is not None:
        check_device(p, args.device)
    world = env_world_size()
    if args.cp < 1 or world % args.cp:
        p.error(f"--cp {args.cp} must divide the number of processes, {world} (start them with torchrun "
                "--nproc-per-node N)")
    if args.loss_chunk < 0 or args.cp_align < 1:
        p.error("--loss-chunk must be >= 0 and --cp-align >= 1")
    if args.mlp_chunk is None:  # chunk where the offload already made room for rows this long
        from flashmask.checkpointing import MLP_CHUNK_TOKENS
        args.mlp_chunk = MLP_CHUNK_TOKENS if args.offload != "off" else 0
    if args.keep_attention and not (args.gradient_checkpointing or args.offload != "off"):
        p.error("--keep-attention needs --gradient-checkpointing or --offload (it changes what their recompute skips)")
    if args.mlp_chunk < 0:
        p.error("--mlp-chunk must be >= 0 (0: off)")
    for name in ("max_length", "batch_size", "steps", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.save_every < 0 or (args.max_samples is not None and args.max_samples < 1):
        p.error("--save-every must be >= 0 and --max-samples >= 1")
    if args.sliding_window is not None and (args.arch != "qwen2" or args.sliding_window < 1 or args.model):
        p.error("--sliding-window needs the qwen2 preset (--arch qwen2, no --model) and a value >= 1")
    if args.model is not None and not os.path.isdir(args.model):
        p.error(f"--model {args.model}: not a directory (a local Hugging Face model: config.json, weights, "
                "tokenizer files)")
    if args.resume is not None:
        try:
            args.resume = find_checkpoint(args.resume)
        except FileNotFoundError as e:
            p.error(str(e))
        if args.output_dir is None:  # keep writing next to the checkpoint we continue from
            args.output_dir = os.path.dirname(os.path.abspath(args.resume))


def check_device(p: argparse.ArgumentParser, name: str) -> None:
    """``--device NAME`` parses as a torch device, and a CUDA one exists here (exits through ``p.error``)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        p.error(f"--device {name}: not a device name (cpu, cuda, cuda:1, ...)")
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        p.error(f"--device {name}: CUDA is not available ({why}); use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        p.error(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1})")
