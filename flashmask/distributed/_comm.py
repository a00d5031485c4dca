"""The few torch.distributed (c10d) collectives context parallelism uses, behind one interface.

NCCL on GPUs and gloo on CPUs both implement them in torch >= 2.6; the only alternative paths
are for a process group that raises "not supported" for the tensor forms (older gloo builds had
no ``reduce_scatter``): ``reduce_scatter`` then falls back to ``all_reduce`` + slicing and
``all_gather`` to the list form. A world of one rank (or no initialised process group with
``group=None``) needs no communication at all.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["world_and_rank", "all_gather", "reduce_scatter", "all_to_all", "Done"]


class Done:
    """A finished "work" handle (for a world of one, or a fallback that ran synchronously)."""

    def wait(self):
        return True


def world_and_rank(group: Optional["dist.ProcessGroup"]) -> Tuple[int, int]:
    """``(size, rank)`` of ``group``; ``(1, 0)`` when no process group is initialised and ``group`` is None."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


_all_gather_op = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
_reduce_scatter_op = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
_unsupported: set = set()  # (op, backend) pairs that raised "not supported" once


def _backend(group) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:  # pragma: no cover
        return "?"


def _not_supported(e: Exception) -> bool:
    msg = str(e).lower()
    return isinstance(e, (NotImplementedError, AttributeError)) or "not supported" in msg or "does not support" in msg


def _native(name: str, op, out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    """Runs the tensor form ``op`` of collective ``name``; ``(True, its handle)``, or ``(False, None)``
    where the group's backend does not support it (remembered: later calls go to the fallback)."""
    key = (name, _backend(group))
    if key in _unsupported or op is None:
        return False, None
    try:
        return True, op(out, inp, group=group, async_op=async_op)
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        if not _not_supported(e):
            raise
        _unsupported.add(key)
        return False, None


def all_gather(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``out [world * n, ...] = cat(inp of every rank)`` along dim 0; ``inp`` contiguous ``[n, ...]``."""
    world, _ = world_and_rank(group)
    if world == 1:
        out.copy_(inp)
        return Done() if async_op else None
    ran, work = _native("all_gather", _all_gather_op, out, inp, group, async_op)
    if ran:
        return work
    dist.all_gather(list(out.chunk(world)), inp, group=group)
    return Done() if async_op else None


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``out [n, ...] = sum over ranks of inp[rank * n:(rank + 1) * n]``; ``inp`` contiguous ``[world * n, ...]``."""
    world, rank = world_and_rank(group)
    if world == 1:
        out.copy_(inp)
        return Done() if async_op else None
    ran, work = _native("reduce_scatter", _reduce_scatter_op, out, inp, group, async_op)
    if ran:
        return work
    full = inp.clone()
    dist.all_reduce(full, group=group)
    out.copy_(full.chunk(world)[rank])
    return Done() if async_op else None


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    """``out[r] = inp[rank]`` of rank ``r``: both contiguous ``[world, ...]`` (equal splits)."""
    world, _ = world_and_rank(group)
    if world == 1:
        out.copy_(inp)
        return
    dist.all_to_all_single(out, inp, group=group)
