"""GPU memory: the mask representations, and one attention call per method, at 32K and 128K.

Mask representation (per family and length):

* flashmask: ``startend_row_indices`` (``B*Hm*S*C`` int32) plus the per-key-block bounds the
  kernel derives per call (8 int32 per block of ``Bc`` keys: O(S / Bc));
* FlexAttention: the ``BlockMask`` tensors (O((S/128)^2) index tables), and the peak memory of
  building it (eager ``create_block_mask`` materialises the S x S mask; beyond half the free memory
  it is built through ``torch.compile`` instead);
* SDPA: the dense bool mask (S^2 bytes; SDPA also makes an S^2 additive mask in the input dtype on
  every call), skipped where it does not fit.

Attention call: peak memory above what was allocated before the call (q, k, v, dout and the
method's mask are already there), for the forward alone and for forward + backward, measured on a
second call (the first one compiles, makes plans and workspaces) with
``torch.cuda.reset_peak_memory_stats`` / ``max_memory_allocated``.

Example::

    python -m benchmarks.bench_memory
    python -m benchmarks.bench_memory --families causal_document,document --seqlens 32k,128k,256k
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

import torch

from benchmarks.cli import DTYPES, add_baseline_mask_args, add_testing_args, parse_choice_list, parse_int_list
from benchmarks.cuda_memory import cleanup, peak_since, reset_peak
from benchmarks.dense_masks import dense_mask_bytes
from benchmarks.errors import format_error, is_fatal_cuda_error, status_of
from benchmarks.flex import block_mask_bytes_estimate, configure_dynamo
from benchmarks.flops import total_pairs
from benchmarks.methods import METHODS, Options, Problem, release, try_prepare
from benchmarks.output import default_out_dir, environment, write_results
from benchmarks.report import fmt_bytes, fmt_len, format_table
from benchmarks.tiles import bounds_bytes, bwd_tile, fwd_tile
from benchmarks.timing import make_inputs, make_step

FIELDS = ("family", "seqlen", "head_dim", "heads", "batch", "method", "status", "density", "mask_bytes",
          "build_peak_bytes", "fwd_peak_bytes", "fwdbwd_peak_bytes", "startend_bytes", "bounds_bytes",
          "bwd_bounds_bytes", "flex_block_mask_bytes_est", "dense_mask_bytes", "notes")
MEASURED = ("fwd", "fwdbwd")


def build_parser() -> argparse.ArgumentParser:
    import masks
    p = argparse.ArgumentParser(
        prog="bench_memory.py",
        description="Peak GPU memory of the mask representations (startend + block bounds vs FlexAttention "
                    "BlockMask vs dense S^2 mask) and of one attention forward / forward+backward per method.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--families", default="all", help=f"comma list or 'all': {', '.join(masks.FAMILIES)}")
    p.add_argument("--seqlens", default="32768,131072", help="comma list; 'k' suffix = 1024")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--methods", default=",".join(METHODS), help="comma list of methods")
    p.add_argument("--out", default=None, help="folder for memory.csv / memory.json; default runs/memory")
    add_baseline_mask_args(p)
    p.add_argument("--seed", type=int, default=0)
    add_testing_args(p, "torch device; on a CPU only the flow runs (no memory numbers)")
    return p


def parse_args(argv=None):
    import masks
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.families = parse_choice_list(args.families, list(masks.FAMILIES), "families")
        args.seqlens = parse_int_list(args.seqlens)
        args.methods = parse_choice_list(args.methods, METHODS, "methods")
    except ValueError as e:
        parser.error(str(e))
    if args.out is None:
        args.out = default_out_dir("memory")
    return args


def call_peak(prep, mode: str, tensors, device) -> Optional[int]:
    """Peak bytes above the allocated memory before the call, on the second call of ``mode``."""
    q, k, v, dout = tensors
    step = make_step(prep.attn, mode, q, k, v, dout)
    r = step()  # compiles, plans, workspaces
    del r
    base = reset_peak(device)
    r = step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak = peak_since(device, base)
    del r, step
    return peak


def run(args) -> list:
    from masks.examples import example

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_memory.py measures CUDA memory: no CUDA device is available")
    if device.type != "cuda":
        print(f"note: memory statistics need CUDA; on {device} only the flow runs", flush=True)
    dtype = DTYPES[args.dtype]
    d = args.head_dim
    configure_dynamo()
    opts = Options(flashmask_backend=args.flashmask_backend, flex_compile=not args.flex_no_compile,
                          flex_block_mask=args.flex_block_mask, dense_mem_fraction=args.dense_mem_fraction)
    meta = {"script": "bench_memory", "args": vars(args), "env": environment(device)}
    env = meta["env"]
    print(f"device {env.get('gpu', device)} | torch {env['torch']} | flashmask kernels "
          f"{env.get('flashmask_kernels')}", flush=True)
    rows, rep_rows = [], []
    fatal = None
    t_start = time.perf_counter()
    for s in args.seqlens:
        if fatal:
            break
        try:
            tensors = make_inputs(args.batch, s, args.heads, d, dtype, device, seed=args.seed)
        except Exception as e:
            print(f"S={fmt_len(s)}: cannot allocate the inputs: {format_error(e)}", flush=True)
            tensors = None
            cleanup()
            continue
        for fam in args.families:
            if fatal:
                break
            try:
                startend, causal = example(fam, s, batch_size=args.batch, device=device)
                pairs = total_pairs(startend, causal, batch=args.batch, heads=args.heads, seqlen_q=s, seqlen_k=s)
            except Exception as e:
                print(f"{fam} S={fmt_len(s)}: mask setup failed: {format_error(e)}", flush=True)
                startend = None
                cleanup()
                continue
            density = pairs / (args.batch * args.heads * s * s)
            bm_heads = args.heads if startend.shape[1] > 1 else 1
            rep = {"family": fam, "seqlen": s, "density": density,
                   "startend_bytes": startend.numel() * startend.element_size(),
                   "bounds_bytes": bounds_bytes(startend, fwd_tile(d)[1]),
                   "bwd_bounds_bytes": bounds_bytes(startend, bwd_tile(d)[1]),
                   "flex_block_mask_bytes_est": block_mask_bytes_estimate(startend.shape[0], bm_heads, s, s),
                   "dense_mask_bytes": dense_mask_bytes(startend.shape[0], startend.shape[1], s, s)}
            rep_rows.append(rep)
            problem = Problem(startend, causal, args.batch, args.heads, d, s, dtype, device)
            for method in args.methods:
                if fatal:
                    break
                row = {"family": fam, "seqlen": s, "head_dim": d, "heads": args.heads, "batch": args.batch,
                       "method": method, "density": density, **{k: rep[k] for k in FIELDS if k in rep}}
                notes = []
                base = reset_peak(device)
                prep, failed = try_prepare(method, problem, opts)
                if failed is not None:
                    if failed["status"] == "skip":
                        continue
                    row.update(status=failed["status"], notes=failed["notes"])
                    fatal = failed["notes"] if failed["fatal"] else None
                    cleanup()
                else:
                    row["build_peak_bytes"] = peak_since(device, base)
                    row["mask_bytes"] = prep.mask_bytes
                    notes.extend(n for n in prep.notes if n)
                    status = "ok"
                    for mode in MEASURED:
                        try:
                            row[f"{mode}_peak_bytes"] = call_peak(prep, mode, tensors, device)
                        except Exception as e:
                            status = status if status != "ok" else status_of(e)
                            notes.append(f"{mode}: {format_error(e)}")
                            if is_fatal_cuda_error(e):
                                fatal = format_error(e)
                            del e
                            cleanup()
                    row.update(status=status, notes="; ".join(notes))
                rows.append(row)
                print(f"{fam} S={fmt_len(s)} {method:10s} {row['status']:5s} mask {fmt_bytes(row.get('mask_bytes'))}"
                      f" | build peak {fmt_bytes(row.get('build_peak_bytes'))}"
                      f" | fwd peak {fmt_bytes(row.get('fwd_peak_bytes'))}"
                      f" | fwd+bwd peak {fmt_bytes(row.get('fwdbwd_peak_bytes'))}"
                      + (f"  [{row['notes']}]" if row.get("notes") else ""), flush=True)
                release(prep)
                prep = None
                cleanup(collect=False)
            startend = problem = None
            cleanup()
            write_results(args.out, "memory", rows, FIELDS, meta)
        tensors = None
        cleanup()
    if fatal:
        print(f"\nstopped early: the CUDA context is unusable after: {fatal}", flush=True)
        meta["stopped_early"] = fatal
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    meta["representations"] = rep_rows
    fb = fmt_bytes
    print("\nMask representation (bytes kept for the calls; dense = S^2 bool, before SDPA's per-call additive copy)")
    flex_built = {(r["family"], r["seqlen"]): r["mask_bytes"] for r in rows
                  if r["method"] == "flex" and r.get("mask_bytes") is not None}
    print(format_table(
        ["family", "S", "density", "startend", f"+ fwd bounds (Bc={fwd_tile(d)[1]})",
         f"+ bwd bounds (Bc={bwd_tile(d)[1]})", "flex BlockMask", "dense bool"],
        [[r["family"], fmt_len(r["seqlen"]), f"{r['density']:.3f}", fb(r["startend_bytes"]), fb(r["bounds_bytes"]),
          fb(r["bwd_bounds_bytes"]),
          fb(flex_built.get((r["family"], r["seqlen"]))) if flex_built.get((r["family"], r["seqlen"])) is not None
          else "~" + fb(r["flex_block_mask_bytes_est"]), fb(r["dense_mask_bytes"])] for r in rep_rows],
        align="lrrrrrrr"))
    print("\nOne call: peak memory above inputs + mask (second call; 'build peak' = building the mask representation)")
    print(format_table(
        ["family", "S", "method", "status", "mask", "build peak", "fwd peak", "fwd+bwd peak", "notes"],
        [[r["family"], fmt_len(r["seqlen"]), r["method"], r["status"], fb(r.get("mask_bytes")),
          fb(r.get("build_peak_bytes")), fb(r.get("fwd_peak_bytes")), fb(r.get("fwdbwd_peak_bytes")),
          (r.get("notes") or "")[:90]] for r in rows],
        align="lrllrrrrl"))
    csv_path, json_path = write_results(args.out, "memory", rows, FIELDS, meta)
    print(f"\n{len(rows)} rows in {meta['elapsed_s']:.0f} s -> {csv_path}, {json_path}")
    return rows


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
