"""Throughput of flashmask vs FlexAttention vs SDPA over the twelve mask families.

For every (family, seqlen, head dim) the mask is ``masks.examples.example(family, seqlen)``; every
method gets exactly that mask (FlexAttention through a mask_mod read from the same
``startend_row_indices``; SDPA through the dense bool mask, or ``is_causal`` for the flash and cuDNN
backends when the mask is plain causal or full). FLOPs are counted on unmasked pairs only
(fwd = 2*B*H*(Dqk + Dv)*pairs, i.e. 4*B*H*D*pairs with equal head dims; bwd = 2.5x), so TFLOP/s of
different methods on one row compare their times directly.

``--head-dim-v`` gives v a head dim of its own (MLA, DeepSeek-V2/V3: ``--head-dims 192 --head-dim-v
128``): every method gets the same q, k ``[.., Dqk]`` and v ``[.., Dv]``; flash and cuDNN SDPA get
``n/a`` rows where they refuse the pair, and the D column reads ``Dqk/Dv``.

``--methods ...,flashmask_det`` adds flashmask with ``deterministic=True`` (bitwise reproducible
gradients): backward rows only (its forward is the default one), next to ``flashmask`` so that the
cost of deterministic mode can be read off the table (``det ms``, ``det cost``).

``--methods ...,flashmask_plain`` adds flashmask called with no mask tensor (``startend_row_indices=None``,
``causal=...``) on the plain causal and full families, as SDPA's flash and cuDNN backends get
``is_causal``: the kernels built for no mask, which plain causal attention runs.

``--softcap X`` (logit soft-capping, Gemma 2) and ``--sinks`` (random float32 attention sinks
``[H]``, a leaf requiring grad whose gradient the backward modes compute, GPT-OSS) give every method
the same option where it can express it: flashmask its ``softcap`` / ``sinks``; FlexAttention a
``score_mod`` returning ``softcap * tanh(s / softcap)`` (it gets ``s`` already multiplied by the
scale, as flashmask caps the scaled score) and, for sinks, its output times ``sigmoid(lse - sink)``
(exact: ``exp(lse) / (exp(lse) + exp(sink))`` is the share of the row's denominator that its keys
hold), compiled with it. SDPA can express neither: ``n/a`` rows with that reason. The FLOPs stay
those of the two GEMMs.

``--gpu-clocks`` samples the GPU's SM clock and board power while each cell is timed (columns
``sm_mhz`` and ``power_w``, :mod:`benchmarks.gpu_clocks`): at the power cap two kernels may run at
different clocks. Time such runs for seconds a cell (``--rep 4000``): short cells start below the
cap.

Example::

    python -m benchmarks.bench_kernels                      # 12 families x 8K, 32K x fwd, fwd+bwd
    python -m benchmarks.bench_kernels --families causal,document --seqlens 8k,32k,128k --plot
    python -m benchmarks.bench_kernels --modes fwd,bwd,fwdbwd --methods flashmask,flex --quick
    python -m benchmarks.bench_kernels --methods flashmask,flashmask_det --modes bwd,fwdbwd
    python -m benchmarks.bench_kernels --heads 16 --kv-heads 4 --modes bwd   # GQA, 4 query heads a group
    python -m benchmarks.bench_kernels --head-dims 192 --head-dim-v 128      # DeepSeek-V3's MLA head dims
    python -m benchmarks.bench_kernels --head-dims 256 --softcap 50 --methods flashmask,flex   # Gemma 2
    python -m benchmarks.bench_kernels --head-dims 64 --sinks --methods flashmask,flex         # GPT-OSS
    python -m benchmarks.bench_kernels --head-dims 256 --families causal,full --modes fwd \
        --methods flashmask_plain,sdpa_cudnn --rep 4000 --gpu-clocks     # at the power cap, clocks sampled
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import OrderedDict

import torch

from benchmarks.cli import (
    DTYPES,
    add_baseline_mask_args,
    add_testing_args,
    add_timing_args,
    parse_choice_list,
    parse_int_list,
    resolve_timing,
)
from benchmarks.cuda_memory import cleanup
from benchmarks.errors import format_error, is_fatal_cuda_error, status_of
from benchmarks.flex import configure_dynamo
from benchmarks.flops import total_pairs
from benchmarks.gpu_clocks import check_available as check_clocks
from benchmarks.methods import ALL_METHODS, METHODS, Options, Problem, method_modes, release, try_prepare
from benchmarks.output import default_out_dir, environment, pyplot, write_results
from benchmarks.report import fmt_len, format_table, table_cell
from benchmarks.timing import MODES, make_inputs, make_sinks, try_time

DEFAULT_METHODS = ",".join(METHODS)
MODE_LABEL = {"fwd": "fwd", "bwd": "bwd", "fwdbwd": "fwd+bwd"}
FIELDS = ("family", "seqlen", "head_dim", "head_dim_v", "heads", "kv_heads", "batch", "softcap", "sinks", "mode",
          "method", "status", "density", "pairs", "ms", "tflops", "mask_build_ms", "first_call_s", "host_ms", "sm_mhz",
          "power_w", "notes")
# The summary's clock columns (--gpu-clocks), in this order, under these names.
CLOCK_COLUMNS = {"flashmask": "fm", "flashmask_plain": "plain", "flex": "flex", "sdpa_cudnn": "cudnn"}
FLOP_CONVENTION = ("fwd=2*B*H*(Dqk+Dv)*pairs (4*B*H*D*pairs with equal head dims), bwd=2.5x, fwd+bwd=3.5x; "
                   "softcap and sinks add none")


def build_parser() -> argparse.ArgumentParser:
    import masks
    p = argparse.ArgumentParser(
        prog="bench_kernels.py",
        description="Time flashmask against FlexAttention and SDPA on every mask family "
                    "(TFLOP/s counted on unmasked pairs: fwd = 2*B*H*(Dqk + Dv)*pairs, bwd = 2.5x, "
                    "fwd+bwd = 3.5x).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--families", default="all", help=f"comma list or 'all': {', '.join(masks.FAMILIES)}")
    p.add_argument("--seqlens", default="8192,32768", help="comma list; 'k' suffix = 1024 (e.g. 8k,32k,128k)")
    p.add_argument("--head-dims", default="128", help="comma list of head dims (of q and k)")
    p.add_argument("--head-dim-v", type=int, default=None,
                   help="v's head dim for every --head-dims entry (MLA: --head-dims 192 --head-dim-v 128); "
                        "default: equal to the q/k head dim")
    p.add_argument("--heads", type=int, default=16, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads, a divisor of --heads (GQA: flashmask sums dK and dV over each group; "
                        "Flex and SDPA take enable_gqa); default: as many as --heads")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--softcap", type=float, default=0.0,
                   help="logit soft-capping (Gemma 2: 50): each scaled score s becomes softcap * tanh(s / softcap); "
                        "0 = off. flashmask's softcap, a score_mod for FlexAttention; SDPA cannot (n/a rows)")
    p.add_argument("--sinks", action="store_true",
                   help="attention sinks (GPT-OSS): random float32 [heads], learnable (their gradient is in the bwd "
                        "modes). flashmask's sinks; FlexAttention's output renormalised by its LSE; SDPA cannot "
                        "(n/a rows)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--modes", default="fwd,fwdbwd", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma list of {', '.join(ALL_METHODS)} ('all' = every one); flashmask_det = flashmask "
                        "with deterministic=True, bwd and fwd+bwd rows only; flashmask_plain = flashmask with no "
                        "mask tensor, causal and full families only")
    p.add_argument("--out", default=None,
                   help="folder for kernels.csv / kernels.json (and plots/); default runs/kernels")
    p.add_argument("--plot", action="store_true", help="one PNG per family under OUT/plots (TFLOP/s per method)")
    add_timing_args(p)
    p.add_argument("--gpu-clocks", action="store_true",
                   help="sample the GPU's SM clock and power (nvidia-smi) while each cell is timed: columns sm_mhz "
                        "and power_w. At the power cap the clock depends on the kernel; time cells long enough to "
                        "reach it (e.g. --rep 4000)")
    add_baseline_mask_args(p)
    p.add_argument("--seed", type=int, default=0)
    add_testing_args(p)
    return p


def parse_args(argv=None):
    import masks
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.families = parse_choice_list(args.families, list(masks.FAMILIES), "families")
        args.seqlens = parse_int_list(args.seqlens)
        args.head_dims = parse_int_list(args.head_dims)
        args.modes = parse_choice_list(args.modes, MODES, "modes")
        args.methods = parse_choice_list(args.methods, ALL_METHODS, "methods")
    except ValueError as e:
        parser.error(str(e))
    if not (math.isfinite(args.softcap) and args.softcap >= 0):
        parser.error(f"--softcap must be a finite float >= 0 (0 = off), got {args.softcap}")
    if args.head_dim_v is not None and args.head_dim_v < 1:
        parser.error(f"--head-dim-v must be a positive int, got {args.head_dim_v}")
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.kv_heads < 1 or args.heads % args.kv_heads:
        parser.error(f"--kv-heads must divide --heads ({args.heads}), got {args.kv_heads}")
    resolve_timing(args)
    if args.gpu_clocks:
        why = "--device is not a CUDA device" if not args.device.startswith("cuda") else check_clocks()
        if why:
            parser.error(f"--gpu-clocks cannot sample here: {why}")
    if args.out is None:
        args.out = default_out_dir("kernels")
    return args


_cell = table_cell


def _tf(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def summary_table(rows) -> str:
    """One line per (family, seqlen, head dim, mode): flashmask vs flex vs SDPA (and, when measured,
    deterministic flashmask: its ms and its time relative to the default flashmask; flashmask with
    no mask tensor: its TFLOP/s and its speed relative to cuDNN's, which also runs without one)."""
    groups = OrderedDict()
    for r in rows:
        d = r["head_dim"] if r.get("head_dim_v") in (None, r["head_dim"]) else f"{r['head_dim']}/{r['head_dim_v']}"
        groups.setdefault((r["family"], r["seqlen"], d, r["mode"]), {})[r["method"]] = r
    with_det = any(r["method"] == "flashmask_det" for r in rows)
    with_plain = any(r["method"] == "flashmask_plain" for r in rows)
    with_clocks = any(r.get("sm_mhz") is not None for r in rows)
    clock_methods = [m for m in CLOCK_COLUMNS if any(r["method"] == m for r in rows)]
    table = []
    for (fam, s, d, mode), by in groups.items():
        fm, fx, dn = by.get("flashmask"), by.get("flex"), by.get("sdpa_dense")
        fa, cu = by.get("sdpa_flash"), by.get("sdpa_cudnn")
        density = next((r["density"] for r in by.values() if r.get("density") is not None), None)
        fa_cu = "-" if fa is None and cu is None else f"{_cell(fa, 'tflops', _tf)}/{_cell(cu, 'tflops', _tf)}"
        line = [fam, fmt_len(s), d, MODE_LABEL[mode], "-" if density is None else f"{density:.3f}",
                _cell(fm), _cell(fm, "tflops", _tf), _cell(fx), _cell(fx, "tflops", _tf),
                _cell(dn, "tflops", _tf), fa_cu, _ratio(fx, fm)]
        if with_det:
            det = by.get("flashmask_det")
            line += [_cell(det), _ratio(det, fm)]
        if with_plain:
            plain = by.get("flashmask_plain")
            line += [_cell(plain, "tflops", _tf), _ratio(cu, plain)]
        if with_clocks:
            line += [_mhz(by.get(m)) for m in clock_methods]
        table.append(line)
    headers = ["family", "S", "D", "mode", "density", "fm ms", "fm TF/s", "flex ms", "flex TF/s", "dense TF/s",
               "fa2/cudnn TF/s", "vs flex"]
    if with_det:
        headers += ["det ms", "det cost"]
    if with_plain:
        headers += ["plain TF/s", "plain vs cudnn"]
    if with_clocks:
        headers += [f"{CLOCK_COLUMNS[m]} MHz" for m in clock_methods]
    return format_table(headers, table, align="lrrl" + "r" * (len(headers) - 4))


def _mhz(r) -> str:
    return "-" if r is None or r.get("sm_mhz") is None else f"{r['sm_mhz']:.0f}"


def _ratio(num, den) -> str:
    """``num ms / den ms`` as ``1.23x`` when both rows have a time, else ``-``."""
    if num and den and num["status"] == "ok" and den["status"] == "ok" and num.get("ms") and den.get("ms"):
        return f"{num['ms'] / den['ms']:.2f}x"
    return "-"


def plot_families(rows, out_dir: str):
    """``out_dir/<family>.png``: TFLOP/s per method, grouped by seqlen (one panel per mode, stacked)."""
    plt = pyplot()
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    families = list(OrderedDict.fromkeys(r["family"] for r in rows))
    for fam in families:
        fr = [r for r in rows if r["family"] == fam]
        modes = list(OrderedDict.fromkeys(r["mode"] for r in fr))
        methods = list(OrderedDict.fromkeys(r["method"] for r in fr))
        configs = list(OrderedDict.fromkeys((r["seqlen"], r["head_dim"]) for r in fr))
        multi_d = len({d for _, d in configs}) > 1
        fig, axes = plt.subplots(len(modes), 1,
                                 figsize=(max(6.0, 0.45 * len(configs) * len(methods)), 3.2 * len(modes)),
                                 squeeze=False)
        width = 0.8 / max(1, len(methods))
        for ax, mode in zip(axes[:, 0], modes):
            for i, m in enumerate(methods):
                xs, ys = [], []
                for x, (s, d) in enumerate(configs):
                    r = next((r for r in fr if r["mode"] == mode and r["method"] == m and r["seqlen"] == s
                              and r["head_dim"] == d), None)
                    if r is not None and r["status"] == "ok" and r.get("tflops") is not None:
                        xs.append(x + (i - (len(methods) - 1) / 2) * width)
                        ys.append(r["tflops"])
                if xs:
                    color = f"C{ALL_METHODS.index(m)}" if m in ALL_METHODS else None  # one colour per method
                    ax.bar(xs, ys, width=width, label=m, color=color)
            labels = []
            for s, d in configs:
                dens = next((r["density"] for r in fr if r["seqlen"] == s and r.get("density") is not None), None)
                lab = f"S={fmt_len(s)}" + (f" D={d}" if multi_d else "")
                labels.append(lab + ("" if dens is None else f"\ndensity {dens:.3f}"))
            ax.set_xticks(range(len(configs)))
            ax.set_xticklabels(labels)
            ax.set_ylabel("TFLOP/s (unmasked pairs)")
            ax.set_title(f"{fam}: {MODE_LABEL[mode]}")
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{fam}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _row(fam, s, d, args, mode, method, density, pairs, status, ms=None, tflops=None, build_ms=None, first=None,
         host=None, sm_mhz=None, power_w=None, notes=""):
    dv = d if args.head_dim_v is None else args.head_dim_v
    return {"family": fam, "seqlen": s, "head_dim": d, "head_dim_v": dv, "heads": args.heads, "kv_heads": args.kv_heads,
            "batch": args.batch, "softcap": args.softcap, "sinks": args.sinks, "mode": mode,
            "method": method, "status": status, "density": density, "pairs": pairs, "ms": ms, "tflops": tflops,
            "mask_build_ms": build_ms, "first_call_s": first, "host_ms": host, "sm_mhz": sm_mhz, "power_w": power_w,
            "notes": notes}


def options_label(args, prefix: str = "") -> str:
    """``softcap 50, sinks`` (after ``prefix``) for a run with those options, else ""."""
    opts = ([f"softcap {args.softcap:g}"] if args.softcap else []) + (["sinks"] if args.sinks else [])
    return prefix + ", ".join(opts) if opts else ""


def _progress(i, total, r):
    d = r["head_dim"] if r.get("head_dim_v") in (None, r["head_dim"]) else f"{r['head_dim']}/{r['head_dim_v']}"
    what = (f"{r['family']} S={fmt_len(r['seqlen'])} D={d} {MODE_LABEL[r['mode']]:7s} "
            f"{r['method']:13s}")
    if r["status"] == "ok":
        res = f"{r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s  first call {r['first_call_s']:.2f} s"
        if r.get("sm_mhz") is not None:
            res += f"  {r['sm_mhz']:.0f} MHz {r['power_w']:.0f} W"
    else:
        res = f"{r['status']}"
    notes = f"  [{r['notes']}]" if r.get("notes") else ""
    # The wall clock lets a slow cell be matched with a clock or power log taken alongside (nvidia-smi -lms).
    print(f"[{i:4d}/{total}] {time.strftime('%H:%M:%S')} {what} {res}{notes}", flush=True)


def run(args) -> list:
    from masks.examples import example

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    configure_dynamo(retain_graph="bwd" in args.modes)
    opts = Options(flashmask_backend=args.flashmask_backend, flex_compile=not args.flex_no_compile,
                          flex_block_mask=args.flex_block_mask, dense_mem_fraction=args.dense_mem_fraction)
    meta = {"script": "bench_kernels", "args": {k: v for k, v in vars(args).items()},
            "env": environment(device), "flop_convention": FLOP_CONVENTION}
    env = meta["env"]
    print(f"device {env.get('gpu', device)} | torch {env['torch']} | triton {env['triton']} | flashmask kernels "
          f"{env.get('flashmask_kernels')}" + options_label(args, " | "), flush=True)

    rows: list = []
    configs = [(f, s, d) for f in args.families for s in args.seqlens for d in args.head_dims]
    total = len(configs) * sum(len(method_modes(m, args.modes)) for m in args.methods)
    done = 0
    fatal = None
    t_start = time.perf_counter()

    def add(row):
        nonlocal done
        done += 1
        rows.append(row)
        _progress(done, total, row)

    for ci, (fam, s, d) in enumerate(configs):
        if fatal:
            break
        tensors = startend = None
        try:
            startend, causal = example(fam, s, batch_size=args.batch, device=device)
            pairs = total_pairs(startend, causal, batch=args.batch, heads=args.heads, seqlen_q=s, seqlen_k=s)
            density = pairs / (args.batch * args.heads * s * s)
            tensors = make_inputs(args.batch, s, args.heads, d, dtype, device, seed=args.seed + ci,
                                  kv_heads=args.kv_heads, head_dim_v=args.head_dim_v)
            sinks = make_sinks(args.heads, device, seed=args.seed + ci) if args.sinks else None
            setup_error = None
        except Exception as e:
            setup_error = {"status": status_of(e), "notes": f"setup: {format_error(e)}",
                           "fatal": is_fatal_cuda_error(e)}
        if setup_error is not None:
            startend = tensors = sinks = None
            cleanup()
            for method in args.methods:
                for mode in method_modes(method, args.modes):
                    add(_row(fam, s, d, args, mode, method, None, None, setup_error["status"],
                             notes=setup_error["notes"]))
            fatal = setup_error["notes"] if setup_error["fatal"] else None
            continue
        dv_note = "" if args.head_dim_v in (None, d) else f" Dv={args.head_dim_v}"
        print(f"== {fam} S={fmt_len(s)} D={d}{dv_note}: causal={causal} C={startend.shape[-1]} density "
              f"{density:.4f}", flush=True)
        problem = Problem(startend, causal, args.batch, args.heads, d, s, dtype, device, args.kv_heads,
                          head_dim_v=args.head_dim_v, softcap=args.softcap, sinks=sinks)
        for method in args.methods:
            if fatal:
                break
            modes = method_modes(method, args.modes)  # flashmask_det: no fwd rows
            if not modes:
                continue
            prep, failed = try_prepare(method, problem, opts)
            if failed is not None:
                if failed["status"] == "skip":  # e.g. flash/cuDNN SDPA with a mask they cannot take
                    total -= len(modes)
                    continue
                cleanup()
                for mode in modes:
                    add(_row(fam, s, d, args, mode, method, density, pairs, failed["status"], notes=failed["notes"]))
                fatal = failed["notes"] if failed["fatal"] else None
                continue
            for mode in modes:
                if fatal:
                    break
                res = try_time(prep, mode, tensors, pairs, d, args.warmup, args.rep, device, args.head_dim_v,
                               clocks=args.gpu_clocks)
                add(_row(fam, s, d, args, mode, method, density, pairs, res["status"], ms=res.get("ms"),
                         tflops=res.get("tflops"), build_ms=prep.build_ms, first=res.get("first_call_s"),
                         host=res.get("host_ms"), sm_mhz=res.get("sm_mhz"), power_w=res.get("power_w"),
                         notes=res["notes"]))
                fatal = res["notes"] if res["fatal"] else None
                if res["status"] != "ok":
                    cleanup()
            release(prep)
            prep = None
            cleanup(collect=False)
        problem = tensors = startend = sinks = None
        cleanup()
        write_results(args.out, "kernels", rows, FIELDS, meta)  # partial results survive a crash
    if fatal:
        print(f"\nstopped early: the CUDA context is unusable after: {fatal}", flush=True)
        meta["stopped_early"] = fatal
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    csv_path, json_path = write_results(args.out, "kernels", rows, FIELDS, meta)
    print()
    if options_label(args):
        print(options_label(args, "every row: "))
    print(summary_table(rows))
    print(f"\n{len(rows)} rows in {meta['elapsed_s']:.0f} s -> {csv_path}, {json_path}")
    if args.plot and rows:
        try:
            paths = plot_families(rows, os.path.join(args.out, "plots"))
            print(f"plots: {os.path.join(args.out, 'plots')} ({len(paths)} PNG)")
        except Exception as e:
            print(f"plotting failed: {format_error(e)}")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
