"""The side-by-side table of a variant sweep (tools/sweep_variants.sh): one row per (head dim,
family, seqlen, mode), one column per (variant, method), TFLOP/s; also written to OUT/sweep.csv.

    python -m tools.sweep_table OUT main next lead
"""
import argparse
import csv
import os
from typing import Dict, List, Tuple

Key = Tuple[int, str, int, str]


def collect(out: str, variants: List[str]) -> Tuple[List[str], Dict[Key, Dict[str, float]]]:
    """Columns in variant order (`name` for flashmask, `name_det`, `name_sm80`, ... for the others)
    and the TFLOP/s of every ok row of each variant's OUT/<name>/kernels.csv."""
    columns: List[str] = []
    rows: Dict[Key, Dict[str, float]] = {}
    for name in variants:
        path = os.path.join(out, name, "kernels.csv")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for r in csv.DictReader(f):
                if r["status"] != "ok":
                    continue
                method = r["method"]
                col = name if method == "flashmask" else f"{name}_{method.removeprefix('flashmask_')}"
                if col not in columns:
                    columns.append(col)
                key = (int(r["head_dim"]), r["family"], int(r["seqlen"]), r["mode"])
                rows.setdefault(key, {})[col] = float(r["tflops"])
    return columns, rows


def write(out: str, variants: List[str]) -> str:
    columns, rows = collect(out, variants)
    lines = [f"{'D':>3s} {'family':24s} {'seqlen':>7s} {'mode':>6s} " + " ".join(f"{c:>9s}" for c in columns)]
    with open(os.path.join(out, "sweep.csv"), "w", newline="") as f:
        table = csv.writer(f)
        table.writerow(["head_dim", "family", "seqlen", "mode"] + columns)
        for (hd, fam, s, mode), d in sorted(rows.items()):
            lines.append(f"{hd:3d} {fam:24s} {s:7d} {mode:>6s} "
                         + " ".join(f"{d.get(c, float('nan')):9.1f}" for c in columns))
            table.writerow([hd, fam, s, mode] + [d.get(c, "") for c in columns])
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the sweep's output folder, holding <variant>/kernels.csv")
    parser.add_argument("variants", nargs="*", help="the variants' folder names, in column order")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.out):
        parser.error(f"out {args.out!r}: no such folder")
    print(write(args.out, args.variants))


if __name__ == "__main__":
    main()
