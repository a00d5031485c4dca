"""What the backward's separate GQA reduction costs: the whole flashmask backward with grouped K/V
heads against the reduction alone (each query head's dK, dV summed over its group, as the binding
does it), on the same shapes. Prints one line per case; GPU only.

    python3 scripts/gqa_reduction_cost.py --seqlens 8192,32768,131072
"""
import argparse
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashmask  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--seqlens", default="8192,32768,131072")
parser.add_argument("--shapes", default="16:2:128,14:2:64,32:8:64",
                    help="query heads:key/value heads:head dim, comma-separated")
args = parser.parse_args()

torch.manual_seed(0)
for shape in args.shapes.split(","):
    hq, hk, d = (int(x) for x in shape.split(":"))
    for s in (int(x) for x in args.seqlens.split(",")):
        q = torch.randn(1, s, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        out = flashmask.flashmask_attention(q, k, v, causal=True, backend="cuda")
        grad = torch.randn_like(out)
        bwd = do_bench(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), warmup=25, rep=100)
        dk_h = torch.randn(1, s, hq, d, device="cuda", dtype=torch.bfloat16)
        dk = torch.empty(1, s, hk, d, device="cuda", dtype=torch.bfloat16)

        def reduce():  # dK and dV: the binding's two copy_(view(...).sum(...)) calls
            for _ in range(2):
                dk.copy_(dk_h.view(1, s, hk, hq // hk, d).sum(3, dtype=torch.float32))

        red = do_bench(reduce, warmup=25, rep=100)
        print(f"Hq={hq} Hk={hk} D={d} S={s}: causal backward {bwd:.3f} ms, of which the GQA reduction "
              f"{red:.3f} ms ({100 * red / bwd:.1f}%)", flush=True)
        del q, k, v, out, grad, dk_h, dk
