"""Command-line pieces shared by the benchmark scripts: comma lists (``8k,32k``), the dtype names,
the timing options and the options that let the CPU tests run a script without CUDA."""
from __future__ import annotations

from typing import List, Sequence

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_int_list(text: str) -> List[int]:
    """``"8192,32k,128K,2m"`` -> ``[8192, 32768, 131072, 2097152]`` (k = 1024, m = 1024 * 1024)."""
    out = []
    for tok in str(text).split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        mult = 1
        if tok.endswith("k"):
            tok, mult = tok[:-1], 1024
        elif tok.endswith("m"):
            tok, mult = tok[:-1], 1024 * 1024
        try:
            val = int(tok) * mult
        except ValueError:
            raise ValueError(f"not an integer: {tok!r} in {text!r}") from None
        if val <= 0:
            raise ValueError(f"values must be positive, got {val} in {text!r}")
        out.append(val)
    if not out:
        raise ValueError(f"empty list: {text!r}")
    return out


def parse_choice_list(text: str, choices: Sequence[str], what: str) -> List[str]:
    """Comma-separated names, each checked against ``choices`` (``all`` = every choice)."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if items == ["all"]:
        return list(choices)
    bad = [t for t in items if t not in choices]
    if bad:
        raise ValueError(f"unknown {what} {bad}; choose from {', '.join(choices)}")
    if not items:
        raise ValueError(f"no {what} given")
    return list(dict.fromkeys(items))


def add_timing_args(p) -> None:
    """--quick / --warmup / --rep of the do_bench timings; resolve_timing fills the defaults."""
    p.add_argument("--quick", action="store_true", help="fewer repetitions (warmup 10 ms, rep 30 ms)")
    p.add_argument("--warmup", type=float, default=None, help="do_bench warmup in ms (default 25, --quick 10)")
    p.add_argument("--rep", type=float, default=None, help="do_bench repetition time in ms (default 100, --quick 30)")


def resolve_timing(args) -> None:
    if args.warmup is None:
        args.warmup = 10.0 if args.quick else 25.0
    if args.rep is None:
        args.rep = 30.0 if args.quick else 100.0


def add_baseline_mask_args(p) -> None:
    """How the baselines get their masks: Flex's BlockMask and dense-mask SDPA's S x S masks."""
    p.add_argument("--flex-block-mask", default="auto", choices=["auto", "eager", "compile"],
                   help="create_block_mask eagerly (dense SxS temporaries) or through torch.compile; "
                        "auto: eager when 8*S^2 bytes fit in half the free memory")
    p.add_argument("--dense-mem-fraction", type=float, default=0.5,
                   help="run dense-mask SDPA only if bool mask + additive mask fit in this share of free memory")


def add_testing_args(p, device_help: str = "torch device (cpu only for smoke tests)") -> None:
    """The options that let the CPU smoke tests run a benchmark script without CUDA."""
    g = p.add_argument_group("testing options")
    g.add_argument("--device", default="cuda", help=device_help)
    g.add_argument("--flashmask-backend", default="cuda", choices=["cuda", "auto", "reference"],
                   help="backend= passed to flashmask_attention")
    g.add_argument("--flex-no-compile", action="store_true", help="eager flex_attention (slow; for smoke tests)")
