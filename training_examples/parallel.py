"""Several processes (``torchrun --nproc-per-node N``): each one's device, the process group and the
``(dp, cp)`` DeviceMesh (FSDP2 over all ranks, each packed row split over the ``cp`` ranks of its
group), the rows of each data-parallel group, the context-parallel sharding of a batch, and the
reductions the examples log. With one process all of it reduces to plain calls."""
from __future__ import annotations

import gc
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Sequence, Tuple

import torch

from training_examples.records import DataError

if TYPE_CHECKING:
    from training_examples.packing import PackedStream


def env_world_size() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_device_dtype(args) -> None:
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.device.type == "cuda":
        if args.device.index is None:  # under torchrun: one GPU per process
            index = int(os.environ.get("LOCAL_RANK", "0")) if env_world_size() > 1 else torch.cuda.current_device()
            args.device = torch.device("cuda", index)
        torch.cuda.set_device(args.device)
    if args.dtype is None:
        args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)


@dataclass
class Parallel:
    """Where this process stands. ``world == 1``: one process, nothing distributed. Otherwise
    ``world = dp x cp`` ranks on the DeviceMesh ``mesh`` (dimensions ``"dp"``, ``"cp"``): the ``cp``
    ranks ``[k * cp, (k + 1) * cp)`` share one batch (context-parallel ``group``, attention
    ``mode``), the ``dp`` groups see different batches, and FSDP2 shards the parameters over all."""

    rank: int = 0
    world: int = 1
    cp: int = 1
    mode: str = "allgather_kv"
    mesh: object = None
    group: object = None
    device_type: str = "cpu"  # of every rank: "cuda" (one GPU each) or "cpu"

    @property
    def dp(self) -> int:
        return self.world // self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def per_rank(self) -> str:
        """What one rank is, for per-rank numbers: ``"GPU"``, or ``"process"`` on the CPU."""
        return "GPU" if self.device_type == "cuda" else "process"

    def describe(self) -> str:
        if not self.distributed:
            return "1 process"
        cp = f" {self.mode}" if self.cp > 1 else ""
        return f"{self.world} processes, dp={self.dp} x cp={self.cp}{cp}, FSDP2"


def init_parallel(args) -> Parallel:
    """Under torchrun (``WORLD_SIZE`` > 1): the process group (NCCL on GPUs, gloo on the CPU) and the
    ``(dp, cp)`` mesh; else a one-process :class:`Parallel`. Call after :func:`resolve_device_dtype`."""
    world = env_world_size()
    if world == 1:
        return Parallel()
    import torch.distributed as dist

    from flashmask.distributed import fsdp as fm_fsdp

    if not dist.is_initialized():
        if args.device.type == "cuda":
            dist.init_process_group("nccl", device_id=args.device)
        else:
            dist.init_process_group("gloo")
    mesh = fm_fsdp.init_mesh(world // args.cp, args.cp, device_type=args.device.type)
    mode = args.cp_mode if args.cp > 1 else "ulysses"  # a group of one: plain attention, no padding
    return Parallel(dist.get_rank(), world, args.cp, mode, mesh, fm_fsdp.cp_group(mesh), args.device.type)


def finish_parallel(par: Parallel) -> None:
    """Tears the process groups down (call it in a ``finally``). After a clean run the ranks first
    wait for each other, through a barrier and then through the rendezvous store: a gloo rank that
    tore its groups down while a peer was still finishing the last collective (the barrier itself,
    too) aborted that peer at exit (SIGABRT, "terminate called without an active exception"). The
    store is not one of the groups' connections, so once every rank has counted itself there none
    is in flight. After an error there is no wait: a peer may be gone. Reference cycles are collected
    first, while the interpreter is whole: a collective's work object freed during interpreter
    shutdown can abort the process."""
    if par.distributed:
        import torch.distributed as dist
        if dist.is_initialized():
            gc.collect()
            if sys.exc_info()[0] is None:
                dist.barrier()
                _wait_for_every_rank(dist, "flashmask/finished")
            dist.destroy_process_group()


def _wait_for_every_rank(dist, key: str, timeout_s: float = 60.0) -> None:
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world and time.monotonic() < deadline:
        time.sleep(0.01)


def run_parallel(args, run):
    """``run(args, par)`` on the device and dtype of ``args``, inside the process groups of
    :func:`init_parallel` (one process: none), which are torn down after it however it ends. Data
    that cannot be read ends the run with one line that says where, not a traceback."""
    resolve_device_dtype(args)
    par = init_parallel(args)
    try:
        return run(args, par)
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    finally:
        finish_parallel(par)


def next_rows(stream: "PackedStream", args, par: Parallel) -> Tuple[List, List]:
    """``(rows of the step, this rank's rows)``: every rank draws the same ``--batch-size x dp`` rows;
    data-parallel group ``k`` takes the ``k``-th ``--batch-size`` of them (its cp ranks alike)."""
    rows = stream.rows(args.batch_size * par.dp)
    i = par.dp_rank * args.batch_size
    return rows, rows[i:i + args.batch_size]


def shard_batch(batch: Dict[str, torch.Tensor], args, par: Parallel):
    """``(local, plan)``: this rank's tokens of a packed batch and the attention plan of its cp group."""
    from flashmask import distributed as fmd
    return fmd.shard_packed_batch(batch, group=par.group, mode=par.mode, align=args.cp_align)


def parallel_context(plan):
    """``with parallel_context(plan):`` around forward and backward (``nullcontext`` for ``None``)."""
    if plan is None:
        return nullcontext()
    import flashmask.distributed.hf as cp_hf
    return cp_hf.context_parallel(plan)


def all_reduce(t: torch.Tensor, par: Parallel, op: str = "sum", group=None) -> torch.Tensor:
    """``t`` reduced over all ranks (or ``group``); ``op`` "sum" or "max". No-op for one process."""
    if par.distributed:
        import torch.distributed as dist
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t


def dp_mean(values: Sequence[float], par: Parallel, device) -> List[float]:
    """The mean of each value over the data-parallel groups (the same on the ranks of a cp group)."""
    if par.dp == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    all_reduce(t, par)  # every cp rank holds the same values: the sum over all ranks is cp x the dp sum
    return (t / par.world).tolist()
