"""Draw the README's performance charts from bench_kernels.py CSVs: one chart of every mask family
at one seqlen, a panel per (mode, head dim) with the ratio to FlexAttention over each flashmask
bar; with --per-family DIR also one chart per mask family (every seqlen and head dim of the CSVs,
one panel per mode). Rows of later CSVs replace those of earlier ones.

    python -m benchmarks.plot_results benchmarks/results/sm90_fwd_vs_flex_d128.csv docs/perf_h100_sm90.png \
        --extra-csv benchmarks/results/sm90_fwd_vs_flex_d64.csv \
        --extra-csv benchmarks/results/sm90_bwd_vs_flex_8k_32k.csv --panels fwd:128,fwd:64,bwd:128,bwd:64
    python -m benchmarks.plot_results runs/kernels.csv runs/all.png --per-family runs/families
"""
import argparse
import csv
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



def load(paths):
    rows = defaultdict(dict)  # (family, seqlen, mode, head dim) -> method -> TFLOP/s
    for r in read_rows(paths):
        if r["status"] == "ok" and r["tflops"]:
            rows[(r["family"], r["seqlen"], r["mode"], r["head_dim"])][r["method"]] = r["tflops"]
    return rows


MODE_LABELS = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward"}


def parse_panels(text):
    """'fwd:128,bwd:64' -> [("fwd", 128), ("bwd", 64)]"""
    panels = []
    for item in text.split(","):
        mode, _, dim = item.partition(":")
        if mode not in MODE_LABELS or not dim.isdigit():
            raise ValueError(f"--panels wants mode:head_dim items with mode in {sorted(MODE_LABELS)}, got {item!r}")
        panels.append((mode, int(dim)))
    return panels


def _panels_arg(text):
    try:
        return parse_panels(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's message, a ValueError's not
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("png")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--extra-csv", action="append", default=[], help="more rows for the per-family charts")
    ap.add_argument("--panels", default="fwd:128,fwdbwd:128", type=_panels_arg,
                    help="the summary chart's panels, mode:head_dim, comma-separated")
    ap.add_argument("--per-family", metavar="DIR", help="also write DIR/<family>.png")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load([args.csv] + args.extra_csv)
    mode0, dim0 = args.panels[0]
    families = sorted({k[0] for k in rows if k[1] == args.seqlen},
                      key=lambda f: -rows.get((f, args.seqlen, mode0, dim0), {}).get("flashmask", 0))
    if not families:
        ap.error(f"no timed rows at --seqlen {args.seqlen} in {[args.csv] + args.extra_csv}")
    methods = [(k, label) for k, label in METHODS if any(k in d for d in rows.values())]
    fig, axes = plt.subplots(len(args.panels), 1, figsize=(12, 2.2 + 2.4 * len(args.panels)), sharex=True,
                             squeeze=False)
    width = 0.8 / len(methods)
    for ax, (mode, dim) in zip(axes[:, 0], args.panels):
        cells = [rows.get((f, args.seqlen, mode, dim), {}) for f in families]
        for i, (key, label) in enumerate(methods):
            ax.bar([x + i * width for x in range(len(families))], [c.get(key, 0.0) for c in cells], width, label=label)
        for x, c in enumerate(cells):  # flashmask / Flex over each flashmask bar
            if c.get("flashmask") and c.get("flex"):
                ax.annotate(f"{c['flashmask'] / c['flex']:.2f}x", (x, c["flashmask"]), ha="center", va="bottom",
                            fontsize=7)
        ax.set_ylabel(f"{MODE_LABELS[mode]}, D={dim}\nTFLOP/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(ncol=len(methods), loc="upper right")
    axes[0, 0].set_title(f"H100, bf16, B=1, H=16, S={args.seqlen // 1024}K (FLOPs on unmasked pairs; "
                         "label: flashmask / FlexAttention)")
    axes[-1, 0].set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(families))])
    axes[-1, 0].set_xticklabels(families, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"-> {args.png}")
    if args.per_family:
        from benchmarks.bench_kernels import plot_families
        paths = plot_families(read_rows([args.csv] + args.extra_csv), args.per_family)
        print(f"-> {len(paths)} charts in {args.per_family}")


if __name__ == "__main__":
    main()
