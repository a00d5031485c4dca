"""Is a slow benchmark cell the GPU's doing or the host's? Times every mask family several times
three ways: triton's do_bench median (as bench_kernels.py --quick), the GPU time per call of 30
calls issued back to back, and the host time per call of those 30 launches. A kernel shorter than
its launch path waits for the host: when the host slows down for a while, do_bench and the
back-to-back time rise together with the host time, and the kernel itself is not at fault.

    python3 scripts/host_jitter.py --seqlen 8192 --head-dim 64 --passes 10
"""
import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common  # noqa: E402

Reading = Tuple[float, float, float]  # (do_bench ms, back-to-back ms per call, host ms per call)


def slow_readings(readings: Dict[str, List[Reading]], factor: float = 1.25) -> List[str]:
    """One line per reading whose do_bench or back-to-back time exceeds `factor` times its family's
    median, with the host time next to it."""
    lines = []
    for fam, rs in readings.items():
        med_bench = statistics.median(r[0] for r in rs)
        med_b2b = statistics.median(r[1] for r in rs)
        for i, (bench, b2b, host) in enumerate(rs):
            if bench > factor * med_bench or b2b > factor * med_b2b:
                lines.append(f"{fam} pass {i}: do_bench {bench:.3f} ms (median {med_bench:.3f}), back to back "
                             f"{b2b:.3f} (median {med_b2b:.3f}), host {host:.3f} ms per call")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--passes", type=int, default=6)
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args(argv)
    for name in ("passes", "calls"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")

    import torch
    import masks
    from masks.examples import example
    dev, dtype, s, d = torch.device("cuda"), torch.bfloat16, args.seqlen, args.head_dim
    opts = common.Options(flashmask_backend="cuda")
    readings: Dict[str, List[Reading]] = {}
    print("pass time family do_bench_ms back_to_back_ms host_ms", flush=True)
    for i in range(args.passes):
        for ci, fam in enumerate(masks.FAMILIES):
            startend, causal = example(fam, s, batch_size=1, device=dev)
            tensors = common.make_inputs(1, s, args.heads, d, dtype, dev, seed=ci)
            prep = common.prepare_method("flashmask", common.Problem(startend, causal, 1, args.heads, d, s, dtype, dev,
                                                                     None), opts)
            step = common.make_step(prep.attn, "fwd", *tensors)
            step()
            common.sync(dev)
            bench = common.time_ms(step, 10, 30, dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            h0 = time.perf_counter()
            for _ in range(args.calls):
                step()
            host = (time.perf_counter() - h0) / args.calls * 1e3
            end.record()
            end.synchronize()
            b2b = start.elapsed_time(end) / args.calls
            readings.setdefault(fam, []).append((bench, b2b, host))
            print(f"{i} {time.strftime('%H:%M:%S')} {fam} {bench:.4f} {b2b:.4f} {host:.4f}", flush=True)
            del prep, step
            common.cleanup()
    print("\nslow readings (over 1.25x their family's median):")
    print("\n".join(slow_readings(readings)) or "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
