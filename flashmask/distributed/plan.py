"""What a rank needs to run context-parallel attention on its share of a sequence.

A :class:`ContextParallelPlan` is made once per batch (the mask is the same in every layer) by
:func:`make_plan` and then used by every attention call of the step:

* ``mode="ulysses"``: rank ``r`` holds the contiguous rows ``[r * S / P, (r + 1) * S / P)``;
  the global mask is used unchanged (each rank sees the whole sequence for its heads).
* ``mode="allgather_kv"``: rank ``r`` holds the chunks that :func:`balance_chunks` gave it,
  concatenated in ascending order; the plan keeps, for each of them, the chunk's mask (the
  global column intervals restricted to the chunk's rows, :func:`slice_rows`) with its columns
  put in the order in which the all-gather lays out the keys (rank 0's tokens, rank 1's, ...), so
  that the gathered K/V need no reordering.

``local_index`` (int64 ``[S / P]``) is the global position of each local token: shard any
per-token tensor (input ids, position ids, shifted labels) with ``x[:, plan.local_index]``
(:meth:`ContextParallelPlan.shard`), and position ids stay global, so RoPE is right.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch

from flashmask.distributed import _comm
from flashmask.distributed.balance import Balance, balance_chunks
from flashmask.distributed.intervals import slice_rows
from masks.convert import merge_chunks, merge_window, window_to_startend
from masks.format import check_tensor as check_mask_tensor
from masks.packed import document_starts, from_starts

MODES = ("ulysses", "allgather_kv")

__all__ = ["ContextParallelPlan", "make_plan", "MODES"]


@dataclass
class ContextParallelPlan:
    """See the module docstring. Build it with :func:`make_plan`.

    Attributes:
        mode: ``"ulysses"`` or ``"allgather_kv"``.
        group: the context-parallel process group (``None``: the default group).
        world, rank: its size and this rank's index in it.
        seqlen: the global ``S`` (queries = keys).
        causal: the flag the global mask is read with.
        startend_row_indices: the global mask ``[B, Hm, S, C]`` or ``None``.
        local_index: int64 ``[S / world]``: global position of each local token.
        balance: the chunking (all-gather-KV only).
        chunks: ``(lo, hi, r0, r1)`` per own chunk: local rows ``[lo, hi)`` are global rows
            ``[r0, r1)`` (all-gather-KV only).
        chunk_masks: the non-causal mask of each own chunk, columns in all-gather order
            (``None`` where no mask is needed).
        position_ids: the batch's global ``[B, S]`` position ids where known
            (:func:`~flashmask.distributed.shard_packed_batch` sets them), to check that a sliding
            window means the same in positions as in token indices; else ``None``.
    """

    mode: str
    group: Optional[object]
    world: int
    rank: int
    seqlen: int
    causal: bool
    startend_row_indices: Optional[torch.Tensor]
    local_index: torch.Tensor
    balance: Optional[Balance] = None
    chunks: List[Tuple[int, int, int, int]] = field(default_factory=list)
    chunk_masks: List[Optional[torch.Tensor]] = field(default_factory=list)
    position_ids: Optional[torch.Tensor] = None
    _windowed: Dict[tuple, "ContextParallelPlan"] = field(default_factory=dict, repr=False, compare=False)

    @property
    def local_len(self) -> int:
        return self.seqlen // self.world

    @property
    def imbalance(self) -> float:
        """Attention work of the busiest rank over the mean (1.0 for Ulysses: every rank
        computes all rows for its share of the heads)."""
        return 1.0 if self.balance is None else self.balance.imbalance

    def to(self, device) -> "ContextParallelPlan":
        """Move the plan's masks and indices to ``device`` (in place; returns the plan). The
        attention calls do this on their first call with tensors on another device."""
        device = torch.device(device)
        move = lambda t: None if t is None else t.to(device)
        if self.local_index.device != device:
            self.local_index = self.local_index.to(device)
        if self.startend_row_indices is not None and self.startend_row_indices.device != device:
            self.startend_row_indices = move(self.startend_row_indices)
        self.chunk_masks = [m if m is None or m.device == device else move(m) for m in self.chunk_masks]
        if self.position_ids is not None and self.position_ids.device != device:
            self.position_ids = move(self.position_ids)
        return self

    def windowed(self, window_size: Tuple[int, int], batch_size: int = 1) -> "ContextParallelPlan":
        """This plan under its mask intersected with the flash-attn window ``window_size``
        (``(left, right)``, ``-1`` unbounded; :func:`masks.merge_window`), for the sliding-window
        layers of a model: the same ranks hold the same tokens, so only the masks change (the
        chunks were balanced for the plan's own mask; ``imbalance`` counts the window's work).
        ``batch_size`` is the mask's batch where the plan has no mask. Made once per window and
        kept; raises ``ValueError`` where the window and a C=2 causal or C=4 mask together need
        more column intervals than the mask has."""
        key = ("window", int(window_size[0]), int(window_size[1]), int(batch_size))

        def mask(m):
            if m is None:
                return window_to_startend(key[1:3], self.seqlen, self.seqlen, self.causal, batch_size=key[3],
                                          device=self.local_index.device)
            return merge_window(m, self.causal, key[1:3], self.seqlen)

        return self._restricted(key, mask)

    def chunked(self, chunk_size: int, batch_size: int = 1) -> "ContextParallelPlan":
        """This plan under its mask intersected with chunked attention (Llama 4's
        ``attention_chunk_size``; :func:`masks.merge_chunks`): chunks of ``chunk_size`` positions,
        counted from each document's first token by the plan's ``position_ids`` (from the row's
        first token where it has none). As :meth:`windowed` otherwise: the same sharding, made once
        per chunk size and kept; ``ValueError`` for a non-causal plan or a C=2 mask whose columns
        the chunks cut into more runs than it has."""
        if not self.causal:
            raise ValueError("chunked attention needs a causal plan (causal=True)")
        key = ("chunk", int(chunk_size), int(batch_size))

        def mask(m):
            pos = self.position_ids
            if m is None and pos is None:
                pos = torch.arange(self.seqlen, device=self.local_index.device).expand(key[2], -1)
            if m is not None and pos is not None:
                # A chunk is counted along the rows that see a key: their positions must go on from
                # the key's, which a DPO answer whose positions continue from the prompt breaks.
                doc_end = from_starts(document_starts(pos.to(m.device)), True)[..., 0]
                if m.shape[-1] != 1 or bool((m[..., 0] > doc_end).any()):
                    raise ValueError("chunked attention needs a causal document mask (C=1) whose keys are seen only "
                                     "by rows of their own document in position_ids (no position jump)")
            return merge_chunks(m, key[1], self.seqlen, pos)

        return self._restricted(key, mask)

    def _restricted(self, key: tuple, mask) -> "ContextParallelPlan":
        """The plan with ``mask(its mask)`` as its mask (kept under ``key``): the chunk masks and
        the balance's work recounted, the sharding unchanged."""
        if key not in self._windowed:
            m = mask(self.startend_row_indices)
            bal, chunk_masks = self.balance, []
            if bal is not None:
                bal = bal.under(m, self.causal)
                chunk_masks = _chunk_masks(m, self.causal, self.seqlen, bal, self.rank)
            self._windowed[key] = replace(self, startend_row_indices=m, balance=bal, chunk_masks=chunk_masks,
                                          _windowed={})
        return self._windowed[key]

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a per-token tensor whose ``dim`` has length ``S``."""
        if x.shape[dim] != self.seqlen:
            raise ValueError(f"cannot shard a tensor with {x.shape[dim]} tokens in dim {dim}: the plan is for "
                             f"S={self.seqlen}")
        return x.index_select(dim, self.local_index.to(x.device))

    def unshard(self, x_local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Gather every rank's ``x_local`` (``S / world`` tokens in ``dim``) into the global order
        (a collective: every rank must call it). Not differentiable; for checks and outputs."""
        n = self.local_len
        if x_local.shape[dim] != n:
            raise ValueError(f"x_local has {x_local.shape[dim]} tokens in dim {dim}, the plan gives {n} per rank")
        xs = x_local.movedim(dim, 0).contiguous()
        buf = xs.new_empty((self.world * n,) + tuple(xs.shape[1:]))
        _comm.all_gather(buf, xs, self.group)
        order = (torch.arange(self.seqlen) if self.balance is None else self.balance.gather_order()).to(buf.device)
        out = torch.empty_like(buf)
        out[order] = buf
        return out.movedim(0, dim)

    def describe(self) -> str:
        s = f"{self.mode} over {self.world} ranks, S={self.seqlen}, {self.local_len} tokens per rank"
        if self.balance is not None:
            b = self.balance
            s += (f", {b.num_chunks} chunks of {b.chunk_size} ({b.strategy}), rank {self.rank} has "
                  f"{self.balance.assignment[self.rank]}, work per rank {b.work.tolist()}, imbalance {b.imbalance:.3f}")
        return s


def make_plan(startend_row_indices: Optional[torch.Tensor], causal: bool, seqlen: Optional[int] = None, *,
              group=None, mode: str = "allgather_kv", num_chunks: Optional[int] = None, align: int = 128,
              strategy: str = "greedy") -> ContextParallelPlan:
    """The plan of this rank for a self-attention of ``S`` tokens under a global mask.

    Args:
        startend_row_indices: int32 ``[B, Hm, S, C]`` (every rank passes the same), or ``None``.
        causal: as for :func:`flashmask.flashmask_attention`.
        seqlen: ``S``; defaults to the mask's.
        group: the context-parallel process group (``None``: the default group, or a single
            process if torch.distributed is not initialised).
        mode: ``"allgather_kv"`` (default) or ``"ulysses"``.
        num_chunks, align, strategy: the chunking of all-gather-KV (see :func:`balance_chunks`).

    Example (2 ranks, causal document mask)::

        plan = make_plan(masks.causal_document(8192, [5000, 3192]), True, group=cp_group)
        out_local = context_parallel_attention(q_local, k_local, v_local, plan)

    Raises ``ValueError`` if ``S`` is not a multiple of ``world`` (Ulysses) or of
    ``num_chunks * align`` (all-gather-KV).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if startend_row_indices is not None:
        check_mask_tensor(startend_row_indices)
        sk = startend_row_indices.shape[2]
        if seqlen is not None and int(seqlen) != sk:
            raise ValueError(f"seqlen={seqlen} but the mask has Sk={sk}")
        seqlen = sk
    if seqlen is None:
        raise ValueError("seqlen is required when startend_row_indices is None")
    seqlen = int(seqlen)
    world, rank = _comm.world_and_rank(group)
    dev = startend_row_indices.device if startend_row_indices is not None else None
    if mode == "ulysses":
        if seqlen % world:
            raise ValueError(f"Ulysses needs S={seqlen} to be a multiple of the group size {world}: pad the batch "
                             f"(flashmask.distributed.pad_packed_batch)")
        n = seqlen // world
        return ContextParallelPlan(mode, group, world, rank, seqlen, bool(causal), startend_row_indices,
                                   torch.arange(rank * n, (rank + 1) * n, device=dev))
    bal = balance_chunks(startend_row_indices, causal, seqlen, world, num_chunks, align, strategy)
    chunks, lo = [], 0
    for r0, r1 in bal.bounds(rank):
        chunks.append((lo, lo + r1 - r0, r0, r1))
        lo += r1 - r0
    return ContextParallelPlan(mode, group, world, rank, seqlen, bool(causal), startend_row_indices,
                               bal.indices(rank, dev), bal, chunks,
                               _chunk_masks(startend_row_indices, causal, seqlen, bal, rank))


def _chunk_masks(mask: Optional[torch.Tensor], causal: bool, seqlen: int, bal: Balance,
                 rank: int) -> List[Optional[torch.Tensor]]:
    """The mask of each of ``rank``'s chunks (its rows, non-causal), columns in all-gather order."""
    dev = None if mask is None else mask.device
    order = bal.gather_order(dev)
    out = []
    for r0, r1 in bal.bounds(rank):
        m = slice_rows(mask, causal, r0, r1, seqlen, seqlen, device=dev)
        out.append(None if m is None else m.index_select(2, order.to(m.device)).contiguous())
    return out
