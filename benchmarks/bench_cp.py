"""Context parallelism benchmarks: attention alone at CP=1 vs CP=P, and packed-SFT training.

``attn``: one attention call (forward, forward+backward; backward = the difference) over the
whole sequence on one GPU (CP=1, every rank runs it alone) and over the P ranks of the group
with each context-parallel mode, for causal document and share question at 128K-1M tokens
(B=1, Hq=Hk=16, D=128, bf16). FLOPs count unmasked pairs only (fwd = 4*B*H*D*pairs,
fwd+bwd = 3.5x), TFLOP/s per GPU = FLOPs / time / P, efficiency = speedup / P, plus the
balancer's imbalance (attention work of the busiest rank over the mean).

``train``: a packed-SFT step of a randomly initialised decoder (``0.5b``: Qwen2-0.5B's shape with
a 32K vocabulary, 0.39B parameters, Llama classes by default as in bench_train.py; documents of
128-4096 tokens packed per row): FSDP2 over the
P ranks, context parallelism over them (``--cp``), the ``fm_cp`` transformers backend, the
chunked LM loss (no ``[S, vocab]`` logits) and per-layer activation checkpointing
(``--offload``: checkpoints in pinned host memory; ``--mlp-chunk``: the MLPs run that many tokens
at a time, no ``[S, intermediate]`` temporaries). ``--cp 1`` without torchrun is the one-GPU
baseline (``fm_colmask`` backend, same loss and checkpointing). Prints tokens/s per GPU and the
peak memory per GPU; ``--find-max`` doubles the row length until a step fails.

Run (2 GPUs)::

    torchrun --nproc-per-node 2 -m benchmarks.bench_cp attn                       # ~4 min
    python -m benchmarks.bench_cp train --cp 1 --seqlens 256k,512k                # one GPU
    torchrun --nproc-per-node 2 -m benchmarks.bench_cp train --cp 2 --seqlens 512k,1m
    torchrun --nproc-per-node 2 -m benchmarks.bench_cp train --cp 2 --seqlens 2m --offload
    python -m benchmarks.bench_cp train --cp 1 --seqlens 1m --offload               # MLP in 64K chunks
    python -m benchmarks.bench_cp attn --device cpu --tiny --nproc 2              # CPU dry run (gloo)
    python -m benchmarks.bench_cp train --device cpu --tiny --nproc 2             # CPU dry run

Results: ``benchmarks/results/cp/{attn,train}.csv`` (or ``--out``), one row appended after every
point, so that invocations with other ``--families`` / ``--seqlens`` / ``--cp`` add to one table (a
header only when the file is new; an existing file with another header is an error). Beside it
``{attn,train}.json``: ``{"runs": [{"meta": ..., "rows": [...]}, ...]}``, one run per invocation.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from benchmarks.cli import DTYPES, parse_choice_list, parse_int_list
from benchmarks.cuda_memory import cleanup
from benchmarks.errors import format_error, is_fatal_cuda_error, is_oom, status_of
from benchmarks.flops import attn_flops
from benchmarks.output import csv_value, default_out_dir, environment
from benchmarks.report import fmt_len

ATTN_FIELDS = ("family", "seqlen", "heads", "kv_heads", "head_dim", "mode", "cp", "cp_mode", "status", "ms",
               "tflops_per_gpu", "tflops_total", "speedup", "efficiency", "imbalance", "plan_ms", "pairs",
               "peak_mem_gib", "notes")
TRAIN_FIELDS = ("model", "params", "seqlen", "cp", "cp_mode", "tokens_per_gpu", "status", "tokens_per_s",
                "tokens_per_s_per_gpu", "ms_per_step", "peak_mem_gib", "offload", "mlp_chunk", "loss_first",
                "loss_last", "imbalance", "notes")
# name -> (hidden, intermediate, layers, heads, kv heads, vocab)
MODELS = {"0.5b": (896, 4864, 24, 14, 2, 32000), "tiny": (64, 128, 2, 4, 2, 320)}


# --------------------------------------------------------------------------------------------
# process group


def setup(args):
    """(rank, world, device) after init_process_group (torchrun env, or a spawned worker)."""
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(1, args.nproc)))
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        kw = {"timeout": datetime.timedelta(seconds=args.timeout)}
        if device.type == "cuda":
            kw["device_id"] = device
        dist.init_process_group(backend, **kw)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device


def _spawned(rank, args, init):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(args.nproc), "LOCAL_RANK": str(rank)})
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl", init_method=init, rank=rank,
                            world_size=args.nproc)
    try:
        args.func(args)
    finally:
        dist.destroy_process_group()


def launch(args):
    if "WORLD_SIZE" in os.environ or args.nproc == 1:
        try:
            args.func(args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return
    import torch.multiprocessing as mp
    d = tempfile.mkdtemp(prefix="bench_cp_")
    mp.spawn(_spawned, args=(args, f"file://{d}/init"), nprocs=args.nproc, join=True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(x: float, device) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _peak(device):
    return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# --------------------------------------------------------------------------------------------
# results: appended, never overwritten


def _results_paths(out_dir: str, stem: str):
    return os.path.join(out_dir, stem + ".csv"), os.path.join(out_dir, stem + ".json")


def _read_header(csv_path: str):
    """The header of an existing, non-empty CSV; ``None`` for a missing or empty file."""
    if not os.path.exists(csv_path) or os.path.getsize(csv_path) == 0:
        return None
    with open(csv_path, newline="") as f:
        return next(csv.reader(f), None)


def _read_runs(json_path: str) -> list:
    """The runs already in ``json_path`` (``[]`` when there is none); a file in the older one-run
    form ``{"meta", "rows"}`` is one run."""
    if not os.path.exists(json_path) or os.path.getsize(json_path) == 0:
        return []
    try:
        with open(json_path) as f:
            data = json.load(f)
    except ValueError as e:
        raise SystemExit(f"bench_cp.py: {json_path} is not valid JSON ({e}); move it away or choose another "
                         "--out") from None
    if isinstance(data, dict) and isinstance(data.get("runs"), list):
        return data["runs"]
    if isinstance(data, dict) and "rows" in data:
        return [{"meta": data.get("meta"), "rows": data["rows"]}]
    raise SystemExit(f"bench_cp.py: {json_path} is not a bench_cp results file (expected {{\"runs\": [...]}}); "
                     "move it away or choose another --out")


def check_results(out_dir: str, stem: str, fields) -> None:
    """Exit with a message, before any work, when ``out_dir/stem.csv`` exists with another header (a
    different version of this script wrote it: appending would mix two tables) or ``stem.json`` is
    not ours."""
    csv_path, json_path = _results_paths(out_dir, stem)
    header = _read_header(csv_path)
    if header is not None and header != list(fields):
        missing = [k for k in fields if k not in header]
        extra = [k for k in header if k not in fields]
        diff = f"missing {missing}, extra {extra}" if missing or extra else "the same columns in another order"
        raise SystemExit(
            f"bench_cp.py: {csv_path} has another header than this script writes ({diff}); rows are appended "
            "to an existing file only when its header is the same. Move the file away or choose another --out.")
    _read_runs(json_path)


class Results:
    """The rows of this invocation, appended to ``out_dir/<stem>.csv`` one at a time (the header only
    when the file is new or empty, rows of earlier invocations kept) and to ``<stem>.json``
    (``{"runs": [..., {"meta": meta, "rows": rows}]}``, rewritten whole after every row through a
    temporary file). Rank 0 only."""

    def __init__(self, out_dir: str, stem: str, fields, meta: dict):
        check_results(out_dir, stem, fields)
        self.csv_path, self.json_path = _results_paths(out_dir, stem)
        self.fields = list(fields)
        self.runs = _read_runs(self.json_path)
        self.run = {"meta": meta, "rows": []}
        self.runs.append(self.run)

    def add(self, row: dict) -> None:
        os.makedirs(os.path.dirname(self.csv_path) or ".", exist_ok=True)
        new = _read_header(self.csv_path) is None
        with open(self.csv_path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow({k: csv_value(row.get(k)) for k in self.fields})
        self.run["rows"].append(row)
        tmp = self.json_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"runs": self.runs}, f, indent=1, default=str)
        os.replace(tmp, self.json_path)


# --------------------------------------------------------------------------------------------
# attention alone


def bench_attn(args):
    from flashmask import distributed as fmd
    from flashmask import flashmask_attention
    from flashmask.distributed.intervals import block_pairs
    from masks.examples import example

    rank, world, device = setup(args)
    dtype = DTYPES[args.dtype]
    heads, kv_heads, d = args.heads, args.kv_heads, args.head_dim
    backend = args.flashmask_backend
    out_dir = args.out or default_out_dir("cp")
    rows, meta = [], {"script": "bench_cp attn", "args": {k: v for k, v in vars(args).items() if k != "func"},
                      "env": environment(device), "world": world}
    results = Results(out_dir, "attn", ATTN_FIELDS, meta) if rank == 0 else None
    if rank == 0:
        print(f"attention alone: {world} ranks, {device}, B=1 Hq={heads} Hk={kv_heads} D={d} {args.dtype}, "
              f"backend={backend}, cp modes {args.cp_modes}", flush=True)

    def timed(fn, n_warm, n_rep):
        for _ in range(n_warm):
            fn()
        _sync(device)
        if dist.is_initialized():
            dist.barrier()
        times = []
        for _ in range(n_rep):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
            if sum(times) > args.max_seconds:
                break
        return _max_over_ranks(1e3 * min(times), device)

    def add(row):
        rows.append(row)
        if rank == 0:
            results.add(row)
            if row["status"] == "ok":
                print(f"  {row['family']:16s} {fmt_len(row['seqlen']):>5s} {row['mode']:6s} cp={row['cp']} "
                      f"{row['cp_mode']:12s} {row['ms']:10.1f} ms {row['tflops_per_gpu']:7.1f} TFLOP/s/GPU"
                      + (f"  speedup {row['speedup']:.2f} eff {row['efficiency']:.2f} imbalance "
                         f"{row['imbalance']:.3f}" if row['cp'] > 1 else ""), flush=True)
            else:
                print(f"  {row['family']:16s} {fmt_len(row['seqlen']):>5s} {row['mode']:6s} cp={row['cp']} "
                      f"{row['cp_mode']:12s} {row['status']}: {row['notes']}", flush=True)

    first = True
    for fam in args.families:
        for s in args.seqlens:
            mask, causal = example(fam, s, device=device)
            pairs = int(block_pairs(mask, causal, [(0, s)]).sum()) * heads
            g = torch.Generator(device=device).manual_seed(s)
            q = torch.randn(1, s, heads, d, device=device, dtype=dtype, generator=g)
            k = torch.randn(1, s, kv_heads, d, device=device, dtype=dtype, generator=g)
            v = torch.randn(1, s, kv_heads, d, device=device, dtype=dtype, generator=g)
            dout = torch.randn(1, s, heads, d, device=device, dtype=dtype, generator=g)
            n_warm = 1 if (first or s <= args.warmup_below) else 0
            n_rep = args.reps if s <= args.warmup_below else 1
            first = False
            base = {}
            for cp_mode in ["none"] + args.cp_modes:
                cp = 1 if cp_mode == "none" else world
                if cp_mode != "none" and world == 1:
                    continue
                plan_ms, plan = None, None
                try:
                    if cp_mode == "none":
                        ql, kl, vl, dl = q, k, v, dout

                        def call(a, b_, c_):
                            return flashmask_attention(a, b_, c_, mask, causal=causal, backend=backend)
                    else:
                        _sync(device)
                        t0 = time.perf_counter()
                        plan = fmd.make_plan(mask, causal, s, mode=cp_mode, align=args.align)
                        _sync(device)
                        plan_ms = 1e3 * (time.perf_counter() - t0)
                        ql, kl, vl, dl = (plan.shard(t) for t in (q, k, v, dout))

                        def call(a, b_, c_, plan=plan):
                            return fmd.context_parallel_attention(a, b_, c_, plan, backend=backend)
                    for mode in args.modes:
                        _reset_peak(device)
                        if mode == "fwd":
                            def step():
                                with torch.no_grad():
                                    call(ql, kl, vl)
                        else:
                            leaves = [t.detach().requires_grad_() for t in (ql, kl, vl)]

                            def step(leaves=leaves):
                                out = call(*leaves)
                                out.backward(dl)
                                for t in leaves:
                                    t.grad = None
                        ms = timed(step, n_warm, n_rep)
                        flops = attn_flops(pairs, d, mode)
                        row = {"family": fam, "seqlen": s, "heads": heads, "kv_heads": kv_heads, "head_dim": d,
                               "mode": mode, "cp": cp, "cp_mode": cp_mode, "status": "ok", "ms": ms,
                               "tflops_total": flops / ms / 1e9, "tflops_per_gpu": flops / ms / 1e9 / cp,
                               "imbalance": None if plan is None else plan.imbalance, "plan_ms": plan_ms,
                               "pairs": pairs, "peak_mem_gib": _max_over_ranks(_peak(device) or 0.0, device)}
                        if cp_mode == "none":
                            base[mode] = ms
                        elif mode in base:
                            row["speedup"] = base[mode] / ms
                            row["efficiency"] = row["speedup"] / cp
                        add(row)
                except Exception as e:  # noqa: BLE001 - a failed point becomes a row
                    if args.device == "cpu" and not is_oom(e):
                        raise
                    add({"family": fam, "seqlen": s, "heads": heads, "kv_heads": kv_heads, "head_dim": d,
                         "mode": ",".join(args.modes), "cp": cp, "cp_mode": cp_mode, "status": status_of(e),
                         "notes": format_error(e)})
                    if is_fatal_cuda_error(e):
                        raise
                finally:
                    plan = ql = kl = vl = dl = None
                    cleanup()
            q = k = v = dout = mask = None
            cleanup()
    if rank == 0:
        print(f"-> {os.path.join(out_dir, 'attn.csv')}")
    return rows


# --------------------------------------------------------------------------------------------
# packed SFT training


def synthetic_batch(seqlen: int, vocab: int, doc_len, seed: int) -> dict:
    """One packed row of ``seqlen`` random tokens: documents of uniform random length in
    ``doc_len`` (the last cut to fit), positions restarting per document, labels = ids with -100
    on each document's first token (no prediction across documents). CPU tensors."""
    g = torch.Generator().manual_seed(seed)
    lens, used = [], 0
    while used < seqlen:
        n = min(int(torch.randint(doc_len[0], doc_len[1] + 1, (1,), generator=g)), seqlen - used)
        lens.append(n)
        used += n
    ids = torch.randint(0, vocab, (1, seqlen), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens]).view(1, seqlen)
    labels = ids.clone()
    labels[pos == 0] = -100
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def build_model(args, device, dtype):
    """A randomly initialised Llama (default, as bench_train.py) or Qwen2 causal LM of the preset's shape."""
    import transformers

    import flashmask.integrations.transformers as fm_hf

    hidden, inter, layers, heads, kv, vocab = MODELS[args.model_size]
    common_kw = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=max(2048, max(args.seqlens) * 2),
                     rope_theta=1e6, tie_word_embeddings=True, attention_dropout=0.0, use_cache=False)
    if args.arch == "llama":
        cfg, cls = transformers.LlamaConfig(**common_kw), transformers.LlamaForCausalLM
    else:
        cfg, cls = transformers.Qwen2Config(**common_kw), transformers.Qwen2ForCausalLM
    torch.manual_seed(args.seed)
    model = cls._from_config(cfg, attn_implementation=fm_hf.ATTN_IMPLEMENTATION)
    return model.to(device=device, dtype=dtype).train()


def bench_train(args):
    import flashmask.distributed.hf as cp_hf
    from flashmask import distributed as fmd
    from flashmask.checkpointing import chunk_mlp, enable_activation_checkpointing
    from flashmask.distributed import fsdp as fm_fsdp
    from flashmask.losses import causal_lm_loss

    rank, world, device = setup(args)
    dtype = DTYPES[args.dtype]
    cp = args.cp
    if world % cp:
        raise SystemExit(f"--cp {cp} must divide the number of processes {world}")
    dp = world // cp
    out_dir = args.out or default_out_dir("cp")
    rows, meta = [], {"script": "bench_cp train", "args": {k: v for k, v in vars(args).items() if k != "func"},
                      "env": environment(device), "world": world}
    mesh = fm_fsdp.init_mesh(dp, cp, device_type=device.type) if world > 1 else None
    group = fm_fsdp.cp_group(mesh) if mesh is not None else None
    vocab = MODELS[args.model_size][5]
    results = Results(out_dir, "train", TRAIN_FIELDS, meta) if rank == 0 else None
    if rank == 0:
        print(f"packed SFT: {args.model_size} {args.dtype}, {world} ranks (dp={dp}, cp={cp}, {args.cp_mode}), "
              f"offload={args.offload}, loss chunk {args.loss_chunk}, MLP chunk {args.mlp_chunk or 'off'}, "
              f"{args.warmup_steps} warmup + {args.steps} timed steps", flush=True)

    def add(row):
        rows.append(row)
        if rank == 0:
            results.add(row)
            if row["status"] == "ok":
                print(f"  S={fmt_len(row['seqlen']):>5s} cp={cp}: {row['tokens_per_s_per_gpu']:9.0f} tok/s/GPU "
                      f"({row['tokens_per_s']:.0f} tok/s), {row['ms_per_step']:.0f} ms/step, peak "
                      f"{row['peak_mem_gib']:.2f} GiB/GPU, loss {row['loss_first']:.3f} -> {row['loss_last']:.3f}",
                      flush=True)
            else:
                print(f"  S={fmt_len(row['seqlen']):>5s} cp={cp}: {row['status']} {row['notes']}", flush=True)

    def run(s):
        model = build_model(args, device, dtype)
        params = sum(p.numel() for p in model.parameters())
        enable_activation_checkpointing(model, offload={"off": False, "on": True, "auto": "auto"}[args.offload])
        if args.mlp_chunk:
            chunk_mlp(model, args.mlp_chunk)
        if world > 1:
            cp_hf.use_context_parallel(model)
            fm_fsdp.apply_fsdp2(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
        times, losses, imb = [], [], 1.0
        _reset_peak(device)
        for i in range(args.warmup_steps + args.steps):
            # the same batch on the ranks of a cp group
            batch = synthetic_batch(s, vocab, args.doc_len, args.seed + 1000 * i + rank // cp)
            batch = {k: t.to(device) for k, t in batch.items()}
            if dist.is_initialized():
                dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            if world > 1:
                local, plan = fmd.shard_packed_batch(batch, group=group, mode=args.cp_mode, align=args.align)
                imb = plan.imbalance
                with cp_hf.context_parallel(plan):
                    loss = fm_fsdp.lm_loss(model, local, chunk_size=args.loss_chunk)
                    loss.backward()
                shown = fm_fsdp.reduce_loss(loss, mesh)
            else:
                mask = fmd.document_mask_from_position_ids(batch["position_ids"])
                hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                     attn_mask_startend_row_indices=mask, use_cache=False).last_hidden_state
                loss = causal_lm_loss(hidden, model.lm_head, batch["labels"], chunk_size=args.loss_chunk)
                loss.backward()
                shown = loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            dt = _max_over_ranks(time.perf_counter() - t0, device)
            losses.append(float(shown))
            if i >= args.warmup_steps:
                times.append(dt)
            if rank == 0:
                print(f"    step {i + 1}: {dt * 1e3:.0f} ms, loss {losses[-1]:.4f}", flush=True)
        peak = _max_over_ranks(_peak(device) or 0.0, device)
        tok_s = s * dp * len(times) / sum(times)
        return {"params": params, "tokens_per_s": tok_s, "tokens_per_s_per_gpu": tok_s / world,
                "ms_per_step": 1e3 * sum(times) / len(times), "peak_mem_gib": peak, "loss_first": losses[0],
                "loss_last": losses[-1], "imbalance": imb}

    seqlens = list(args.seqlens)
    i = 0
    while i < len(seqlens):
        s = seqlens[i]
        row = {"model": args.model_size, "seqlen": s, "cp": cp, "cp_mode": args.cp_mode if world > 1 else "none",
               "tokens_per_gpu": s // cp, "offload": args.offload, "mlp_chunk": args.mlp_chunk}
        try:
            row.update(run(s), status="ok")
        except Exception as e:  # noqa: BLE001
            if args.device == "cpu":
                raise
            row.update(status=status_of(e), notes=format_error(e))
            if rank == 0 and not is_oom(e):
                traceback.print_exc()
        add(row)
        cleanup()
        if row["status"] != "ok":
            break
        if args.find_max and i == len(seqlens) - 1 and s * 2 <= args.max_seqlen:
            seqlens.append(s * 2)
        i += 1
    if rank == 0:
        ok = [r["seqlen"] for r in rows if r["status"] == "ok"]
        print(f"longest row trained: {fmt_len(max(ok)) if ok else 'none'} -> {os.path.join(out_dir, 'train.csv')}")
    return rows


# --------------------------------------------------------------------------------------------


def build_parser():
    p = argparse.ArgumentParser(prog="bench_cp.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, func in (("attn", bench_attn), ("train", bench_train)):
        s = sub.add_parser(name)
        s.set_defaults(func=func)
        s.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
        s.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU dry run")
        s.add_argument("--nproc", type=int, default=2, help="processes to spawn when not under torchrun")
        s.add_argument("--dtype", default="bf16", choices=list(DTYPES))
        s.add_argument("--align", type=int, default=128, help="chunk granularity of all-gather-KV")
        s.add_argument("--timeout", type=int, default=300, help="seconds before a stuck collective aborts")
        s.add_argument("--out", default=None, help="results folder (default runs/cp)")
        s.add_argument("--seed", type=int, default=0)
        if name == "attn":
            s.add_argument("--families", default="causal_document,share_question")
            s.add_argument("--seqlens", default="128k,256k,512k,1024k")
            s.add_argument("--modes", default="fwd,fwdbwd")
            s.add_argument("--cp-modes", default="allgather_kv,ulysses")
            s.add_argument("--heads", type=int, default=16)
            s.add_argument("--kv-heads", type=int, default=16)
            s.add_argument("--head-dim", type=int, default=128)
            s.add_argument("--reps", type=int, default=3, help="timed calls per point up to --warmup-below")
            s.add_argument("--warmup-below", type=int, default=256 * 1024,
                           help="longer sequences: no warmup call (after the first point) and one timed call")
            s.add_argument("--max-seconds", type=float, default=60.0, help="stop repeating a point after this")
            s.add_argument("--flashmask-backend", default="cuda", choices=["cuda", "auto", "reference"])
        else:
            s.add_argument("--cp", type=int, default=None, help="context-parallel size (default: all processes)")
            s.add_argument("--cp-mode", default="allgather_kv", choices=["allgather_kv", "ulysses"])
            s.add_argument("--model-size", default="0.5b", choices=list(MODELS))
            s.add_argument("--arch", default="llama", choices=["llama", "qwen2"])
            s.add_argument("--seqlens", default="256k", help="tokens per packed row (all ranks of a cp group)")
            s.add_argument("--find-max", action="store_true", help="double the row until a step fails")
            s.add_argument("--max-seqlen", type=int, default=8 << 20)
            s.add_argument("--steps", type=int, default=3)
            s.add_argument("--warmup-steps", type=int, default=1)
            s.add_argument("--offload", nargs="?", const="on", default="off", choices=["off", "on", "auto"],
                           help="activation checkpoints in pinned host memory (auto: only where the checkpoints "
                                "of all layers would take more than a quarter of the GPU)")
            s.add_argument("--loss-chunk", type=int, default=8192, help="tokens per chunk of the LM loss")
            s.add_argument("--mlp-chunk", type=int, default=None,
                           help="tokens per chunk of every layer's MLP, each chunk checkpointed, so that no "
                                "[S, intermediate] temporaries exist (the local tokens under CP); 0: off; "
                                "default: 65536 with --offload on/auto, else off")
            s.add_argument("--doc-len", default="128,4096")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    args.seqlens = parse_int_list(args.seqlens)
    if args.cmd == "attn":
        args.families = parse_choice_list(args.families, __import__("masks").FAMILIES, "families")
        args.modes = parse_choice_list(args.modes, ("fwd", "fwdbwd"), "modes")
        args.cp_modes = parse_choice_list(args.cp_modes, ("allgather_kv", "ulysses"), "cp modes")
        if args.tiny:
            args.seqlens, args.heads, args.kv_heads, args.head_dim, args.align = [256], 4, 2, 16, 8
            args.reps, args.flashmask_backend = 1, "reference" if args.device == "cpu" else args.flashmask_backend
    else:
        args.doc_len = parse_int_list(args.doc_len)
        if args.tiny:
            args.model_size, args.seqlens, args.align, args.steps, args.doc_len = "tiny", [128], 8, 2, [8, 40]
            args.loss_chunk = 32
        if args.mlp_chunk is None:  # chunking pays where the offload already made room for long rows
            from flashmask.checkpointing import MLP_CHUNK_TOKENS
            args.mlp_chunk = MLP_CHUNK_TOKENS if args.offload != "off" else 0
        if args.mlp_chunk < 0:
            raise SystemExit(f"--mlp-chunk must be >= 0 (0: off), got {args.mlp_chunk}")
        nproc = int(os.environ.get("WORLD_SIZE", args.nproc))
        args.cp = nproc if args.cp is None else args.cp
        if args.cp == 1 and "WORLD_SIZE" not in os.environ:
            args.nproc = 1
    if args.device == "cpu" and args.dtype == "bf16":
        args.dtype = "fp32"
    return args


def main(argv=None):
    args = parse_args(argv)
    # every process, before any work: an existing results file this run cannot append to stops it
    check_results(args.out or default_out_dir("cp"), args.cmd,
                  ATTN_FIELDS if args.cmd == "attn" else TRAIN_FIELDS)
    launch(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
