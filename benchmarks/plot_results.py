"""Draw the README's performance chart from a bench_kernels.py CSV, and with --per-family DIR one
chart per mask family (every seqlen and head dim of the CSVs, one panel per mode).

    python benchmarks/plot_results.py benchmarks/results_h100/kernels.csv docs/perf_h100.png \
        --extra-csv benchmarks/results_h100/kernels_d64.csv --per-family docs/perf_h100
"""
import argparse
import csv
import os
import sys
from collections import defaultdict

METHODS = [("flashmask", "flashmask"), ("flex", "FlexAttention"), ("sdpa_dense", "SDPA dense mask")]


def read_rows(paths):
    """bench_kernels.py rows from its CSVs, numbers parsed."""
    out = []
    for path in paths:
        with open(path) as f:
            for r in csv.DictReader(f):
                for key in ("seqlen", "head_dim"):
                    r[key] = int(r[key])
                for key in ("tflops", "density", "ms"):
                    r[key] = float(r[key]) if r[key] else None
                out.append(r)
    return out



def load(path):
    rows = defaultdict(dict)  # (family, seqlen, mode) -> method -> TFLOP/s
    for r in read_rows([path]):
        if r["status"] == "ok" and r["tflops"]:
            rows[(r["family"], r["seqlen"], r["mode"])][r["method"]] = r["tflops"]
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("png")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--extra-csv", action="append", default=[], help="more rows for the per-family charts")
    ap.add_argument("--per-family", metavar="DIR", help="also write DIR/<family>.png")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load(args.csv)
    families = sorted({f for f, s, _ in rows if s == args.seqlen}, key=lambda f: -rows[(f, args.seqlen, "fwd")].get("flashmask", 0))
    fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    width = 0.8 / len(METHODS)
    for ax, mode in zip(axes, ("fwd", "fwdbwd")):
        for i, (key, label) in enumerate(METHODS):
            vals = [rows.get((f, args.seqlen, mode), {}).get(key, 0.0) for f in families]
            ax.bar([x + i * width for x in range(len(families))], vals, width, label=label)
        ax.set_ylabel(f"{'forward' if mode == 'fwd' else 'forward+backward'}\nTFLOP/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=3, loc="upper right")
    axes[0].set_title(f"H100, bf16, B=1, H=16, D=128, S={args.seqlen // 1024}K (FLOPs on unmasked pairs)")
    axes[1].set_xticks([x + width for x in range(len(families))])
    axes[1].set_xticklabels(families, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"-> {args.png}")
    if args.per_family:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from benchmarks.bench_kernels import plot_families
        paths = plot_families(read_rows([args.csv] + args.extra_csv), args.per_family)
        print(f"-> {len(paths)} charts in {args.per_family}")


if __name__ == "__main__":
    main()
