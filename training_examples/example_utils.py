"""The parts the training examples share, one function each: argument parsing, model loading, data
loading and the training loop (progress, smoothed tokens/s, checkpoints, resuming, loss curve).

Models: ``--model PATH`` loads any Hugging Face causal LM and its tokenizer from a local directory
(``from_pretrained``); without it a small randomly initialised Llama or Qwen2 preset is built from a
config with a byte-level tokenizer (``byte_tokenizer.py``), so that nothing is downloaded.
Data: JSON / JSONL / Parquet / CSV files through ``datasets.load_dataset``, or a dataset name
(needs the network).
Several processes (``torchrun --nproc-per-node N``): parameters sharded with FSDP2 over a
``(dp, cp)`` DeviceMesh, each packed row split over the ``cp`` ranks of its group (context
parallelism, :mod:`flashmask.distributed`); see :class:`Parallel`. For long rows: per-layer activation
checkpointing (``--offload``: the checkpoints in host memory), the MLPs in chunks of tokens
(``--mlp-chunk``: no ``[S, intermediate]`` temporaries) and the chunked LM-head loss
(``--loss-chunk``: no ``[S, vocab]`` logits).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, ROOT)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import byte_tokenizer  # noqa: E402
from train_log import LossLog, Throughput, peak_memory_gib  # noqa: E402

DATA_DIR = os.path.join(HERE, "data")
TRAINER_STATE = "trainer_state.pt"


def prompt_text(instruction: str) -> str:
    """The prompt format of the examples for tokenizers without a chat template."""
    return f"User: {instruction}\nAssistant: "


# --------------------------------------------------------------------------------------------------
# argument parsing


def parse_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose from {sorted(table)}")
    return table[name]


# name -> (hidden, intermediate, layers, heads, kv heads)
MODEL_SIZES = {
    "tiny": (64, 128, 2, 4, 2),          # ~0.1M parameters: CPU tests
    "small": (256, 688, 4, 8, 2),        # ~3M
    "0.5b": (896, 4864, 24, 14, 2),      # Qwen2-0.5B shape (byte vocabulary): ~360M
    "1b": (2048, 8192, 16, 32, 8),       # Llama-3.2-1B shape (byte vocabulary): ~1B
    "3b": (3072, 8192, 28, 24, 8),       # Llama-3.2-3B shape (byte vocabulary): ~3B, head dim 128
}


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
    g = p.add_argument_group("long context", "several GPUs: torchrun --nproc-per-node N SCRIPT --cp C (FSDP2 over "
                                             "all N, each row split over C of them, N/C data-parallel groups)")
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
    g.add_argument("--mlp-chunk", type=int, default=None, metavar="T",
                   help="run every layer's MLP T tokens at a time (this process's tokens under --cp), each chunk "
                        "checkpointed, so that no [S, intermediate] temporaries exist; exact; 0: off (default: "
                        "65536 with --offload on/auto, else off)")
    g.add_argument("--loss-chunk", type=int, default=8192,
                   help="tokens per chunk of the LM head + loss, so that no [S, vocab] logits exist; 0: one "
                        "chunk (one process: the model's own loss) (default: %(default)s)")


def env_world_size() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject option values the examples cannot use (exits through ``p.error``)."""
    world = env_world_size()
    if args.cp < 1 or world % args.cp:
        p.error(f"--cp {args.cp} must divide the number of processes, {world} (start them with torchrun "
                "--nproc-per-node N)")
    if args.loss_chunk < 0 or args.cp_align < 1:
        p.error("--loss-chunk must be >= 0 and --cp-align >= 1")
    if args.mlp_chunk is None:  # chunk where the offload already made room for rows this long
        from flashmask.checkpointing import MLP_CHUNK_TOKENS
        args.mlp_chunk = MLP_CHUNK_TOKENS if args.offload != "off" else 0
    if args.mlp_chunk < 0:
        p.error("--mlp-chunk must be >= 0 (0: off)")
    if world > 1 and args.sliding_window is not None:
        p.error("--sliding-window is not supported with several processes (context parallelism)")
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


def resolve_device_dtype(args) -> None:
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.device.type == "cuda":
        if args.device.index is None:  # under torchrun: one GPU per process
            index = int(os.environ.get("LOCAL_RANK", "0")) if env_world_size() > 1 else torch.cuda.current_device()
            args.device = torch.device("cuda", index)
        torch.cuda.set_device(args.device)
    if args.dtype is None:
        args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)


# --------------------------------------------------------------------------------------------------
# model loading


def build_model(arch: str, size: str, *, attn_implementation: str, max_length: int, vocab_size: int,
                dtype: torch.dtype, device, seed: int = 0, sliding_window: Optional[int] = None):
    """A randomly initialised Llama or Qwen2 causal LM (transformers), on ``device`` in ``dtype``."""
    import transformers

    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(MODEL_SIZES)}")
    hidden, inter, layers, heads, kv = MODEL_SIZES[size]
    common = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=vocab_size, max_position_embeddings=max(max_length, 2048),
                  rope_theta=1_000_000.0, tie_word_embeddings=True, pad_token_id=byte_tokenizer.PAD,
                  bos_token_id=byte_tokenizer.BOS, eos_token_id=byte_tokenizer.EOS)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        extra = {}
        if sliding_window is not None:
            extra = dict(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0)
        cfg = transformers.Qwen2Config(**common, **extra)
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}; choose 'llama' or 'qwen2'")
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation=attn_implementation)
    return model.to(device=device, dtype=dtype)


def load_pretrained(path: str, *, attn_implementation: str, dtype: torch.dtype, device, tokenizer: bool = True):
    """``(model, tokenizer)`` of a local Hugging Face causal LM directory (tokenizer None if not wanted)."""
    import transformers
    from packaging import version
    from transformers.utils import logging as hf_logging

    # transformers renamed torch_dtype to dtype in 4.56.
    key = "dtype" if version.parse(transformers.__version__).release >= (4, 56) else "torch_dtype"
    quiet = int(os.environ.get("RANK", "0")) > 0  # one progress bar, not one per process
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn_implementation,
                                                                  **{key: dtype})
    finally:
        if quiet:
            hf_logging.enable_progress_bar()
    tok = transformers.AutoTokenizer.from_pretrained(path) if tokenizer else None
    return model.to(device), tok


def load_model_and_tokenizer(args, attn_implementation: str):
    """``(model, tokenizer)``: from ``--resume`` (a checkpoint), ``--model``, or a random preset."""
    path = args.resume or args.model
    if path is not None:
        model, tok = load_pretrained(path, attn_implementation=attn_implementation, dtype=args.dtype,
                                     device=args.device)
        desc = os.path.basename(os.path.normpath(path))
    else:
        tok = byte_tokenizer.byte_tokenizer()
        model = build_model(args.arch, args.model_size, attn_implementation=attn_implementation,
                            max_length=args.max_length, vocab_size=byte_tokenizer.VOCAB_SIZE, dtype=args.dtype,
                            device=args.device, seed=args.seed, sliding_window=args.sliding_window)
        desc = f"{args.arch}-{args.model_size} (random init)"
    if tok.pad_token_id is None:  # many causal LMs have none; padding is never attended or scored
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.convert_ids_to_tokens(0)
    model.train()
    nparams = sum(p.numel() for p in model.parameters())
    args.model_desc = f"{desc}, {nparams / 1e6:.2f}M params, {args.dtype}"
    return model, tok


def encode(tok, text: str) -> List[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tok, instruction: str, use_chat_template: bool = True) -> List[int]:
    """Token ids of a user turn up to where the answer starts: the tokenizer's chat template when it
    has one (and ``use_chat_template``), else ``<bos>User: ...\\nAssistant: ``."""
    if use_chat_template and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                       add_generation_prompt=True)
        return encode(tok, text)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return bos + encode(tok, prompt_text(instruction))


def answer_ids(tok, text: str) -> List[int]:
    return encode(tok, text) + ([tok.eos_token_id] if tok.eos_token_id is not None else [])


# --------------------------------------------------------------------------------------------------
# data loading

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_records(spec: str, fields: Sequence[str], *, split: str = "train", config: Optional[str] = None,
                 max_samples: Optional[int] = None) -> List[Dict]:
    """The ``fields`` of every sample of a dataset, as a list of dicts.

    ``spec`` is a file (``.json`` / ``.jsonl`` / ``.parquet`` / ``.csv``), a glob of such files, a
    directory that ``datasets`` can read, or a dataset name (downloaded: needs the network).
    Without ``datasets`` installed, JSON and JSON-lines files are still read (with the json module).
    """
    files = sorted(glob.glob(spec)) if any(c in spec for c in "*?[") else ([spec] if os.path.isfile(spec) else [])
    try:
        import datasets
    except ImportError:
        if files and all(os.path.splitext(f)[1].lower() in (".json", ".jsonl") for f in files):
            return _json_records(files, fields, max_samples)
        raise ImportError(f"--data {spec}: reading it needs the `datasets` package (pip install datasets); "
                          f"JSON / JSONL files are read without it") from None

    datasets.disable_progress_bars()
    if files:
        exts = {os.path.splitext(f)[1].lower() for f in files}
        if len(exts) != 1 or next(iter(exts)) not in _FILE_BUILDERS:
            raise ValueError(f"--data {spec}: expected .json, .jsonl, .parquet or .csv files, got {sorted(exts)}")
        builder = _FILE_BUILDERS[exts.pop()]
        # CSV cells are typed by guessing: read the text fields as written ("42." stays a string).
        kwargs = {"converters": {f: str for f in fields}} if builder == "csv" else {}
        ds = datasets.load_dataset(builder, data_files=files, split="train", **kwargs)
    elif os.path.isdir(spec):
        ds = datasets.load_dataset(spec, split=split)
    else:
        try:
            ds = datasets.load_dataset(spec, config, split=split)
        except Exception as e:  # noqa: BLE001 - say what was tried, keep the cause
            raise RuntimeError(f"--data {spec}: not a local file or directory, and loading it as a dataset name "
                               f"failed (offline, or a wrong name/config/split?): {e}") from e
    missing = [f for f in fields if f not in ds.column_names]
    if missing:
        raise ValueError(f"--data {spec}: no field {missing[0]!r}; its fields are {ds.column_names} "
                         f"(choose them with the --*-field options)")
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
    ds = ds.select_columns(list(fields))
    return [r for r in ds if all(r[f] is not None for f in fields)]


def _json_records(files: Sequence[str], fields: Sequence[str], max_samples: Optional[int]) -> List[Dict]:
    """What load_records returns for JSON / JSON-lines files, read without ``datasets``: a machine
    without it (a GPU box with no package index) still trains on the shipped data."""
    rows: List[Dict] = []
    for path in files:
        with open(path) as f:
            text = f.read()
        stripped = text.lstrip()
        if stripped.startswith("["):
            rows.extend(json.loads(text))
        else:
            rows.extend(json.loads(line) for line in text.splitlines() if line.strip())
    if rows:
        missing = [f for f in fields if f not in rows[0]]
        if missing:
            raise ValueError(f"--data {files[0]}: no field {missing[0]!r}; its fields are {sorted(rows[0])} "
                             f"(choose them with the --*-field options)")
    if max_samples is not None:
        rows = rows[:max_samples]
    return [{f: r[f] for f in fields} for r in rows if all(r.get(f) is not None for f in fields)]


class PackedStream:
    """An endless stream of samples packed into rows of ``max_length`` tokens, resumable.

    Every epoch visits the samples in a fresh order (a permutation seeded by ``seed + epoch``);
    rows are filled next-fit, and the sample that did not fit opens the next row. ``state_dict``
    records where the stream stands, so a resumed run sees the same rows as an uninterrupted one.
    """

    def __init__(self, items: List, size_of: Callable, max_length: int, seed: int):
        self.items, self.size_of, self.max_length, self.seed = items, size_of, max_length, seed
        fits = [i for i, x in enumerate(items) if size_of(x) <= max_length]
        if not fits:
            raise ValueError(f"no sample fits in --max-length {max_length} tokens")
        self.dropped = len(items) - len(fits)
        self.fits = fits
        self.epoch, self.pos, self.pending = 0, 0, None
        self._order = self._permutation()

    def _permutation(self) -> List[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return [self.fits[i] for i in torch.randperm(len(self.fits), generator=g).tolist()]

    def _next(self) -> int:
        if self.pending is not None:
            i, self.pending = self.pending, None
            return i
        if self.pos == len(self._order):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._permutation()
        self.pos += 1
        return self._order[self.pos - 1]

    def rows(self, n: int) -> List[List]:
        out = []
        for _ in range(n):
            row, used = [], 0
            while True:
                i = self._next()
                size = self.size_of(self.items[i])
                if used + size > self.max_length:
                    self.pending = i
                    break
                row.append(self.items[i])
                used += size
            out.append(row)
        return out

    def state_dict(self) -> Dict:
        return {"epoch": self.epoch, "pos": self.pos, "pending": self.pending}

    def load_state_dict(self, state: Dict) -> None:
        self.epoch, self.pos, self.pending = state["epoch"], state["pos"], state["pending"]
        self._order = self._permutation()


# --------------------------------------------------------------------------------------------------
# several processes: FSDP2 over a (dp, cp) mesh, context parallelism over cp


@dataclass
class Parallel:
    """Where this process stands. ``world == 1``: one process, nothing distributed. Otherwise
    ``world = dp x cp`` ranks on the DeviceMesh ``mesh`` (dimensions ``"dp"``, ``"cp"``): the ``cp``
    ranks ``[k * cp, (k + 1) * cp)`` share one batch (context-parallel ``group``, attention
    ``mode``), the ``dp`` groups see different batches, and FSDP2 shards the parameters over all."""

    rank: int = 0
    world: int = 1
    cp: int = 1
    mode: str = "allgather_kv"
    mesh: object = None
    group: object = None

    @property
    def dp(self) -> int:
        return self.world // self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def describe(self) -> str:
        if not self.distributed:
            return "1 process"
        cp = f" {self.mode}" if self.cp > 1 else ""
        return f"{self.world} processes, dp={self.dp} x cp={self.cp}{cp}, FSDP2"


def init_parallel(args) -> Parallel:
    """Under torchrun (``WORLD_SIZE`` > 1): the process group (NCCL on GPUs, gloo on the CPU) and the
    ``(dp, cp)`` mesh; else a one-process :class:`Parallel`. Call after :func:`resolve_device_dtype`."""
    world = env_world_size()
    if world == 1:
        return Parallel()
    import torch.distributed as dist
    from flashmask.distributed import fsdp as fm_fsdp

    if not dist.is_initialized():
        if args.device.type == "cuda":
            dist.init_process_group("nccl", device_id=args.device)
        else:
            dist.init_process_group("gloo")
    mesh = fm_fsdp.init_mesh(world // args.cp, args.cp, device_type=args.device.type)
    mode = args.cp_mode if args.cp > 1 else "ulysses"  # a group of one: plain attention, no padding
    return Parallel(dist.get_rank(), world, args.cp, mode, mesh, fm_fsdp.cp_group(mesh))


def finish_parallel(par: Parallel) -> None:
    """Tears the process groups down (call it in a ``finally``). After a clean run the ranks first
    wait for each other, through a barrier and then through the rendezvous store: a gloo rank that
    tore its groups down while a peer was still finishing the last collective (the barrier itself,
    too) aborted that peer at exit (SIGABRT, "terminate called without an active exception"). The
    store is not one of the groups' connections, so once every rank has counted itself there none
    is in flight. After an error there is no wait: a peer may be gone."""
    if par.distributed:
        import torch.distributed as dist
        if dist.is_initialized():
            if sys.exc_info()[0] is None:
                dist.barrier()
                _wait_for_every_rank(dist, "flashmask/finished")
            dist.destroy_process_group()


def _wait_for_every_rank(dist, key: str, timeout_s: float = 60.0) -> None:
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world and time.monotonic() < deadline:
        time.sleep(0.01)


def run_parallel(args, run):
    """``run(args, par)`` on the device and dtype of ``args``, inside the process groups of
    :func:`init_parallel` (one process: none), which are torn down after it however it ends."""
    resolve_device_dtype(args)
    par = init_parallel(args)
    try:
        return run(args, par)
    finally:
        finish_parallel(par)


def prepare_model(model, args, par: Parallel, *, train: bool = True):
    """Activation checkpointing of every layer (``--gradient-checkpointing`` / ``--offload``, when
    ``train``); the MLPs in chunks (``--mlp-chunk``; also for a frozen model, whose forward without
    grad then holds one chunk's temporaries); with several processes the context-parallel attention
    backend (``fm_cp``) and FSDP2. Create the optimizer after this (it must see the sharded parameters)."""
    if train and (args.gradient_checkpointing or args.offload != "off"):
        from flashmask.checkpointing import enable_activation_checkpointing
        enable_activation_checkpointing(model, offload={"off": False, "on": True, "auto": "auto"}[args.offload])
    if args.mlp_chunk:
        from flashmask.checkpointing import chunk_mlp
        chunk_mlp(model, args.mlp_chunk)
    if par.distributed:
        import flashmask.distributed.hf as cp_hf
        from flashmask.distributed import fsdp as fm_fsdp
        cp_hf.use_context_parallel(model)
        fm_fsdp.apply_fsdp2(model, par.mesh)
    return model


def next_rows(stream: "PackedStream", args, par: Parallel) -> Tuple[List, List]:
    """``(rows of the step, this rank's rows)``: every rank draws the same ``--batch-size x dp`` rows;
    data-parallel group ``k`` takes the ``k``-th ``--batch-size`` of them (its cp ranks alike)."""
    rows = stream.rows(args.batch_size * par.dp)
    i = par.dp_rank * args.batch_size
    return rows, rows[i:i + args.batch_size]


def to_device(batch: Dict[str, torch.Tensor], device) -> Dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def chunk_size(args) -> int:
    """Tokens per chunk of the LM head (``--loss-chunk``; 0: all in one)."""
    return args.loss_chunk if args.loss_chunk > 0 else 2 ** 62


def shard_batch(batch: Dict[str, torch.Tensor], args, par: Parallel):
    """``(local, plan)``: this rank's tokens of a packed batch and the attention plan of its cp group."""
    from flashmask import distributed as fmd
    return fmd.shard_packed_batch(batch, group=par.group, mode=par.mode, align=args.cp_align)


def parallel_context(plan):
    """``with parallel_context(plan):`` around forward and backward (``nullcontext`` for ``None``)."""
    if plan is None:
        return nullcontext()
    import flashmask.distributed.hf as cp_hf
    return cp_hf.context_parallel(plan)


def causal_lm_loss_one_process(model, batch: Dict[str, torch.Tensor], args) -> torch.Tensor:
    """The mean next-token loss of a collated batch: decoder + chunked LM head (no ``[S, vocab]``
    logits), or the model's own loss with ``--loss-chunk 0``."""
    if args.loss_chunk <= 0:
        return model(**batch, use_cache=False).loss
    from flashmask.losses import causal_lm_loss
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    return causal_lm_loss(hidden, model.get_output_embeddings(), batch["labels"], chunk_size=args.loss_chunk)


def causal_lm_step(model, batch: Dict[str, torch.Tensor], args, par: Parallel) -> torch.Tensor:
    """Forward and backward of the causal-LM loss of a collated packed batch (on the device);
    returns the batch loss (with several processes: summed over cp, averaged over dp) for logging."""
    if not par.distributed:
        loss = causal_lm_loss_one_process(model, batch, args)
        loss.backward()
        return loss.detach()
    from flashmask.distributed import fsdp as fm_fsdp
    local, plan = shard_batch(batch, args, par)
    with parallel_context(plan):
        loss = fm_fsdp.lm_loss(model, local, chunk_size=chunk_size(args))  # this rank's share
        loss.backward()
    return fm_fsdp.reduce_loss(loss, par.mesh)


def all_reduce(t: torch.Tensor, par: Parallel, op: str = "sum", group=None) -> torch.Tensor:
    """``t`` reduced over all ranks (or ``group``); ``op`` "sum" or "max". No-op for one process."""
    if par.distributed:
        import torch.distributed as dist
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t


def dp_mean(values: Sequence[float], par: Parallel, device) -> List[float]:
    """The mean of each value over the data-parallel groups (the same on the ranks of a cp group)."""
    if par.dp == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    all_reduce(t, par)  # every cp rank holds the same values: the sum over all ranks is cp x the dp sum
    return (t / par.world).tolist()


def peak_memory(device: torch.device, par: Parallel) -> str:
    """Peak memory of this process (CUDA ``max_memory_allocated``, CPU peak RSS); with several
    processes the maximum over the ranks (a collective: every rank calls it)."""
    gib, what = peak_memory_gib(device)
    if not par.distributed:
        return f"{gib:.2f} GiB ({what})"
    t = all_reduce(torch.tensor([gib], dtype=torch.float64, device=device), par, op="max")
    per = "GPU" if device.type == "cuda" else "process"
    return f"{float(t):.2f} GiB/{per} ({what}, max over {par.world} ranks)"


def packs_str(args, par: Parallel) -> str:
    return (f"packs of {args.max_length} tokens x {args.batch_size}"
            f"{' per data-parallel group' if par.dp > 1 else ''}")


def rate_str(tokens_per_s: float, par: Parallel) -> str:
    if not par.distributed:
        return f"{tokens_per_s:,.0f} tokens/s"
    return f"{tokens_per_s / par.world:,.0f} tokens/s/GPU ({tokens_per_s:,.0f} in all)"


# --------------------------------------------------------------------------------------------------
# checkpoints


def find_checkpoint(path: str) -> str:
    """``path`` if it is a checkpoint, else the checkpoint-STEP directory with the largest STEP in it."""
    if os.path.isfile(os.path.join(path, TRAINER_STATE)):
        return path
    found = [d for d in glob.glob(os.path.join(path, "checkpoint-*"))
             if re.fullmatch(r"checkpoint-\d+", os.path.basename(d)) and os.path.isfile(os.path.join(d, TRAINER_STATE))]
    if not found:
        raise FileNotFoundError(f"--resume {path}: neither a checkpoint nor a directory holding checkpoint-STEP/")
    return max(found, key=lambda d: int(d.rsplit("-", 1)[1]))


def _full_model_state(model, par: Parallel) -> Optional[Dict]:
    """With FSDP2: the whole state dict gathered to CPU on rank 0 (a collective; other ranks get
    ``{}``). One process: ``None`` (``save_pretrained`` takes the model's own)."""
    if not par.distributed:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _barrier(par: Parallel) -> None:
    if par.distributed:
        import torch.distributed as dist
        dist.barrier()


def save_pretrained(model, path: str, par: Optional[Parallel] = None) -> None:
    """``model.save_pretrained(path)`` without transformers' progress bar, which would cut through ours.
    With FSDP2 every rank must call it (the parameters are gathered); rank 0 writes."""
    from transformers.utils import logging as hf_logging

    par = par or Parallel()
    state = _full_model_state(model, par)
    if par.main:
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(path, state_dict=state)
        finally:
            hf_logging.enable_progress_bar()
    _barrier(par)


def optimizer_state(model, optimizer, par: Parallel) -> Dict:
    """The optimizer state keyed by parameter name (whole tensors on rank 0 under FSDP2, a collective),
    so that a checkpoint resumes under any number of processes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    opts = StateDictOptions(full_state_dict=par.distributed, cpu_offload=par.distributed)
    return get_optimizer_state_dict(model, optimizer, options=opts)


def load_optimizer_state(model, optimizer, state: Dict, par: Parallel) -> None:
    if state["state"] and all(isinstance(k, int) for k in state["state"]):  # written by optimizer.state_dict()
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=par.distributed))


def save_checkpoint(directory: str, step: int, model, tok, optimizer, stream: PackedStream, log: LossLog,
                    par: Optional[Parallel] = None) -> str:
    """``<directory>/checkpoint-<step>``: ``save_pretrained`` model and tokenizer (loadable with
    ``--model``), plus the optimizer, data position and loss history for ``--resume``. With several
    processes every rank calls it and rank 0 writes whole (unsharded) tensors."""
    par = par or Parallel()
    path = os.path.join(directory, f"checkpoint-{step}")
    opt_state = optimizer_state(model, optimizer, par)
    save_pretrained(model, path, par)
    if par.main:
        tok.save_pretrained(path)
        torch.save({"step": step, "optimizer": opt_state, "stream": stream.state_dict(),
                    "history": log.rows, "torch_rng": torch.get_rng_state()}, os.path.join(path, TRAINER_STATE))
    _barrier(par)
    return path


def restore(path: str, model, optimizer, stream: PackedStream,
            par: Optional[Parallel] = None) -> Tuple[int, List[Dict]]:
    """Load what :func:`save_checkpoint` wrote besides the model (every rank reads it); returns
    ``(step, history)``."""
    state = torch.load(os.path.join(path, TRAINER_STATE), map_location="cpu", weights_only=True)
    load_optimizer_state(model, optimizer, state["optimizer"], par or Parallel())
    stream.load_state_dict(state["stream"])
    torch.set_rng_state(state["torch_rng"])
    return state["step"], state["history"]


# --------------------------------------------------------------------------------------------------
# training loop


def train(args, name: str, model, tok, optimizer, stream: PackedStream,
          step_fn: Callable[[int], Tuple[torch.Tensor, int, Dict]],
          describe: Callable[[Dict], str] = lambda extras: "", par: Optional[Parallel] = None) -> Dict:
    """Run the optimizer steps up to ``args.steps`` (from the checkpoint's step with ``--resume``).

    ``step_fn(step)`` takes the next rows from ``stream``, runs forward and backward, and returns
    ``(loss, tokens, extras)``: the batch loss to log (with several processes: of the whole step,
    the same on every rank), the real tokens of the step (all data-parallel groups together) and
    numbers to log (a CSV column each). This loop clips the gradients, steps the optimizer, times
    the step, and shows a progress bar, a log line every ``--log-every`` steps (``describe(extras)``
    adds to it), checkpoints and the loss curve; with several processes rank 0 prints and writes.

    Returns ``{"losses": [...], "first_loss", "last_loss", "tokens_per_s" (all GPUs together),
    "tokens_per_s_per_gpu", "peak_memory", "checkpoint", "loss_csv", "loss_png", "history"}``; with
    ``--resume`` the losses and history include the earlier steps.
    """
    from tqdm.auto import tqdm

    par = par or Parallel()
    start, history = restore(args.resume, model, optimizer, stream, par) if args.resume else (0, [])
    log, meter = LossLog(args.output_dir if par.main else None, history), Throughput()
    bar = tqdm(total=args.steps, initial=start, desc=name, unit="step", dynamic_ncols=True,
               disable=True if not par.main else {"auto": None, "on": False, "off": True}[args.progress])
    say = bar.write if not bar.disable else (lambda s: print(s, flush=True) if par.main else None)
    if start:
        say(f"resumed from {args.resume} at step {start}")
    t_run = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        loss, tokens, extras = step_fn(step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = float(loss.detach())  # waits for the step to finish
        if args.device.type == "cuda":
            torch.cuda.synchronize(args.device)
        meter.update(tokens, time.perf_counter() - t0)
        rate = meter.rate()
        log.add({"step": step, "loss": loss, **extras, "tokens_per_s": rate,
                 "tokens_per_s_per_gpu": rate / par.world, "elapsed_s": time.perf_counter() - t_run})
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate / par.world:,.0f}", refresh=False)  # per GPU
        bar.update(1)
        if step % args.log_every == 0 or step == args.steps:
            more = describe(extras)
            mem = peak_memory(args.device, par)
            say(f"step {step:5d} | loss {loss:.4f} | {more + ' | ' if more else ''}{rate_str(rate, par)} | "
                f"peak mem {mem}")
        if args.output_dir and args.save_every and step % args.save_every == 0 and step < args.steps:
            say(f"saved {save_checkpoint(args.output_dir, step, model, tok, optimizer, stream, log, par)}")
    bar.close()
    checkpoint = None
    if args.output_dir and start < args.steps:
        checkpoint = save_checkpoint(args.output_dir, args.steps, model, tok, optimizer, stream, log, par)
        say(f"saved {checkpoint}")
    log.close()
    png = log.plot(f"{name}: {getattr(args, 'model_desc', '')}")
    if png:
        say(f"loss curve: {log.csv_path}, {png}")
    losses = [r["loss"] for r in log.rows]
    rate = log.rows[-1]["tokens_per_s"] if log.rows else None
    return {"losses": losses, "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "tokens_per_s": rate,
            "tokens_per_s_per_gpu": None if rate is None else rate / par.world,
            "peak_memory": peak_memory(args.device, par), "checkpoint": checkpoint, "loss_csv": log.csv_path,
            "loss_png": png, "history": log.rows}


def report(res: Dict, par: Parallel) -> None:
    """The closing line (rank 0): first and last loss, tokens/s (per GPU), peak memory (per GPU)."""
    if par.main:
        rate = "" if res["tokens_per_s"] is None else f"{rate_str(res['tokens_per_s'], par)}, "
        first = "-" if res["first_loss"] is None else f"{res['first_loss']:.4f}"
        last = "-" if res["last_loss"] is None else f"{res['last_loss']:.4f}"
        print(f"done: loss {first} -> {last}, {rate}peak mem {res['peak_memory']} [{par.describe()}]", flush=True)


def backend_note(device: torch.device, dtype: torch.dtype) -> str:
    import flashmask

    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flashmask.cuda.available():
        return "flashmask CUDA kernels"
    return "flashmask reference path (pure PyTorch)"
