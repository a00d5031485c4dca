"""Short queries against long keys (decoding, chunked prefill, speculative drafts): flashmask's
forward, which shares each query tile's key blocks among several CTAs (split-KV) when the tiles
alone cannot fill the GPU, against FlexAttention and SDPA's flash and cuDNN backends on the same
tensors.

A cell is B sequences of Sq queries at the end of Sk keys, causal and aligned bottom-right (query i
sees keys up to Sk - Sq + i, so one query sees them all): q ``[B, Sq, H, D]``, k and v ``[B, Sk,
Hk, D]``. Every method reads all of K and V, so besides TFLOP/s (on the attended pairs) the table
gives the GB/s of q, k, v and the output moved: with one query a sequence, memory bandwidth is the
bound.

Methods: ``flashmask`` (``flashmask_attention``: the binding chooses the number of splits, and a
GQA group's heads run as the rows of one query tile where nothing tells them apart),
``flashmask_unsplit`` (the kernels' op called directly with one job per query head's tile: what
splitting and folding gain), ``flashmask_sm80`` (the SM80 kernels, where the build has
them for this GPU), ``flex``, ``sdpa_flash``, ``sdpa_cudnn``.
Forward only, under ``torch.no_grad()``.

Example::

    python -m benchmarks.bench_decode                                  # B 1, 8 x Sq 1, 16, 128 x Sk 8K-128K
    python -m benchmarks.bench_decode --q-lens 1 --k-lens 32k --batch 1,4,16,64 --passes 2
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from benchmarks.cli import DTYPES, add_testing_args, add_timing_args, parse_choice_list, parse_int_list, resolve_timing
from benchmarks.errors import format_error
from benchmarks.flex import configure_dynamo
from benchmarks.methods import bhsd
from benchmarks.output import default_out_dir, environment, write_results
from benchmarks.timing import time_ms

METHODS = ("flashmask", "flashmask_unsplit", "flashmask_sm80", "flex", "sdpa_flash", "sdpa_cudnn")
FIELDS = ("pass_", "batch", "q_len", "k_len", "heads", "kv_heads", "head_dim", "method", "ms", "tflops",
          "gbps", "note")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,8", help="comma list of batch sizes")
    p.add_argument("--q-lens", default="1,16,128", help="comma list of query lengths (Sq)")
    p.add_argument("--k-lens", default="8k,32k,128k", help="comma list of key lengths (Sk); 'k' suffix = 1024")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA; must divide --heads)")
    p.add_argument("--head-dims", default="128", help="comma list")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list or 'all': {', '.join(METHODS)}")
    p.add_argument("--passes", type=int, default=1, help="the whole sweep this many times, one after another")
    p.add_argument("--out", default=None, help="folder for decode.csv / decode.json (default runs/decode)")
    add_timing_args(p)
    add_testing_args(p)
    args = p.parse_args(argv)
    try:
        args.batch = parse_int_list(args.batch)
        args.q_lens = parse_int_list(args.q_lens)
        args.k_lens = parse_int_list(args.k_lens)
        args.head_dims = parse_int_list(args.head_dims)
        args.methods = parse_choice_list(args.methods, METHODS, "methods")
    except ValueError as e:
        p.error(str(e))
    if args.heads < 1 or args.kv_heads < 1 or args.heads % args.kv_heads:
        p.error(f"--kv-heads must divide --heads, got --heads {args.heads} --kv-heads {args.kv_heads}")
    if args.passes < 1:
        p.error(f"--passes must be >= 1, got {args.passes}")
    bad = [(sq, sk) for sq in args.q_lens for sk in args.k_lens if sq > sk]
    if bad:
        p.error(f"every --q-lens value must be at most every --k-lens value (bottom-right causal), got {bad}")
    resolve_timing(args)
    return args


def attended_pairs(sq: int, sk: int) -> int:
    """Query-key pairs of one head under the bottom-right causal mask: query i sees sk - sq + i + 1 keys."""
    return sq * (sk - sq) + sq * (sq + 1) // 2


def bytes_moved(batch: int, sq: int, sk: int, heads: int, kv_heads: int, head_dim: int, elem: int) -> int:
    """q and the output (Hq heads of Sq rows) and k and v (Hk heads of Sk rows), read or written once."""
    return batch * head_dim * elem * (2 * sq * heads + 2 * sk * kv_heads)


def make_method(method: str, q, k, v, args) -> Callable:
    """The forward of ``method`` on (q, k, v) [B, S, H, D]; raises RuntimeError with the reason where it
    does not apply here."""
    import flashmask
    from flashmask import _cuda

    sq, sk, gqa = q.shape[1], k.shape[1], q.shape[2] != k.shape[2]
    if method.startswith("flashmask"):
        backend = args.flashmask_backend
        if method == "flashmask_unsplit":
            if backend != "cuda":
                raise RuntimeError("flashmask_unsplit calls the kernels: needs --flashmask-backend cuda")
            return lambda: _cuda.fwd(q, k, v, None, True, q.shape[-1] ** -0.5, False, 1)[0]
        if method == "flashmask_sm80":
            if backend != "cuda":
                raise RuntimeError("flashmask_sm80 calls the kernels: needs --flashmask-backend cuda")
            if _cuda.selected_arch(q, 80) != 80:
                raise RuntimeError("this build has no SM80 forward for this GPU (FLASHMASK_ARCHS=90 builds it)")
            backend = "sm80"
        return lambda: flashmask.flashmask_attention(q, k, v, None, causal=True, backend=backend)
    if method == "flex":
        from benchmarks import flex

        offset = sk - sq

        def bottom_right(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        bm, _ = flex.build_block_mask(bottom_right, None, None, sq, sk, q.device)
        attn = flex.compiled_flex_attention(not args.flex_no_compile)
        return lambda: bhsd(attn(bhsd(q), bhsd(k), bhsd(v), block_mask=bm, enable_gqa=gqa))
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    backend = SDPBackend.FLASH_ATTENTION if method == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
    mask = None if sq == 1 else causal_lower_right(sq, sk)

    def attn():
        with sdpa_kernel(backend):
            return bhsd(F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), attn_mask=mask,
                                                        enable_gqa=gqa))
    return attn


def run(args) -> list:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if "flex" in args.methods:
        configure_dynamo()  # a compile per shape
    rows = []
    with torch.no_grad():
        for pass_ in range(1, args.passes + 1):
            for d in args.head_dims:
                for b in args.batch:
                    for sk in args.k_lens:
                        for sq in args.q_lens:
                            g = torch.Generator(device=device).manual_seed(pass_)
                            q = torch.randn(b, sq, args.heads, d, generator=g, device=device, dtype=dtype)
                            k, v = (torch.randn(b, sk, args.kv_heads, d, generator=g, device=device, dtype=dtype)
                                    for _ in range(2))
                            flops = 4 * b * args.heads * d * attended_pairs(sq, sk)
                            moved = bytes_moved(b, sq, sk, args.heads, args.kv_heads, d, q.element_size())
                            for method in args.methods:
                                row = dict(pass_=pass_, batch=b, q_len=sq, k_len=sk, heads=args.heads,
                                           kv_heads=args.kv_heads, head_dim=d, method=method)
                                try:
                                    fn = make_method(method, q, k, v, args)
                                    ms = time_ms(fn, args.warmup, args.rep, device)
                                    row.update(ms=ms, tflops=flops / ms / 1e9, gbps=moved / ms / 1e6)
                                except Exception as e:  # a method that does not run here leaves its reason
                                    row["note"] = format_error(e)
                                rows.append(row)
                                if device.type == "cuda":
                                    torch.cuda.empty_cache()
                        print(f"pass {pass_}: head dim {d}, batch {b}, {sk} keys done", file=sys.stderr, flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    rows = run(args)
    out = args.out or default_out_dir("decode")
    meta = {"args": vars(args), **environment(torch.device(args.device))}
    csv_path, _ = write_results(out, "decode", rows, FIELDS, meta)
    print(f"\n pass    B    Sq      Sk    D  {'method':18s}        ms  TFLOP/s     GB/s  note")
    for r in rows:
        timed = "ms" in r
        print(f"{r['pass_']:5d} {r['batch']:4d} {r['q_len']:5d} {r['k_len']:7d} {r['head_dim']:4d}  {r['method']:18s} "
              + (f"{r['ms']:9.4f} {r['tflops']:8.1f} {r['gbps']:8.0f}" if timed else f"{'n/a':>9s} {'':8s} {'':8s}")
              + f"  {r.get('note', '')}")
    print(f"\n{len(rows)} rows -> {csv_path}")
    return rows


if __name__ == "__main__":
    main()
