"""A few flashmask forward+backward steps on one mask family, for a profiler to catch; --time
prints their median time instead (triton's do_bench), --kernels the time of each CUDA kernel,
--host the CPU time per call next to the GPU time (is a short call bound by its launch path?).
--sdpa-cudnn runs cuDNN's attention (torch SDPA) on the same tensors instead, for the same profile
of the kernel the benchmarks compare against.

    ncu --kernel-name regex:bwd_kv_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python -m tools.profile_step --family causal --seqlen 32768
    ncu --kernel-name regex:cudnn --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python -m tools.profile_step --family causal --head-dim 192 --head-dim-v 128 --sdpa-cudnn
"""
import argparse

import torch

import flashmask
from masks.examples import example

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--family", default="causal")
parser.add_argument("--seqlen", type=int, default=32768)
parser.add_argument("--heads", type=int, default=16)
parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA; default: --heads)")
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--head-dim-v", type=int, default=None, help="of v (default: --head-dim)")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--deterministic", action="store_true")
parser.add_argument("--no-mask", action="store_true", help="pass no mask tensor (causal or full only)")
parser.add_argument("--sdpa-cudnn", action="store_true",
                    help="cuDNN's attention (torch SDPA, causal or full) on the same tensors instead of flashmask")
parser.add_argument("--time", action="store_true")
parser.add_argument("--kernels", action="store_true", help="print each CUDA kernel's time (torch.profiler)")
parser.add_argument("--host", action="store_true",
                    help="CPU time per call (calls issued back to back) against the kernels' time per call")
parser.add_argument("--mode", choices=("fwd", "bwd", "fwdbwd"), default="fwdbwd", help="what --time / --kernels run")
args = parser.parse_args()

kv_heads = args.heads if args.kv_heads is None else args.kv_heads
if kv_heads < 1 or args.heads % kv_heads:
    parser.error(f"--kv-heads must divide --heads ({args.heads}), got {kv_heads}")
head_dim_v = args.head_dim if args.head_dim_v is None else args.head_dim_v
if (args.no_mask or args.sdpa_cudnn) and args.family not in ("causal", "full"):
    parser.error(f"--no-mask and --sdpa-cudnn need --family causal or full, got {args.family}")
if args.sdpa_cudnn and args.deterministic:
    parser.error("--deterministic is flashmask's; --sdpa-cudnn runs cuDNN's attention")
torch.manual_seed(0)


def randn(heads, dim, requires_grad=True):
    return torch.randn(1, args.seqlen, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)


q, k, v = randn(args.heads, args.head_dim), randn(kv_heads, args.head_dim), randn(kv_heads, head_dim_v)
grad = randn(args.heads, head_dim_v, requires_grad=False)
mask, causal = example(args.family, args.seqlen, device="cuda")
if args.no_mask:
    mask = None


def forward():
    if args.sdpa_cudnn:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=args.family == "causal",
                enable_gqa=kv_heads != args.heads)
        return out.transpose(1, 2)
    return flashmask.flashmask_attention(q, k, v, mask, causal=causal, deterministic=args.deterministic, backend="cuda")


def step():
    torch.autograd.grad(forward(), (q, k, v), grad)


label = (("cuDNN " if args.sdpa_cudnn else "") + args.family + (" (no mask tensor)" if args.no_mask else "")
         + f" at {args.seqlen}"
         + (f", {args.heads} query heads on {kv_heads} key/value heads" if kv_heads != args.heads else ""))
if args.mode == "bwd":
    out = forward()
    timed = lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)  # noqa: E731
else:
    timed = torch.no_grad()(forward) if args.mode == "fwd" else step


def profiled_calls():
    """torch.profiler's CUDA record of args.steps calls, after one unprofiled call."""
    from torch.profiler import ProfilerActivity, profile
    timed()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            timed()
        torch.cuda.synchronize()
    return prof


if args.time:
    from triton.testing import do_bench
    ms = do_bench(timed, warmup=50, rep=300, return_mode="median")
    print(f"{label}: {args.mode} {ms:.3f} ms")
elif args.kernels:
    prof = profiled_calls()
    print(f"{label}: {args.mode}, CUDA kernels over {args.steps} calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60))
elif args.host:
    import time

    from triton.testing import do_bench
    calls = 200  # few enough launches that the queue never fills and blocks the host
    timed()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        timed()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    gpu = sum(e.self_device_time_total for e in profiled_calls().key_averages()) / args.steps
    benched = [do_bench(timed, warmup=50, rep=300, return_mode="median") * 1e3 for _ in range(3)]
    print(f"{label}: {args.mode} host {host:.0f} us/call, kernels {gpu:.0f} us/call, "
          f"do_bench median {' '.join(f'{b:.0f}' for b in benched)} us")
else:
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    print(f"{args.steps} steps of {label}: done")
