"""What logit soft-capping and attention sinks cost flashmask: the same tensors timed without an
option, with ``softcap`` and with ``sinks``, in every pass, so that each ratio compares calls of one
run on one device.

For each (pass, head dim, seqlen, family) the mask is ``masks.examples.example(family, seqlen)``
(``full`` and ``causal`` run without a mask tensor, as ``causal=`` alone), and the ratio is
``ms with the option / ms without``: above 1 the option costs time. The backward modes with sinks
also compute the sinks' gradient. A table per pass and the CSV of every timing.

Example::

    python -m benchmarks.bench_options                                  # full, causal, causal_document
    python -m benchmarks.bench_options --head-dims 256 --softcap 30 --passes 3
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

import masks
from benchmarks.cli import add_timing_args, parse_choice_list, parse_int_list, resolve_timing
from benchmarks.output import default_out_dir
from benchmarks.timing import make_inputs, make_sinks, make_step, time_ms
from masks.examples import example

OPTIONS = ("plain", "softcap", "sinks")
MODES = ("fwd", "fwdbwd")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="full,causal,causal_document",
                   help=f"comma list or 'all': {', '.join(masks.FAMILIES)}")
    p.add_argument("--seqlens", default="8192,32768", help="comma list; 'k' suffix = 1024")
    p.add_argument("--head-dims", default="64,128,256", help="comma list")
    p.add_argument("--heads", type=int, default=16, help="query and key/value heads")
    p.add_argument("--softcap", type=float, default=50.0, help="the soft-cap of the softcap runs (Gemma 2: 50)")
    p.add_argument("--passes", type=int, default=2, help="the whole sweep this many times, one after another")
    p.add_argument("--out", default=None, help="folder for options.csv (default runs/options)")
    add_timing_args(p)
    args = p.parse_args(argv)
    if not (args.softcap > 0 and args.softcap < float("inf")):
        p.error(f"--softcap must be a finite number > 0, got {args.softcap}")
    if args.passes < 1:
        p.error(f"--passes must be >= 1, got {args.passes}")
    try:
        args.families = parse_choice_list(args.families, tuple(masks.FAMILIES), "families")
        args.seqlens = parse_int_list(args.seqlens)
        args.head_dims = parse_int_list(args.head_dims)
    except ValueError as e:
        p.error(str(e))
    resolve_timing(args)
    return args


def option_kwargs(option: str, softcap: float, sinks: torch.Tensor) -> dict:
    return {"plain": {}, "softcap": {"softcap": softcap}, "sinks": {"sinks": sinks}}[option]


def run(args) -> list:
    import flashmask

    if not flashmask.cuda.available():
        raise SystemExit(f"bench_options needs the CUDA kernels: {flashmask.cuda.unavailable_reason()}")
    device = torch.device("cuda")
    rows = []
    for pass_ in range(1, args.passes + 1):
        for d in args.head_dims:
            for s in args.seqlens:
                q, k, v, dout = make_inputs(1, s, args.heads, d, torch.bfloat16, device)
                sinks = make_sinks(args.heads, device)
                for family in args.families:
                    mask, causal = example(family, s, device=device)
                    if family in ("full", "causal"):
                        mask = None
                    for option in OPTIONS:
                        kw = option_kwargs(option, args.softcap, sinks)

                        def attn(q_, k_, v_, kw=kw, mask=mask, causal=causal):
                            return flashmask.flashmask_attention(q_, k_, v_, mask, causal=causal, backend="cuda", **kw)

                        params = (sinks,) if option == "sinks" else ()
                        for mode in MODES:
                            ms = time_ms(make_step(attn, mode, q, k, v, dout, params), args.warmup, args.rep, device)
                            rows.append(dict(pass_=pass_, head_dim=d, seqlen=s, family=family, option=option,
                                             mode=mode, ms=round(ms, 4)))
                print(f"pass {pass_}: head dim {d}, {s} tokens done", file=sys.stderr, flush=True)
    return rows


def ratios(rows: list) -> list:
    """(head dim, seqlen, family, option, mode, [ratio of each pass]) against the plain calls."""
    plain = {(r["pass_"], r["head_dim"], r["seqlen"], r["family"], r["mode"]): r["ms"]
             for r in rows if r["option"] == "plain"}
    out = {}
    for r in rows:
        if r["option"] != "plain":
            key = (r["head_dim"], r["seqlen"], r["family"], r["option"], r["mode"])
            out.setdefault(key, []).append(r["ms"] / plain[(r["pass_"], *key[:3], r["mode"])])
    return [(*key, vals) for key, vals in out.items()]


def main(argv=None):
    args = parse_args(argv)
    rows = run(args)
    out = args.out or default_out_dir("options")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "options.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("\n   D      S  family              option   mode     ms with / ms without, each pass")
    for d, s, family, option, mode, vals in ratios(rows):
        print(f"{d:4d} {s:6d}  {family:18s}  {option:7s}  {mode:7s}  " + "  ".join(f"{x:.3f}" for x in vals))
    print(f"\n{len(rows)} timings -> {path}")
    return rows


if __name__ == "__main__":
    main()
