"""Bitwise repeatability of the CUDA kernels: the forward's output and LSE (and, with a backward,
the deterministic gradients) run after run on the same inputs, under what changes a run's timing:
fresh copies of the inputs, a backward after each forward. A race in a kernel that one comparison
misses shows up as runs that differ from the first; the rows of the first difference tell which
warps lost (a consumer warp holds 16 rows of a tile). Back-to-back forwards on the same tensors
hid such a race where runs with a backward between them showed it in most runs.

    python -m tools.repeat_check --head-dim 96 --families global_sliding_window --reps 40
"""
import argparse

import torch

import flashmask
import masks
from masks.examples import example

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--families", default=",".join(sorted(masks.FAMILIES)), help="comma-separated mask families")
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--head-dim-v", type=int, default=None, help="of v (default: --head-dim)")
parser.add_argument("--seqlen", type=int, default=2900, help="off the tiles by default")
parser.add_argument("--batch", type=int, default=2)
parser.add_argument("--heads", type=int, default=6)
parser.add_argument("--kv-heads", type=int, default=2)
parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
parser.add_argument("--backend", choices=("cuda", "sm80", "sm90"), default="cuda")
parser.add_argument("--reps", type=int, default=40, help="runs compared with the first, per family and variant")
args = parser.parse_args()

families = [f for f in args.families.split(",") if f]
unknown = [f for f in families if f not in masks.FAMILIES]
if not families or unknown:
    parser.error(f"--families must name mask families of {sorted(masks.FAMILIES)}, got {args.families!r}")
for name in ("head_dim", "seqlen", "batch", "heads", "kv_heads", "reps"):
    if getattr(args, name) < 1:
        parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
if args.heads % args.kv_heads:
    parser.error(f"--kv-heads must divide --heads ({args.heads}), got {args.kv_heads}")
if not flashmask.cuda.available():
    parser.error(f"needs the CUDA kernels: {flashmask.cuda.unavailable_reason()}")

dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
head_dim_v = args.head_dim if args.head_dim_v is None else args.head_dim_v
torch.manual_seed(0)


def where_first_differs(a: torch.Tensor, b: torch.Tensor) -> str:
    """The (batch, head) pairs and query rows where two [B, S, H, D] outputs differ."""
    diff = (a.float() - b.float()).abs().amax(-1)  # [B, S, H]
    bs, rows, hs = torch.nonzero(diff).T.tolist()
    return (f"{len(set(zip(bs, hs)))} (batch, head) pairs, {len(set(rows))} rows in {min(rows)}..{max(rows)}, "
            f"up to {diff.max().item():.3g}")


for family in families:
    mask, causal = example(family, args.seqlen, batch_size=args.batch, device="cuda")
    q, k = (torch.randn(args.batch, args.seqlen, h, args.head_dim, device="cuda", dtype=dtype)
            for h in (args.heads, args.kv_heads))
    v = torch.randn(args.batch, args.seqlen, args.kv_heads, head_dim_v, device="cuda", dtype=dtype)
    dout = torch.randn(args.batch, args.seqlen, args.heads, head_dim_v, device="cuda", dtype=dtype)
    for fresh in (False, True):
        for backward in (False, True):
            def run():
                leaves = [t.detach().clone() if fresh else t.detach() for t in (q, k, v)]
                leaves = [t.requires_grad_(backward) for t in leaves]
                out, lse = flashmask.flashmask_attention(*leaves, mask, causal=causal, return_lse=True,
                                                         backend=args.backend, deterministic=True)
                grads = torch.autograd.grad((out.float() * dout.float()).sum(), leaves) if backward else ()
                return (out.detach(), lse.detach()) + tuple(grads)

            first = run()
            names = ("out", "lse", "dq", "dk", "dv")[:len(first)]
            differ = dict.fromkeys(names, 0)
            where = ""
            for _ in range(args.reps):
                again = run()
                for name, a, b in zip(names, first, again):
                    differ[name] += not torch.equal(a, b)
                if not where and not torch.equal(first[0], again[0]):
                    where = "; first differing out: " + where_first_differs(first[0], again[0])
            counts = ", ".join(f"{n} {c}" for n, c in differ.items())
            print(f"{family} fresh inputs={fresh:d} backward={backward:d}: runs differing of {args.reps}: "
                  f"{counts}{where}", flush=True)
