"""Compare two benchmarks.bench_kernels CSVs method by method: new / old TFLOP/s per (family, seqlen,
head dim, mode).

    python -m tools.compare_kernels OLD/kernels.csv NEW/kernels.csv [--method flashmask]

Prints one row per case present in both and the median ratio; a quick check that a refactor kept
the kernels' speed (quick runs drift a few percent between runs).
"""
import argparse
import csv
import statistics


def read(path, method):
    rows = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["method"] == method and r["status"] == "ok":
                rows[(r["family"], int(r["seqlen"]), int(r["head_dim"]), r["mode"])] = float(r["tflops"])
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--method", default="flashmask")
    args = ap.parse_args(argv)
    old, new = read(args.old, args.method), read(args.new, args.method)
    common = sorted(set(old) & set(new))
    if not common:
        raise SystemExit(f"no {args.method} case is in both files")
    print(f"{'family':24s} {'seqlen':>7s} {'D':>4s} {'mode':7s} {'old':>7s} {'new':>7s} {'new/old':>8s}")
    ratios = []
    for key in common:
        ratio = new[key] / old[key]
        ratios.append(ratio)
        fam, s, d, mode = key
        print(f"{fam:24s} {s:7d} {d:4d} {mode:7s} {old[key]:7.1f} {new[key]:7.1f} {ratio:8.3f}")
    print(f"{len(common)} cases: median new/old {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}")
    return ratios


if __name__ == "__main__":
    main()
