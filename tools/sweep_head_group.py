"""Forward and backward time against the launch's head group (FLASHMASK_HEAD_GROUP; unset = the
binding's choice), for causal and full attention with and without a mask tensor, next to SDPA's
flash backend. A kernel-tuning aid: prints one line per case.

    python scripts/sweep_head_group.py --seqlens 8192,32768,131072 --groups 16,4,1,auto
"""
import argparse
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashmask
from masks.examples import example

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--seqlens", default="8192,32768,131072")
p.add_argument("--groups", default="16,4,1,auto")
p.add_argument("--heads", type=int, default=16)
p.add_argument("--head-dim", type=int, default=128)
p.add_argument("--rep-ms", type=int, default=1500)
args = p.parse_args()


def timed(fn):
    return do_bench(fn, warmup=100, rep=args.rep_ms, return_mode="median")


def fwd_bwd_ms(attn, q, k, v):
    """(forward ms, backward ms) of attn(q, k, v)."""
    out = attn(q, k, v)
    dout = torch.randn_like(out)
    fwd = timed(lambda: attn(q, k, v))
    bwd = timed(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    return fwd, bwd


torch.manual_seed(0)
for s in (int(x) for x in args.seqlens.split(",")):
    h, d = args.heads, args.head_dim
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cases = {"causal": (None, True), "full": (None, False),
             "causal C=1": (example("causal", s, device="cuda")[0], True)}
    for name, (mask, causal) in cases.items():
        flops = 4 * h * d * s * s / (2 if causal else 1)
        tf = lambda ms, mult: mult * flops / ms / 1e9  # noqa: E731
        line = [f"S={s // 1024}K {name:10s}"]
        for g in args.groups.split(","):
            if g == "auto":
                os.environ.pop("FLASHMASK_HEAD_GROUP", None)
            else:
                os.environ["FLASHMASK_HEAD_GROUP"] = g
            f, b = fwd_bwd_ms(lambda q, k, v: flashmask.flashmask_attention(q, k, v, mask, causal=causal, backend="cuda"),
                              q, k, v)
            line.append(f"G={g}: fwd {f:8.2f} ms {tf(f, 1):4.0f} | bwd {b:8.2f} ms {tf(b, 2.5):4.0f}")
        os.environ.pop("FLASHMASK_HEAD_GROUP", None)
        if mask is None:
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                f, b = fwd_bwd_ms(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), qt, kt, vt)
            line.append(f"sdpa-flash: fwd {f:8.2f} ms {tf(f, 1):4.0f} | bwd {b:8.2f} ms {tf(b, 2.5):4.0f}")
        print("\n    ".join(line), flush=True)
