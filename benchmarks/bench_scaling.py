"""Run time vs sparsity: causal-document masks with 1, 2, 4, ..., 64 equal documents.

If the kernels' run time follows the unmasked tiles, ``ms / density`` stays about constant as the
documents get shorter (it grows a little once documents are only a few tiles long, since the
diagonal tiles are then a larger share: ``tile density`` and ``ms / tile density`` show that).

Example::

    python -m benchmarks.bench_scaling                       # S = 32K, flashmask fwd (+ fwd+bwd with a bwd kernel)
    python -m benchmarks.bench_scaling --methods flashmask,flex --plot
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from benchmarks.cli import DTYPES, add_testing_args, add_timing_args, parse_choice_list, parse_int_list, resolve_timing
from benchmarks.cuda_memory import cleanup
from benchmarks.errors import format_error
from benchmarks.flex import configure_dynamo
from benchmarks.flops import total_pairs
from benchmarks.methods import Options, Problem, release, try_prepare
from benchmarks.output import default_out_dir, environment, pyplot, write_results
from benchmarks.report import fmt_len, format_table
from benchmarks.tiles import fwd_tile, tile_stats
from benchmarks.timing import MODES, make_inputs, try_time

FIELDS = ("docs", "seqlen", "head_dim", "heads", "batch", "mode", "method", "status", "density", "tile_density",
          "pairs", "ms", "tflops", "ms_per_density", "ms_per_tile_density", "first_call_s", "notes")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_scaling.py",
        description="Time vs sparsity for causal-document masks of 1, 2, 4, ... equal documents: "
                    "ms, density, ms/density (about constant if time follows the unmasked tiles).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seqlen", default="32768", help="sequence length ('k' suffix = 1024)")
    p.add_argument("--docs", default="1,2,4,8,16,32,64", help="comma list of document counts")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--modes", default="auto",
                   help="comma list of fwd, bwd, fwdbwd; default: fwd,fwdbwd")
    p.add_argument("--methods", default="flashmask", help="comma list of flashmask, flex")
    p.add_argument("--tile", default=None,
                   help="forward tile BMxBN for the tile density (default: the kernel's for the head dim, e.g. 128x64)")
    p.add_argument("--out", default=None, help="folder for scaling.csv / scaling.json; default runs/scaling")
    p.add_argument("--plot", action="store_true", help="write OUT/scaling.png (ms and ms/density vs documents)")
    add_timing_args(p)
    p.add_argument("--seed", type=int, default=0)
    add_testing_args(p)
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        (args.seqlen,) = parse_int_list(args.seqlen)[:1]
        args.docs = parse_int_list(args.docs)
        args.methods = parse_choice_list(args.methods, ("flashmask", "flex"), "methods")
        args.modes = None if args.modes == "auto" else parse_choice_list(args.modes, MODES, "modes")
        if args.tile is not None:
            bm, bn = (int(x) for x in args.tile.lower().split("x"))
            args.tile = (bm, bn)
        if any(n > args.seqlen for n in args.docs):
            raise ValueError(f"more documents than tokens: {args.docs} for S={args.seqlen}")
    except ValueError as e:
        parser.error(str(e))
    resolve_timing(args)
    if args.out is None:
        args.out = default_out_dir("scaling")
    return args


def equal_docs(seqlen: int, n: int) -> list:
    """``n`` document lengths summing to ``seqlen``, as equal as possible."""
    base, extra = divmod(seqlen, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def plot(rows, path: str) -> None:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    series = sorted({(r["method"], r["mode"]) for r in rows if r["status"] == "ok"})
    for method, mode in series:
        rs = [r for r in rows if r["status"] == "ok" and r["method"] == method and r["mode"] == mode]
        x = [r["docs"] for r in rs]
        a1.plot(x, [r["ms"] for r in rs], "o-", label=f"{method} {mode}")
        a2.plot(x, [r["ms_per_density"] for r in rs], "o-", label=f"{method} {mode}: ms/density")
        a2.plot(x, [r["ms_per_tile_density"] for r in rs], "x--", label=f"{method} {mode}: ms/tile density")
    for ax, title in ((a1, "time (ms)"), (a2, "time / density (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("documents (equal lengths)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    a1.set_yscale("log")
    a2.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> list:
    import masks

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    s, d = args.seqlen, args.head_dim
    modes = args.modes
    if modes is None:
        modes = ["fwd", "fwdbwd"]
    configure_dynamo(retain_graph="bwd" in modes)
    opts = Options(flashmask_backend=args.flashmask_backend, flex_compile=not args.flex_no_compile)
    tile = args.tile or fwd_tile(d)
    meta = {"script": "bench_scaling", "args": vars(args), "modes": modes, "tile": tile,
            "env": environment(device)}
    rows = []
    tensors = make_inputs(args.batch, s, args.heads, d, dtype, device, seed=args.seed)
    base = {}  # (method, mode) -> ms/density of the first document count, for the relative column
    t_start = time.perf_counter()
    for n in args.docs:
        startend = masks.causal_document(s, [equal_docs(s, n)] * args.batch, device=device)
        pairs = total_pairs(startend, True, batch=args.batch, heads=args.heads, seqlen_q=s, seqlen_k=s)
        density = pairs / (args.batch * args.heads * s * s)
        ts = tile_stats(startend, True, s, *tile)
        problem = Problem(startend, True, args.batch, args.heads, d, s, dtype, device)
        for method in args.methods:
            prep, failed = try_prepare(method, problem, opts)
            for mode in modes:
                row = {"docs": n, "seqlen": s, "head_dim": d, "heads": args.heads, "batch": args.batch, "mode": mode,
                       "method": method, "density": density, "tile_density": ts["live_fraction"], "pairs": pairs}
                if failed is not None:
                    row.update(status=failed["status"], notes=failed["notes"])
                else:
                    res = try_time(prep, mode, tensors, pairs, d, args.warmup, args.rep, device)
                    res.pop("fatal", None)
                    row.update(res)
                    if res["status"] == "ok":
                        row["ms_per_density"] = res["ms"] / density
                        row["ms_per_tile_density"] = res["ms"] / ts["live_fraction"]
                rows.append(row)
                rel = ""
                if row["status"] == "ok":
                    b = base.setdefault((method, mode), row["ms_per_density"])
                    rel = f"  ms/density x{row['ms_per_density'] / b:.2f} of {args.docs[0]} doc(s)"
                    print(f"docs {n:3d} {method:9s} {mode:6s} density {density:.4f} tiles {ts['live_fraction']:.4f} "
                          f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s{rel}", flush=True)
                else:
                    print(f"docs {n:3d} {method:9s} {mode:6s} {row['status']}: {row.get('notes', '')}", flush=True)
                    cleanup()
            release(prep)
            prep = None
            cleanup(collect=False)
        startend = problem = None
        cleanup()
    tensors = None
    cleanup()
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)

    def num(v, f):
        return "-" if v is None else f.format(v)

    table = [[r["docs"], r["method"], r["mode"], num(r["density"], "{:.4f}"), num(r["tile_density"], "{:.4f}"),
              num(r.get("ms"), "{:.3f}") if r["status"] == "ok" else r["status"], num(r.get("tflops"), "{:.0f}"),
              num(r.get("ms_per_density"), "{:.2f}"), num(r.get("ms_per_tile_density"), "{:.2f}")] for r in rows]
    print()
    print(f"causal document, S={fmt_len(s)}, B={args.batch}, H={args.heads}, D={d}, tile {tile[0]}x{tile[1]}")
    print(format_table(["docs", "method", "mode", "density", "tile density", "ms", "TFLOP/s", "ms/density",
                               "ms/tile density"], table, align="rllrrrrrr"))
    csv_path, json_path = write_results(args.out, "scaling", rows, FIELDS, meta)
    print(f"\n-> {csv_path}, {json_path}")
    if args.plot and rows:
        try:
            path = os.path.join(args.out, "scaling.png")
            plot(rows, path)
            print(f"plot: {path}")
        except Exception as e:
            print(f"plotting failed: {format_error(e)}")
    return rows


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
