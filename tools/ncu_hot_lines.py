"""The SASS lines where a kernel's warps stall most, from an ncu source-page CSV. On a GPU machine:

    ncu --kernel-name regex:^bwd_kernel --launch-skip 1 --launch-count 1 --section SourceCounters \\
        --page source --print-source sass --csv \\
        python -m tools.profile_step --family causal --seqlen 16384 --head-dim 64 > src.csv
    python -m tools.ncu_hot_lines src.csv --top 40

Each line: stall samples, their share of the kernel's, the address, the instruction and its two
largest stall reasons (ncu's stall_* columns).
"""
import argparse
import csv
import os


def number(cell):
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if not os.path.isfile(args.csv):
        parser.error(f"csv {args.csv!r}: no such file")
    with open(args.csv, errors="replace") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, r in enumerate(rows) if "Warp Stall Sampling (All Samples)" in r), None)
    if header_at is None:
        raise SystemExit(f"{args.csv}: no 'Warp Stall Sampling (All Samples)' column (ncu --page source --csv?)")
    header = rows[header_at]
    samples, source = header.index("Warp Stall Sampling (All Samples)"), header.index("Source")
    reasons = [i for i, name in enumerate(header) if name.startswith("stall_") and "(Not Issued)" not in name]
    lines = []
    for r in rows[header_at + 1:]:
        if len(r) == len(header) and number(r[samples]) is not None:
            top = sorted(((number(r[i]) or 0, header[i][len("stall_"):]) for i in reasons), reverse=True)[:2]
            lines.append((number(r[samples]), r[0], r[source].strip(), top))
    total = sum(n for n, *_ in lines) or 1
    print(f"{int(total)} stall samples over {len(lines)} instructions")
    for n, address, instruction, top in sorted(lines, key=lambda x: -x[0])[:args.top]:
        why = ", ".join(f"{reason} {int(k)}" for k, reason in top if k)
        print(f"{int(n):8d} {100 * n / total:5.1f}%  {address}  {instruction[:70]:70s}  {why}")


if __name__ == "__main__":
    main()
