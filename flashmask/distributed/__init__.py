"""Context-parallel FlashMask attention on torch.distributed (NCCL on GPUs, gloo on CPUs).

Two modes, both exact (the same rows as one process, up to rounding) and differentiable:

* **Ulysses** (:func:`ulysses_attention`): an all-to-all between sequence and heads; each rank
  sees the whole sequence for ``H / P`` heads and uses the mask unchanged. Needs ``Hq``
  divisible by the group size (KV heads are repeated when ``Hk`` is not).
* **All-gather-KV** (:func:`allgather_kv_attention`): queries sharded in chunks that a balancer
  assigns by unmasked work (:func:`balance_chunks`), K/V all-gathered (overlapped with compute
  per head group), dK/dV reduce-scattered in the backward; each chunk runs the unchanged
  kernels with the column intervals restricted to its rows (:func:`slice_rows`). Works for any
  head counts.

Typical use, once per batch and then in every layer::

    from flashmask import distributed as fmd
    local, plan = fmd.shard_packed_batch(batch, group=cp_group, mode="allgather_kv")
    out = fmd.context_parallel_attention(q_local, k_local, v_local, plan)

Also: :mod:`flashmask.distributed.hf` (a transformers attention backend, ``"fm_cp"``) and
:mod:`flashmask.distributed.fsdp` (2-D DeviceMesh, FSDP2 ``fully_shard`` per layer, the LM loss
of a context-parallel rank). Neither is imported here (they need transformers / FSDP2).
"""
from flashmask.distributed.allgather_kv import allgather_kv_attention
from flashmask.distributed.balance import Balance, balance_chunks
from flashmask.distributed.intervals import block_pairs, slice_rows, visible_pairs
from flashmask.distributed.plan import MODES, ContextParallelPlan, make_plan
from flashmask.distributed.sharding import (
                                            IGNORE_INDEX,
                                            MASK_KEY,
                                            context_parallel_attention,
                                            document_mask_from_position_ids,
                                            pad_packed_batch,
                                            shard_packed_batch,
                                            shift_labels,
)
from flashmask.distributed.ulysses import ulysses_attention, ulysses_heads

__all__ = ["allgather_kv_attention", "ulysses_attention", "ulysses_heads", "context_parallel_attention",
           "make_plan", "ContextParallelPlan", "MODES", "balance_chunks", "Balance", "slice_rows", "visible_pairs",
           "block_pairs", "shard_packed_batch", "pad_packed_batch", "shift_labels", "document_mask_from_position_ids",
           "MASK_KEY", "IGNORE_INDEX"]
