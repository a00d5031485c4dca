"""The parts the training examples share, one function each: argument parsing, model loading, data
loading and the training loop (progress, smoothed tokens/s, checkpoints, resuming, loss curve).

Models: ``--model PATH`` loads any Hugging Face causal LM and its tokenizer from a local directory
(``from_pretrained``); without it a small randomly initialised Llama or Qwen2 preset is built from a
config with a byte-level tokenizer (``byte_tokenizer.py``), so that nothing is downloaded.
Data: JSON / JSONL / Parquet / CSV files through ``datasets.load_dataset``, or a dataset name
(needs the network).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, ROOT)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import byte_tokenizer  # noqa: E402
from train_log import LossLog, Throughput, peak_memory_str  # noqa: E402

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
                        "shape), 1b (Llama-3.2-1B shape); default: tiny")
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


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject option values the examples cannot use (exits through ``p.error``)."""
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

    # transformers renamed torch_dtype to dtype in 4.56.
    key = "dtype" if version.parse(transformers.__version__).release >= (4, 56) else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn_implementation,
                                                              **{key: dtype})
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
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
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
    """
    import datasets

    datasets.disable_progress_bars()
    files = sorted(glob.glob(spec)) if any(c in spec for c in "*?[") else ([spec] if os.path.isfile(spec) else [])
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


def save_pretrained(model, path: str) -> None:
    """``model.save_pretrained(path)`` without transformers' progress bar, which would cut through ours."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        hf_logging.enable_progress_bar()


def save_checkpoint(directory: str, step: int, model, tok, optimizer, stream: PackedStream, log: LossLog) -> str:
    """``<directory>/checkpoint-<step>``: ``save_pretrained`` model and tokenizer (loadable with
    ``--model``), plus the optimizer, data position and loss history for ``--resume``."""
    path = os.path.join(directory, f"checkpoint-{step}")
    save_pretrained(model, path)
    tok.save_pretrained(path)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "stream": stream.state_dict(),
                "history": log.rows, "torch_rng": torch.get_rng_state()}, os.path.join(path, TRAINER_STATE))
    return path


def restore(path: str, optimizer, stream: PackedStream) -> Tuple[int, List[Dict]]:
    """Load what :func:`save_checkpoint` wrote besides the model; returns ``(step, history)``."""
    state = torch.load(os.path.join(path, TRAINER_STATE), map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    stream.load_state_dict(state["stream"])
    torch.set_rng_state(state["torch_rng"])
    return state["step"], state["history"]


# --------------------------------------------------------------------------------------------------
# training loop


def train(args, name: str, model, tok, optimizer, stream: PackedStream,
          step_fn: Callable[[int], Tuple[torch.Tensor, int, Dict]],
          describe: Callable[[Dict], str] = lambda extras: "") -> Dict:
    """Run the optimizer steps up to ``args.steps`` (from the checkpoint's step with ``--resume``).

    ``step_fn(step)`` takes the next rows from ``stream``, runs forward and backward, and returns
    ``(loss, tokens, extras)``: the loss tensor, the real tokens it trained on, and numbers to log
    (a CSV column each). This loop clips the gradients, steps the optimizer, times the step, and
    shows a progress bar, a log line every ``--log-every`` steps (``describe(extras)`` adds to it),
    checkpoints and the loss curve.

    Returns ``{"losses": [...], "first_loss", "last_loss", "tokens_per_s", "checkpoint", "loss_csv",
    "loss_png", "history"}``; with ``--resume`` the losses and history include the earlier steps.
    """
    from tqdm.auto import tqdm

    start, history = restore(args.resume, optimizer, stream) if args.resume else (0, [])
    log, meter = LossLog(args.output_dir, history), Throughput()
    bar = tqdm(total=args.steps, initial=start, desc=name, unit="step", dynamic_ncols=True,
               disable={"auto": None, "on": False, "off": True}[args.progress])
    say = bar.write if not bar.disable else (lambda s: print(s, flush=True))
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
                 "elapsed_s": time.perf_counter() - t_run})
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:,.0f}", refresh=False)
        bar.update(1)
        if step % args.log_every == 0 or step == args.steps:
            more = describe(extras)
            say(f"step {step:5d} | loss {loss:.4f} | {more + ' | ' if more else ''}{rate:,.0f} tokens/s | "
                f"peak mem {peak_memory_str(args.device)}")
        if args.output_dir and args.save_every and step % args.save_every == 0 and step < args.steps:
            say(f"saved {save_checkpoint(args.output_dir, step, model, tok, optimizer, stream, log)}")
    bar.close()
    checkpoint = None
    if args.output_dir and start < args.steps:
        checkpoint = save_checkpoint(args.output_dir, args.steps, model, tok, optimizer, stream, log)
        say(f"saved {checkpoint}")
    log.close()
    png = log.plot(f"{name}: {getattr(args, 'model_desc', '')}")
    if png:
        say(f"loss curve: {log.csv_path}, {png}")
    losses = [r["loss"] for r in log.rows]
    return {"losses": losses, "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "tokens_per_s": log.rows[-1]["tokens_per_s"] if log.rows else None,
            "checkpoint": checkpoint, "loss_csv": log.csv_path, "loss_png": png, "history": log.rows}


def backend_note(device: torch.device, dtype: torch.dtype) -> str:
    import flashmask

    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flashmask.cuda.available():
        return "flashmask CUDA kernels"
    return "flashmask reference path (pure PyTorch)"
