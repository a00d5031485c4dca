"""Shared pieces of the training examples: a byte-level tokenizer, model presets, data loading,
throughput and memory reporting.

Nothing is downloaded: models are randomly initialised from a config and text is tokenised
byte by byte.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from typing import Dict, Iterator, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, ROOT)

DATA_DIR = os.path.join(HERE, "data")


class ByteTokenizer:
    """Byte-level tokenizer: UTF-8 bytes are ids 0-255; 256 = PAD, 257 = BOS, 258 = EOS.

    ``vocab_size`` (320) rounds the 259 used ids up to a multiple of 64 for the embedding table.

    Example::

        >>> tok = ByteTokenizer()
        >>> tok.encode("hi", bos=True, eos=True)
        [257, 104, 105, 258]
        >>> tok.decode([257, 104, 105, 258])
        'hi'
    """

    pad_token_id, bos_token_id, eos_token_id = 256, 257, 258
    vocab_size = 320

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> List[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if bos else []) + ids + ([self.eos_token_id] if eos else [])

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def prompt_text(instruction: str) -> str:
    """The chat template of the examples."""
    return f"User: {instruction}\nAssistant: "


# --------------------------------------------------------------------------------------------------
# models

# name -> (hidden, intermediate, layers, heads, kv heads)
MODEL_SIZES = {
    "tiny": (64, 128, 2, 4, 2),          # ~0.1M parameters: CPU tests
    "small": (256, 688, 4, 8, 2),        # ~3M
    "0.5b": (896, 4864, 24, 14, 2),      # Qwen2-0.5B shape (byte vocabulary): ~360M
    "1b": (2048, 8192, 16, 32, 8),       # Llama-3.2-1B shape (byte vocabulary): ~1B
}


def build_model(arch: str, size: str, *, attn_implementation: str, max_length: int, vocab_size: int,
                dtype: torch.dtype, device, seed: int = 0, sliding_window: Optional[int] = None):
    """A randomly initialised Llama or Qwen2 causal LM (transformers), on ``device`` in ``dtype``."""
    import transformers

    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(MODEL_SIZES)}")
    hidden, inter, layers, heads, kv = MODEL_SIZES[size]
    common = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=vocab_size, max_position_embeddings=max(max_length, 2048),
                  rope_theta=1_000_000.0, tie_word_embeddings=True, pad_token_id=ByteTokenizer.pad_token_id,
                  bos_token_id=ByteTokenizer.bos_token_id, eos_token_id=ByteTokenizer.eos_token_id)
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


# --------------------------------------------------------------------------------------------------
# data


def load_jsonl(path: str):
    """A ``datasets.Dataset`` from a local JSONL file (no network)."""
    import datasets

    datasets.disable_progress_bars()
    return datasets.load_dataset("json", data_files=path, split="train")


def stream(items: List, seed: int) -> Iterator:
    """Endless iterator over ``items``, reshuffled every epoch."""
    g = torch.Generator().manual_seed(seed)
    while True:
        for i in torch.randperm(len(items), generator=g).tolist():
            yield items[i]


def take_rows(it: Iterator, size_of, max_length: int, rows: int, pending: list) -> List[List]:
    """Fill ``rows`` rows of up to ``max_length`` tokens from the stream ``it`` (next-fit packing).

    ``pending`` carries the sample that did not fit over to the next call.
    """
    out = []
    for _ in range(rows):
        row, used = [], 0
        while True:
            item = pending.pop() if pending else next(it)
            n = size_of(item)
            if n > max_length:
                continue  # longer than a whole pack: skip
            if used + n > max_length:
                pending.append(item)
                break
            row.append(item)
            used += n
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------------
# reporting


def parse_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose from {sorted(table)}")
    return table[name]


def peak_memory_str(device: torch.device) -> str:
    """Peak memory so far: CUDA ``max_memory_allocated`` or the process' peak RSS on CPU."""
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB (cuda)"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (rss)"


def make_parser(doc: str, data_file: str, data_help: str, *, default_lr: float,
                default_steps: int) -> argparse.ArgumentParser:
    """The examples' argument parser: --data (default data/<data_file>) and the common options."""
    p = argparse.ArgumentParser(description=doc,
                                epilog="Model presets: " + ", ".join(
                                    f"{k}={v[2]} layers x {v[0]} hidden" for k, v in MODEL_SIZES.items()),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(DATA_DIR, data_file),
                   help=f"{data_help} (default: data/{data_file})")
    add_common_args(p, default_lr=default_lr, default_steps=default_steps)
    return p


def add_common_args(p: argparse.ArgumentParser, *, default_lr: float, default_steps: int) -> None:
    p.add_argument("--arch", choices=["llama", "qwen2"], default="llama", help="model family (default: %(default)s)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny",
                   help="randomly initialised model preset: tiny (CPU tests), small, 0.5b (Qwen2-0.5B shape), "
                        "1b (Llama-3.2-1B shape); default: tiny")
    p.add_argument("--max-length", type=int, default=512, help="tokens per packed row (the pack length); "
                   "e.g. 32768 on a GPU (default: 512)")
    p.add_argument("--batch-size", type=int, default=2, help="packed rows per step (default: 2)")
    p.add_argument("--steps", type=int, default=default_steps, help=f"optimizer steps (default: {default_steps})")
    p.add_argument("--lr", type=float, default=default_lr, help=f"AdamW learning rate (default: {default_lr})")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    p.add_argument("--dtype", type=parse_dtype, default=None,
                   help="parameter/compute dtype: float32, bfloat16 or float16 (default: bfloat16 on cuda, "
                        "float32 on cpu); the kernels need bfloat16/float16")
    p.add_argument("--log-every", type=int, default=1, help="print a progress line every N steps (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed for model init and data order (default: 0)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute layer activations in backward (for long packs on a GPU)")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="qwen2 only: use a sliding-window attention of this many tokens in every layer")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject option values the examples cannot use (exits through ``p.error``)."""
    for name in ("max_length", "batch_size", "steps", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.sliding_window is not None and (args.arch != "qwen2" or args.sliding_window < 1):
        p.error("--sliding-window needs --arch qwen2 and a value >= 1")


def resolve_device_dtype(args) -> None:
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.dtype is None:
        args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)


class Meter:
    """Tokens/s between log lines."""

    def __init__(self, device: torch.device):
        self.device, self.tokens, self.t0 = device, 0, time.perf_counter()

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def rate(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        r = self.tokens / max(t - self.t0, 1e-9)
        self.tokens, self.t0 = 0, t
        return r


def backend_note(device: torch.device, dtype: torch.dtype) -> str:
    import flashmask

    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flashmask.cuda.available():
        return "flashmask CUDA kernels"
    return "flashmask reference path (pure PyTorch)"


def summary_dict(losses: List[float], extra: Optional[Dict] = None) -> Dict:
    out = {"losses": losses, "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}
    out.update(extra or {})
    return out
