"""The training loop of the examples (progress, smoothed tokens/s, checkpoints, resuming, loss curve)
and the causal-LM step they share: the chunked LM-head loss, sharded over the context-parallel
ranks with several processes."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple

import torch

from training_examples.checkpoints import restore, save_checkpoint
from training_examples.parallel import Parallel, parallel_context, shard_batch
from training_examples.train_log import LossLog, Throughput, peak_memory, rate_str

if TYPE_CHECKING:
    from training_examples.packing import PackedStream


def to_device(batch: Dict[str, torch.Tensor], device) -> Dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def chunk_size(args) -> int:
    """Tokens per chunk of the LM head (``--loss-chunk``; 0: all in one)."""
    return args.loss_chunk if args.loss_chunk > 0 else 2 ** 62


def causal_lm_loss_one_process(model, batch: Dict[str, torch.Tensor], args) -> torch.Tensor:
    """The mean next-token loss of a collated batch: decoder + chunked LM head (no ``[S, vocab]``
    logits), or the model's own loss with ``--loss-chunk 0``."""
    if args.loss_chunk <= 0:
        return model(**batch, use_cache=False).loss
    from flashmask.losses import causal_lm_loss, decoder_of, final_logit_softcap
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = decoder_of(model)(**inputs, use_cache=False).last_hidden_state
    return causal_lm_loss(hidden, model.get_output_embeddings(), batch["labels"], chunk_size=args.loss_chunk,
                          logit_softcap=final_logit_softcap(model))


def causal_lm_step(model, batch: Dict[str, torch.Tensor], args, par: Parallel) -> torch.Tensor:
    """Forward and backward of the causal-LM loss of a collated packed batch (on the device);
    returns the batch loss (with several processes: summed over cp, averaged over dp) for logging."""
    if not par.distributed:
        loss = causal_lm_loss_one_process(model, batch, args)
        loss.backward()
        return loss.detach()
    from flashmask.distributed import fsdp as fm_fsdp
    local, plan = shard_batch(batch, args, par)
    with parallel_context(plan):
        loss = fm_fsdp.lm_loss(model, local, chunk_size=chunk_size(args))  # this rank's share
        loss.backward()
    return fm_fsdp.reduce_loss(loss, par.mesh)


def train(args, name: str, model, tok, optimizer, stream: PackedStream,
          step_fn: Callable[[int], Tuple[torch.Tensor, int, Dict]],
          describe: Callable[[Dict], str] = lambda extras: "", par: Optional[Parallel] = None) -> Dict:
    """Run the optimizer steps up to ``args.steps`` (from the checkpoint's step with ``--resume``).

    ``step_fn(step)`` takes the next rows from ``stream``, runs forward and backward, and returns
    ``(loss, tokens, extras)``: the batch loss to log (with several processes: of the whole step,
    the same on every rank), the real tokens of the step (all data-parallel groups together) and
    numbers to log (a CSV column each). This loop clips the gradients, steps the optimizer, times
    the step, and shows a progress bar, a log line every ``--log-every`` steps (``describe(extras)``
    adds to it), checkpoints and the loss curve; with several processes rank 0 prints and writes.

    Returns ``{"losses": [...], "first_loss", "last_loss", "tokens_per_s" (all ranks together),
    "tokens_per_s_per_gpu" (per rank), "peak_memory", "checkpoint", "loss_csv", "loss_png", "history"}``; with
    ``--resume`` the losses and history include the earlier steps.
    """
    from tqdm.auto import tqdm

    par = par or Parallel()
    start, history = restore(args.resume, model, optimizer, stream, par) if args.resume else (0, [])
    log, meter = LossLog(args.output_dir if par.main else None, history), Throughput()
    bar = tqdm(total=args.steps, initial=start, desc=name, unit="step", dynamic_ncols=True,
               disable=True if not par.main else {"auto": None, "on": False, "off": True}[args.progress])
    say = bar.write if not bar.disable else (lambda s: print(s, flush=True) if par.main else None)
    if start:
        say(f"resumed from {args.resume} at step {start}")
    if start >= args.steps:  # --steps counts the resumed steps too
        say(f"checkpoint at step {start} >= --steps {args.steps}: nothing to train (raise --steps to go on)")
    t_run = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        loss, tokens, extras = step_fn(step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = float(loss.detach())  # waits for the step to finish
        if args.device.type == "cuda":
            torch.cuda.synchronize(args.device)
        meter.update(tokens, time.perf_counter() - t0)
        rate = meter.rate()
        log.add({"step": step, "loss": loss, **extras, "tokens_per_s": rate,
                 "tokens_per_s_per_gpu": rate / par.world, "elapsed_s": time.perf_counter() - t_run})
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate / par.world:,.0f}", refresh=False)  # per rank
        bar.update(1)
        if step % args.log_every == 0 or step == args.steps:
            more = describe(extras)
            mem = peak_memory(args.device, par)
            say(f"step {step:5d} | loss {loss:.4f} | {more + ' | ' if more else ''}{rate_str(rate, par)} | "
                f"peak mem {mem}")
        if args.output_dir and args.save_every and step % args.save_every == 0 and step < args.steps:
            say(f"saved {save_checkpoint(args.output_dir, step, model, tok, optimizer, stream, log, par)}")
    bar.close()
    checkpoint = None
    if args.output_dir and start < args.steps:
        checkpoint = save_checkpoint(args.output_dir, args.steps, model, tok, optimizer, stream, log, par)
        say(f"saved {checkpoint}")
    log.close()
    png = log.plot(f"{name}: {getattr(args, 'model_desc', '')}")
    if png:
        say(f"loss curve: {log.csv_path}, {png}")
    losses = [r["loss"] for r in log.rows]
    rate = log.rows[-1]["tokens_per_s"] if log.rows else None
    return {"losses": losses, "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "tokens_per_s": rate,
            "tokens_per_s_per_gpu": None if rate is None else rate / par.world,
            "peak_memory": peak_memory(args.device, par), "checkpoint": checkpoint, "loss_csv": log.csv_path,
            "loss_png": png, "history": log.rows}


def report(res: Dict, par: Parallel) -> None:
    """The closing line (rank 0): first and last loss, tokens/s and peak memory (per GPU, or per process on
    the CPU)."""
    if par.main:
        rate = "" if res["tokens_per_s"] is None else f"{rate_str(res['tokens_per_s'], par)}, "
        first = "-" if res["first_loss"] is None else f"{res['first_loss']:.4f}"
        last = "-" if res["last_loss"] is None else f"{res['last_loss']:.4f}"
        print(f"done: loss {first} -> {last}, {rate}peak mem {res['peak_memory']} [{par.describe()}]", flush=True)
