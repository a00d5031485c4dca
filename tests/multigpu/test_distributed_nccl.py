"""Context-parallel attention with NCCL and the CUDA kernels on 2+ GPUs, against one GPU.

Each case builds the whole problem on every rank (same seed), runs

* the float32 reference (``reference_attention`` on the bf16/fp16 inputs upcast) and the plain
  half-precision implementation (the baseline of tests/attn_helpers.py), forward and backward;
* one GPU's kernels on the whole sequence (``flashmask_attention(backend="cuda")``);
* both context-parallel modes on the rank's shard with ``backend="cuda"``;

and asserts, on the rank's rows of out, dq, dk and dv (and on the sinks' gradient, the ranks' shares
summed), the bound of the GPU tests (attn_helpers.error_bound): error vs the float32 reference at
most 2x the half-precision baseline's plus a small epsilon. It also reports the largest difference
between the context-parallel result and the single-GPU kernels. Cases whose head dims or dtype the
build lacks are skipped and listed.

Run from the checkout's root (2 GPUs)::

    python -m pytest -q tests/multigpu/test_distributed_nccl.py         # spawns 2 NCCL processes
    torchrun --nproc-per-node 2 -m tests.multigpu.test_distributed_nccl  # the same, printing a table
    python -m tests.multigpu.test_distributed_nccl --device cpu --tiny  # dry run: gloo, reference path

Without 2 GPUs and the built kernels the GPU test skips; the CPU dry run (the same code with gloo
and the reference path at tiny sizes) runs everywhere.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashmask import _cuda, flashmask_attention
from flashmask import distributed as fmd
from flashmask.reference import reference_attention
from masks import merge_chunks, merge_window, window_to_startend
from masks.examples import example
from tests.attn_helpers import KernelLaunches, error_bound, low_precision_attention, max_err, random_startend


def cases(tiny: bool):
    """(name, spec): every mode x mask family, GQA, mask heads 1/Hk/Hq, bf16 and fp16, head dims
    (192, 128), soft-capping, sinks, a sliding window, Llama 4's chunks, and the attention under a
    checkpoint that keeps its output (``keep``)."""
    s = 256 if tiny else 4096
    d = 16 if tiny else 128
    out = []
    fams = ["causal", "full", "causal_document", "document", "share_question", "global_sliding_window",
            "causal_blockwise", "prefix_lm_document", "qk_sparse", "sliding_window", "random_eviction"]
    for mode in fmd.MODES:
        for fam in fams:
            out.append((f"{mode}-{fam}", dict(mode=mode, family=fam, hq=8, hk=2, hm=1, b=1, s=s, d=d,
                                              dtype="bfloat16")))
        for causal, c in [(True, 1), (True, 2), (False, 2), (False, 4)]:
            for hm in ("1", "hk", "hq"):
                out.append((f"{mode}-random-causal{int(causal)}-C{c}-hm_{hm}",
                            dict(mode=mode, family="random", causal=causal, c=c, hq=8, hk=2, hm=hm, b=2,
                                 s=s // 2, d=d, dtype="bfloat16")))
        out.append((f"{mode}-fp16-causal_document", dict(mode=mode, family="causal_document", hq=8, hk=2, hm=1, b=1,
                                                        s=s, d=d, dtype="float16")))
        out.append((f"{mode}-mqa-d64-share_question", dict(mode=mode, family="share_question", hq=8, hk=1, hm=1, b=1,
                                                          s=s, d=64 if not tiny else 8, dtype="bfloat16")))
        # DeepSeek-V3's head dims (192, 128), logit soft-capping and attention sinks (the sinks'
        # gradient is each rank's share, summed over the group)
        out.append((f"{mode}-mla-causal_document", dict(mode=mode, family="causal_document", hq=8, hk=2, hm=1, b=1,
                                                        s=s, d=192 if not tiny else 24, dv=128 if not tiny else 16,
                                                        dtype="bfloat16")))
        out.append((f"{mode}-softcap-document", dict(mode=mode, family="document", hq=8, hk=2, hm=1, b=1, s=s, d=d,
                                                     dtype="bfloat16", softcap=30.0)))
        out.append((f"{mode}-sinks-random-causal1-C2-hm_hq", dict(mode=mode, family="random", causal=True, c=2, hq=8,
                                                                  hk=2, hm="hq", b=2, s=s // 2, d=d,
                                                                  dtype="bfloat16", sinks=True)))
        out.append((f"{mode}-window-sinks-causal_document", dict(mode=mode, family="causal_document", hq=8, hk=2,
                                                                 hm=1, b=1, s=s, d=d, dtype="bfloat16",
                                                                 window=(s // 8 - 1, 0), sinks=True)))
        # Llama 4's chunked attention: the plan made for the mask and chunked (chunks from the row's start)
        out.append((f"{mode}-chunk-causal_document", dict(mode=mode, family="causal_document", hq=8, hk=2, hm=1, b=1,
                                                          s=s, d=d, dtype="bfloat16", chunk=s // 8 + s // 16 + 8)))
        out.append((f"{mode}-keep-attention-causal_document", dict(mode=mode, family="causal_document", hq=8, hk=2,
                                                                  hm=1, b=1, s=s, d=d, dtype="bfloat16", keep=True)))
        out.append((f"{mode}-softcap-sinks-fp16-share_question", dict(mode=mode, family="share_question", hq=8, hk=2,
                                                                      hm=1, b=1, s=s, d=d, dtype="float16",
                                                                      softcap=50.0, sinks=True)))
    out.append(("allgather_kv-8chunks-causal_document", dict(mode="allgather_kv", family="causal_document", hq=8, hk=2,
                                                             hm=1, b=1, s=s, d=d, dtype="bfloat16", chunks_per_rank=4)))
    if not tiny:
        out.append(("allgather_kv-16k-share_question", dict(mode="allgather_kv", family="share_question", hq=8, hk=2,
                                                            hm=1, b=1, s=16384, d=d, dtype="bfloat16", no_ref=True)))
    return out


def _grads(fn, leaves, dout):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    g = torch.autograd.grad((out.float() * dout.float()).sum(), leaves)
    return out.detach(), g


def _inputs(spec, device, dtype):
    """q, k, v, dout and the sinks (float32 ``[Hq]`` or None) of a case, from the seeded generator. With
    ``softcap`` q is scaled so that the scores reach the cap (std softcap / 3); the sinks sit about the
    rows' LSE, one far above it (its rows' output nearly 0) and one far below (no effect)."""
    b, s, hq, hk, d = spec["b"], spec["s"], spec["hq"], spec["hk"], spec["d"]
    dv, softcap = spec.get("dv", d), spec.get("softcap", 0.0)
    q = (torch.randn(b, s, hq, d, device=device) * (softcap / 3 if softcap else 1.0)).to(dtype)
    k, v, dout = (torch.randn(b, s, h, x, device=device, dtype=dtype) for h, x in ((hk, d), (hk, dv), (hq, dv)))
    sinks = None
    if spec.get("sinks"):
        sinks = torch.randn(hq, device=device) * 2 + math.log(s / 4)
        sinks[0], sinks[-1] = 30.0, -1e4
    return q, k, v, dout, sinks


def run_case(spec, world, rank, device, kernel_backend, seed):
    torch.manual_seed(seed)
    dtype = getattr(torch, spec["dtype"])
    b, s, hq, hk = spec["b"], spec["s"], spec["hq"], spec["hk"]
    if spec["family"] == "random":
        g = torch.Generator().manual_seed(seed)
        causal, c = spec["causal"], spec["c"]
        hm = {"1": 1, "hk": hk, "hq": hq}[spec["hm"]]
        mask = random_startend(b, hm, s, s, causal, c, generator=g).to(device)
    else:
        mask, causal = example(spec["family"], s, batch_size=b, device=device)
        if spec["family"] in ("causal", "full"):
            mask = None
    q, k, v, dout, sinks = _inputs(spec, device, dtype)
    softcap = spec.get("softcap", 0.0)
    # a sliding window: the context-parallel plan is made for the mask and windowed; the oracles
    # take the window merged into the mask
    window, chunk = spec.get("window"), spec.get("chunk")
    plan_mask = mask
    if window is not None:
        mask = (merge_window(mask, causal, window, s) if mask is not None
                else window_to_startend(window, s, s, causal, batch_size=b, device=device))
    if chunk is not None:
        mask = merge_chunks(mask, chunk, s)
    leaves = (q, k, v) + (() if sinks is None else (sinks,))
    names = ("out", "dq", "dk", "dv", "dsinks")[:len(leaves) + 1]
    # one GPU: the kernels on the whole sequence
    one, one_g = _grads(lambda a, b_, c_, *sk: flashmask_attention(a, b_, c_, mask, causal=causal, softcap=softcap,
                                                                   sinks=sk[0] if sk else None,
                                                                   backend=kernel_backend),
                        leaves, dout)
    # context parallel; the sinks are every rank's whole [Hq], their gradient this rank's share
    plan = fmd.make_plan(plan_mask, causal, s, mode=spec["mode"], align=128 if s >= 2048 else 8,
                         num_chunks=world * spec["chunks_per_rank"] if "chunks_per_rank" in spec else None)
    if window is not None:
        plan = plan.windowed(window, batch_size=b)
    if chunk is not None:
        plan = plan.chunked(chunk, batch_size=b)
    loc = [plan.shard(t) for t in leaves[:3]] + list(leaves[3:])

    def cp_attention(a, b_, c_, *sk):
        return fmd.context_parallel_attention(a, b_, c_, plan, softcap=softcap, sinks=sk[0] if sk else None,
                                              backend=kernel_backend)

    if spec.get("keep"):
        cp, cp_g = _kept_under_checkpoint(cp_attention, loc, plan.shard(dout), kernel_backend)
    else:
        cp, cp_g = _grads(cp_attention, loc, plan.shard(dout))
    if sinks is not None:
        dist.all_reduce(cp_g[3])

    def rows(x, name):  # this rank's rows of a whole-sequence result; the sinks' gradient is not per token
        return x if name == "dsinks" else plan.shard(x)

    res = {"imbalance": round(plan.imbalance, 4)}
    res["max_diff_vs_one_gpu"] = max(max_err(x, rows(y, n)) for n, x, y in zip(names, (cp,) + cp_g, (one,) + one_g))
    assert not torch.isnan(cp).any() and not any(torch.isnan(x).any() for x in cp_g), "NaN"
    if spec.get("no_ref"):
        # too long for the O(S^2) reference: the single-GPU kernels are the oracle, within the
        # rounding of the inputs' dtype relative to the values' scale
        for name, x, y in zip(names, (cp,) + cp_g, (one,) + one_g):
            scale = max(y.abs().max().item(), 1e-2)
            assert max_err(x, rows(y, name)) <= 2e-2 * scale, f"{name} differs from one GPU"
        return res
    ref, ref_g = _grads(lambda a, b_, c_, *sk: reference_attention(a.float(), b_.float(), c_.float(), mask,
                                                                   causal=causal, softcap=softcap,
                                                                   sinks=sk[0] if sk else None)[0],
                        leaves, dout)
    low, low_g = _grads(lambda a, b_, c_, *sk: low_precision_attention(a, b_, c_, mask, causal, None, softcap,
                                                                       sk[0] if sk else None)[0],
                        leaves, dout)
    for name, x, r, lo, o in zip(names, (cp,) + cp_g, (ref,) + ref_g, (low,) + low_g, (one,) + one_g):
        # the sinks' gradient comes from the output stored in the inputs' dtype
        bound = error_bound(lo, r, ulp=torch.finfo(dtype).eps if name == "dsinks" else None)
        err = max_err(x, rows(r, name))
        res[f"{name}_err"], res[f"{name}_bound"] = err, bound
        res[f"{name}_err_one_gpu"] = max_err(rows(o, name), rows(r, name))
        assert err <= bound, f"{name} error {err:.3e} > bound {bound:.3e} (one GPU: {res[f'{name}_err_one_gpu']:.3e})"
    return res


def _kept_under_checkpoint(fn, leaves, dout, kernel_backend):
    """``_grads`` of ``fn`` under a checkpoint that keeps the attention output; with the kernels, no
    forward may launch in the backward (the recompute takes the kept output)."""
    from torch.utils.checkpoint import checkpoint

    from flashmask.checkpointing import keep_attention_context

    real = _cuda._C
    launches = KernelLaunches(real) if kernel_backend != "reference" else None
    if launches is not None:
        _cuda._C = launches
    try:
        leaves = [t.detach().clone().requires_grad_() for t in leaves]
        out = checkpoint(fn, *leaves, use_reentrant=False, context_fn=keep_attention_context)
        forward = None if launches is None else launches.fwd_calls
        g = torch.autograd.grad((out.float() * dout.float()).sum(), leaves)
    finally:
        _cuda._C = real
    if launches is not None:
        assert forward > 0 and launches.fwd_calls == forward, (forward, launches.fwd_calls)
    return out.detach(), g


def _unserved(spec):
    """Why this build's kernels cannot run a case (its head dims or dtype not compiled), else None."""
    d, dv, dtype = spec["d"], spec.get("dv", spec["d"]), getattr(torch, spec["dtype"])
    if dtype in _cuda.compiled_dtypes() and any(d <= p[0] and dv <= p[1] for p in _cuda.compiled_head_dim_pairs()):
        return None
    return f"this build has no kernel for head dims ({d}, {dv}), {spec['dtype']}"


def worker(rank, world, init, outdir, device_type, tiny, only=None):
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        backend, kernel_backend = "nccl", "cuda"
    else:
        device, backend, kernel_backend = torch.device("cpu"), "gloo", "reference"
        torch.set_num_threads(1)
    kw = {"device_id": device} if device_type == "cuda" else {}  # binds NCCL's barriers to this rank's GPU
    if init is None:
        dist.init_process_group(backend, **kw)
    else:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, **kw)
    results = {}
    t0 = time.perf_counter()
    try:
        for i, (name, spec) in enumerate(cases(tiny)):
            if only and not any(o in name for o in only):
                continue
            t = time.perf_counter()
            why = _unserved(spec) if device.type == "cuda" else None
            if why:
                results[name] = {"ok": True, "skipped": why}
                continue
            try:
                res = run_case(spec, world, rank, device, kernel_backend, seed=100 + i)
                results[name] = {"ok": True, **res, "s": round(time.perf_counter() - t, 2)}
            except Exception:
                results[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()
    finally:
        if outdir is not None:
            with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
                json.dump(results, f, indent=1)
        if rank == 0:
            print(f"{len(results)} cases in {time.perf_counter() - t0:.1f} s on {world} ranks "
                  f"({backend}, kernels: {kernel_backend})")
            for name, r in results.items():
                if "skipped" in r:
                    print(f"  skip {name:45s} {r['skipped']}")
                elif r["ok"]:
                    errs = " ".join(f"{k[:-4]} {r[k]:.2e}/{r[k[:-4] + '_bound']:.2e}" for k in r
                                    if k.endswith("_err"))
                    print(f"  ok   {name:45s} vs 1 GPU {r['max_diff_vs_one_gpu']:.2e}  imbalance "
                          f"{r['imbalance']:.3f}  {errs}")
                else:
                    print(f"  FAIL {name}\n{r['error']}")
        dist.destroy_process_group()
    return results


def spawn(world, device_type, tiny, only=None):
    d = tempfile.mkdtemp(prefix="fm_cp_gpu_")
    mp.spawn(worker, args=(world, f"file://{d}/init", d, device_type, tiny, only), nprocs=world, join=True)
    out = {}
    for r in range(world):
        with open(os.path.join(d, f"rank{r}.json")) as f:
            for name, res in json.load(f).items():
                out.setdefault(name, []).append(res)
    return out


def _failures(out):
    return {n: [r.get("error") for r in rs if not r["ok"]] for n, rs in out.items() if not all(r["ok"] for r in rs)}


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and _cuda.available()
                         and dist.is_nccl_available()),
                    reason="needs 2 GPUs, NCCL and the built CUDA kernels")
def test_two_gpus_nccl_kernels_match_one_gpu():
    out = spawn(2, "cuda", tiny=False)
    assert len(out) == len(cases(False))
    fails = _failures(out)
    assert not fails, "\n".join(f"{n}:\n{e}" for n, es in fails.items() for e in es)


@pytest.mark.slow
def test_cpu_dry_run_of_the_gpu_script():
    """The same cases with gloo and the reference path at tiny sizes (keeps the GPU script runnable)."""
    out = spawn(2, "cpu", tiny=True, only=["allgather_kv-causal_document", "ulysses-share_question",
                                           "random-causal0-C4-hm_hq", "mqa", "8chunks", "allgather_kv-mla",
                                           "ulysses-softcap-sinks", "allgather_kv-sinks", "window", "chunk",
                                           "keep-attention"])
    assert len(out) >= 11
    fails = _failures(out)
    assert not fails, "\n".join(f"{n}:\n{e}" for n, es in fails.items() for e in es)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU dry run)")
    p.add_argument("--world", type=int, default=2, help="processes to spawn when not under torchrun")
    p.add_argument("--only", default=None, help="comma list of substrings of case names")
    args = p.parse_args(argv)
    only = args.only.split(",") if args.only else None
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        res = worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, None, args.device, args.tiny, only)
        return 0 if all(r["ok"] for r in res.values()) else 1
    out = spawn(args.world, args.device, args.tiny, only)
    return 1 if _failures(out) else 0


if __name__ == "__main__":
    sys.exit(main())
