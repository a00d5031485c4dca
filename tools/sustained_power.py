"""Sustained forward throughput with the GPU's SM clock and board power, per cell and method.

A quick benchmark cell (bench_kernels.py --quick) lasts well under a second, often before the
board reaches its power limit; training runs at that limit. Here each cell runs back to back for
--seconds while nvidia-smi samples clock and power, and the table gives TFLOP/s, the mean clock
and power over the window (after --skip seconds) and GFLOP per joule: under the power cap the
method that spends fewer joules per FLOP keeps the higher clock.

    python3 scripts/sustained_power.py --families full,causal --seqlens 32k,128k --head-dims 64
"""
import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402

Sample = Tuple[float, float, float]  # (unix time, SM MHz, W)


def parse_smi(lines: Sequence[str]) -> List[Sample]:
    """Rows of `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits`;
    lines that do not parse (a partial last line, "[N/A]") are left out."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((ts, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue
    return out


def window_means(samples: Sequence[Sample], t0: float, t1: float) -> Optional[Tuple[float, float]]:
    """(mean MHz, mean W) of the samples in [t0, t1], or None if there are none."""
    sel = [s for s in samples if t0 <= s[0] <= t1]
    if not sel:
        return None
    return sum(s[1] for s in sel) / len(sel), sum(s[2] for s in sel) / len(sel)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="full,causal,causal_document,sliding_window")
    p.add_argument("--seqlens", default="32k,128k")
    p.add_argument("--head-dims", default="64")
    p.add_argument("--methods", default="flashmask,flex")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seconds", type=float, default=3.0, help="back-to-back calls per cell and method")
    p.add_argument("--skip", type=float, default=0.5, help="seconds at the start of a window left out of its means")
    p.add_argument("--settle", type=float, default=1.0, help="idle seconds before each window")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.skip < 0 or args.skip >= args.seconds or args.settle < 0:
        p.error(f"need --seconds > 0 and 0 <= --skip < --seconds, --settle >= 0; got --seconds {args.seconds}, "
                f"--skip {args.skip}, --settle {args.settle}")

    import torch
    from masks.examples import example
    dev, dtype = torch.device("cuda"), torch.bfloat16
    opts = common.Options(flashmask_backend="cuda")
    common.configure_dynamo(retain_graph=False)
    cells = [(f, s, d) for d in common.parse_int_list(args.head_dims) for s in common.parse_int_list(args.seqlens)
             for f in args.families.split(",")]
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=log)
    windows = []
    try:
        for ci, (fam, s, d) in enumerate(cells):
            startend, causal = example(fam, s, batch_size=1, device=dev)
            pairs = common.total_pairs(startend, causal, batch=1, heads=args.heads, seqlen_q=s, seqlen_k=s)
            tensors = common.make_inputs(1, s, args.heads, d, dtype, dev, seed=ci)
            problem = common.Problem(startend, causal, 1, args.heads, d, s, dtype, dev, None)
            for method in args.methods.split(","):
                prep = common.prepare_method(method, problem, opts)
                step = common.make_step(prep.attn, "fwd", *tensors)
                step()
                common.sync(dev)
                time.sleep(args.settle)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                calls, t0 = 0, time.time()
                start.record()
                while time.time() - t0 < args.seconds:
                    step()
                    calls += 1
                    if calls % 4 == 0:  # keep the queue short, so that the window ends when the clock says
                        common.sync(dev)
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end) / calls
                tflops = common.attn_flops(pairs, d, "fwd") / (ms * 1e-3) / 1e12
                windows.append((fam, s, d, method, t0 + args.skip, time.time(), tflops))
                print(f"{fam} S={common.fmt_len(s)} D={d} {method}: {tflops:.0f} TFLOP/s over {calls} calls", flush=True)
                del prep, step
                common.cleanup()
    finally:
        smi.terminate()
        smi.wait()
    log.seek(0)
    samples = parse_smi(log.readlines())
    rows = []
    for fam, s, d, method, t0, t1, tflops in windows:
        means = window_means(samples, t0, t1)
        mhz, watts = means if means else (None, None)
        rows.append([fam, common.fmt_len(s), d, method, f"{tflops:.0f}", f"{mhz:.0f}" if mhz else "-",
                     f"{watts:.0f}" if watts else "-", f"{tflops * 1e3 / watts:.0f}" if watts else "-"])
    print()
    print(common.format_table(["family", "S", "D", "method", "TFLOP/s", "SM MHz", "W", "GFLOP/J"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
