"""Split the query rows into chunks and give every rank chunks of equal total work.

Equal rows are not equal work: under a causal mask the last rows see every key and the first
almost none; documents and share-question layouts skew it further. :func:`balance_chunks` cuts
the ``S`` rows into ``num_chunks`` chunks of equal length (a multiple of ``align``, the kernels'
tile), counts each chunk's unmasked pairs exactly from the column intervals
(:func:`flashmask.distributed.intervals.block_pairs`, O(num_chunks * S)), and assigns the
chunks to the ranks so that

* every rank gets ``num_chunks / world`` chunks, hence the same number of tokens (the linear
  layers, norms and MLPs cost per token; collectives need equal sizes), and
* the attention work per rank is as even as the chunks allow: ``"greedy"`` takes the chunks
  heaviest first and gives each to the least-loaded rank that still has room (for a causal mask
  with ``2 * world`` chunks this is the zigzag pairing ``(c, 2 * world - 1 - c)``, exactly even).
  A local search then swaps chunks between the busiest rank and the others while that helps,
  and the best of that and the refined zigzag / contiguous layouts is kept, so ``"greedy"`` is
  never worse than either. ``"zigzag"`` and ``"contiguous"`` are the fixed layouts, for
  comparison.

Example::

    >>> b = balance_chunks(None, True, seqlen=1024, world=2, num_chunks=4, align=128)
    >>> b.assignment, b.work.tolist(), round(b.imbalance, 3)
    ([[0, 3], [1, 2]], [262400, 262400], 1.0)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import torch

from flashmask.distributed.intervals import block_pairs

STRATEGIES = ("greedy", "zigzag", "contiguous")

__all__ = ["Balance", "balance_chunks", "STRATEGIES"]


@dataclass
class Balance:
    """Chunks of query rows and their owners.

    Attributes:
        chunk_size: rows per chunk; chunk ``c`` is rows ``[c * chunk_size, (c + 1) * chunk_size)``.
        assignment: ``assignment[r]``: the chunks of rank ``r``, ascending.
        chunk_work: int64 ``[num_chunks]``: unmasked pairs of each chunk (summed over batch and
            mask heads).
        work: int64 ``[world]``: unmasked pairs of each rank.
        imbalance: ``max(work) / mean(work)`` (1.0 = perfectly even; 1.0 when there is no work).
    """

    seqlen: int
    world: int
    chunk_size: int
    assignment: List[List[int]]
    chunk_work: torch.Tensor
    work: torch.Tensor
    imbalance: float
    strategy: str

    @property
    def num_chunks(self) -> int:
        return self.seqlen // self.chunk_size

    def bounds(self, rank: int) -> List[Tuple[int, int]]:
        """The global row ranges ``(r0, r1)`` of ``rank``'s chunks, in its local order."""
        return [(c * self.chunk_size, (c + 1) * self.chunk_size) for c in self.assignment[rank]]

    def indices(self, rank: int, device=None) -> torch.Tensor:
        """int64 ``[S / world]``: the global token index of each of ``rank``'s local tokens."""
        parts = [torch.arange(r0, r1, device=device) for r0, r1 in self.bounds(rank)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)

    def under(self, startend_row_indices: Optional[torch.Tensor], causal: bool) -> "Balance":
        """The same chunks and owners, their work counted under another mask (e.g. the plan's mask
        with a sliding window merged in)."""
        work = _chunk_work(startend_row_indices, causal, self.seqlen, self.num_chunks)
        rank_work, imbalance = _rank_work(work, self.assignment)
        return replace(self, chunk_work=work, work=rank_work, imbalance=imbalance)

    def gather_order(self, device=None) -> torch.Tensor:
        """int64 ``[S]``: the global index of every position of an all-gather of the local
        shards (rank 0's tokens, then rank 1's, ...)."""
        return torch.cat([self.indices(r, device) for r in range(self.world)])


def default_num_chunks(seqlen: int, world: int, align: int) -> int:
    """``2 * world`` chunks (the zigzag layout), fewer only if the rows do not allow it."""
    for k in (2, 1):
        if seqlen % (k * world * align) == 0:
            return k * world
    raise ValueError(f"seqlen={seqlen} is not a multiple of world * align = {world} * {align}: pad the batch "
                     f"(flashmask.distributed.pad_packed_batch) or choose a smaller align")


#: Chunks per rank that ``num_chunks=None`` tries, fewest first (fewer chunks: fewer, larger kernel calls).
AUTO_CHUNKS_PER_RANK = (2, 4, 8)


def balance_chunks(startend_row_indices: Optional[torch.Tensor], causal: bool, seqlen: int, world: int,
                   num_chunks: Optional[int] = None, align: int = 128, strategy: str = "greedy",
                   target_imbalance: float = 1.02) -> Balance:
    """Chunk the ``seqlen`` query rows of a self-attention and assign them to ``world`` ranks.

    Args:
        startend_row_indices: the global mask, int32 ``[B, Hm, S, C]`` or ``None``.
        causal: the causal flag the mask is read with.
        seqlen: ``S`` (queries and keys).
        world: number of ranks.
        num_chunks: a multiple of ``world`` dividing ``S`` into chunks whose length is a multiple
            of ``align``. Default: the fewest of ``2, 4, 8`` chunks per rank (those ``S`` allows)
            whose imbalance is at most ``target_imbalance``, else the most even of them. More
            chunks balance irregular masks better at the cost of more kernel calls per layer.
        align: chunk length granularity (128: the kernels' tile rows).
        strategy: ``"greedy"`` (default), ``"zigzag"`` (needs ``num_chunks == 2 * world``) or
            ``"contiguous"``.
        target_imbalance: see ``num_chunks``.

    Raises ``ValueError`` naming the constraint that does not hold.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    seqlen, world, align = int(seqlen), int(world), int(align)
    if world < 1 or align < 1 or seqlen < 1:
        raise ValueError(f"need seqlen, world and align >= 1, got {seqlen}, {world}, {align}")
    if startend_row_indices is not None and startend_row_indices.shape[2] != seqlen:
        raise ValueError(f"the mask has Sk={startend_row_indices.shape[2]} columns but seqlen={seqlen}")
    if num_chunks is None:
        # The fewest chunks that balance to within target_imbalance (else the best of them).
        per = (2,) if strategy == "zigzag" else AUTO_CHUNKS_PER_RANK
        tries = [k * world for k in per if seqlen % (k * world * align) == 0]
        if not tries:
            tries = [default_num_chunks(seqlen, world, align)]
        best = None
        for n in tries:
            b = balance_chunks(startend_row_indices, causal, seqlen, world, n, align, strategy)
            if best is None or b.imbalance < best.imbalance - 1e-12:
                best = b
            if b.imbalance <= target_imbalance:
                return b
        return best
    num_chunks = int(num_chunks)
    if num_chunks < world or num_chunks % world:
        raise ValueError(f"num_chunks={num_chunks} must be a positive multiple of the world size {world}")
    if seqlen % num_chunks or (seqlen // num_chunks) % align:
        raise ValueError(f"seqlen={seqlen} must split into num_chunks={num_chunks} chunks whose length is a multiple "
                         f"of align={align} (seqlen a multiple of {num_chunks * align}); pad the batch "
                         f"(flashmask.distributed.pad_packed_batch)")
    size = seqlen // num_chunks
    per_rank = num_chunks // world
    work = _chunk_work(startend_row_indices, causal, seqlen, num_chunks)
    if strategy == "contiguous":
        assignment = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(world)]
    elif strategy == "zigzag":
        if num_chunks != 2 * world:
            raise ValueError(f"strategy='zigzag' needs num_chunks = 2 * world = {2 * world}, got {num_chunks}")
        assignment = [[r, num_chunks - 1 - r] for r in range(world)]
    else:
        w = work.tolist()
        starts = [_greedy(w, world, per_rank), [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(world)]]
        if per_rank == 2:
            starts.append([[r, num_chunks - 1 - r] for r in range(world)])
        assignment = min((_refine(a, w) for a in starts), key=lambda a: max(sum(w[c] for c in x) for x in a))
    rank_work, imbalance = _rank_work(work, assignment)
    return Balance(seqlen, world, size, assignment, work, rank_work, imbalance, strategy)


def _chunk_work(startend_row_indices: Optional[torch.Tensor], causal: bool, seqlen: int,
                num_chunks: int) -> torch.Tensor:
    """int64 ``[num_chunks]``: the unmasked pairs of each of ``num_chunks`` equal chunks of rows."""
    size = seqlen // num_chunks
    return block_pairs(startend_row_indices, causal, [(c * size, (c + 1) * size) for c in range(num_chunks)],
                       seqlen, seqlen)


def _rank_work(chunk_work: torch.Tensor, assignment: List[List[int]]) -> Tuple[torch.Tensor, float]:
    """Each rank's work (the sum of its chunks') and the imbalance, max over mean (1.0 without work)."""
    rank_work = torch.stack([chunk_work[a].sum() for a in assignment])
    mean = rank_work.double().mean().item()
    return rank_work, (rank_work.max().item() / mean if mean > 0 else 1.0)


def _refine(assignment: List[List[int]], work: List[int], max_rounds: int = 1000) -> List[List[int]]:
    """Swap single chunks between the busiest rank and another while that lowers the larger of
    the two loads (a local search after the greedy start; the chunk counts stay equal)."""
    owned = [list(a) for a in assignment]
    load = [sum(work[c] for c in a) for a in owned]
    for _ in range(max_rounds):
        hi = max(range(len(owned)), key=lambda r: (load[r], -r))
        best = None  # (new max of the pair, rank, index in hi, index in rank)
        for r in range(len(owned)):
            if r == hi:
                continue
            for i, a in enumerate(owned[hi]):
                for j, b in enumerate(owned[r]):
                    d = work[a] - work[b]
                    if d <= 0:
                        continue
                    pair = max(load[hi] - d, load[r] + d)
                    if pair < load[hi] and (best is None or pair < best[0]):
                        best = (pair, r, i, j)
        if best is None:
            break
        _, r, i, j = best
        a, b = owned[hi][i], owned[r][j]
        owned[hi][i], owned[r][j] = b, a
        load[hi] += work[b] - work[a]
        load[r] += work[a] - work[b]
    return [sorted(a) for a in owned]


def _greedy(work: List[int], world: int, per_rank: int) -> List[List[int]]:
    """Longest-processing-time first with a cardinality limit: heaviest chunk to the least-loaded
    rank that has fewer than ``per_rank`` chunks (ties: the lower rank; among equal chunks the
    earlier one first)."""
    order = sorted(range(len(work)), key=lambda c: (-work[c], c))
    load = [0] * world
    owned: List[List[int]] = [[] for _ in range(world)]
    for c in order:
        r = min((r for r in range(world) if len(owned[r]) < per_rank), key=lambda r: (load[r], r))
        owned[r].append(c)
        load[r] += work[c]
    return [sorted(a) for a in owned]
