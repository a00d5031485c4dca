"""Context-parallel attention (flashmask.distributed) on the CPU: gloo, 2 and 4 processes, reference path.

Single-process unit tests check the interval slicing against the dense definition
(``masks.to_dense`` of the global mask, row by row), the exact work counts, the balancer and
the batch sharding. The multi-process tests spawn one group of processes per world size, run
every case in it (one spawn, many cases: the start-up dominates) and compare each rank's output
rows and its q/k/v gradient rows with one process's ``flashmask_attention`` on the whole sequence
(float64: to 1e-10; bfloat16: to its rounding). Each case is reported as its own test.
"""
from __future__ import annotations

import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import masks
from flashmask import distributed as fmd
from flashmask import flashmask_attention
from flashmask.distributed.balance import balance_chunks
from flashmask.distributed.intervals import block_pairs, slice_rows, visible_pairs
from masks.examples import example
from masks.format import to_dense
from tests.attn_helpers import random_startend

MODES = [(True, 1), (True, 2), (False, 2), (False, 4)]


# ------------------------------------------------------------------------------------------------
# single process: interval slicing, work counts, balancer, batch helpers


def _dense_rows(mask, causal, sq, sk, r0, r1):
    """The global dense mask's rows [r0, r1), [B, Hm, n, Sk] (or [1, 1, n, Sk] without a mask)."""
    return to_dense(mask, causal, seqlen_q=sq, seqlen_k=sk)[:, :, r0:r1]


@pytest.mark.parametrize("causal,c", MODES + [(True, None), (False, None)])
@pytest.mark.parametrize("sq,sk", [(24, 24), (16, 24), (24, 16)])
def test_slice_rows_matches_dense_rows(causal, c, sq, sk):
    g = torch.Generator().manual_seed(sq * 100 + sk + (c or 0) * 7 + causal)
    mask = None if c is None else random_startend(2, 3, sq, sk, causal, c, generator=g)
    for r0, r1 in [(0, sq), (0, 5), (5, 13), (sq - 7, sq), (7, 7), (3, 4)]:
        local = slice_rows(mask, causal, r0, r1, seqlen_q=sq, seqlen_k=sk)
        want = _dense_rows(mask, causal, sq, sk, r0, r1)
        if local is None:
            assert not causal and c is None
            assert want.all()
            continue
        assert local.dtype == torch.int32 and local.shape[-1] in (2, 4)
        assert int(local.min()) >= 0 and int(local.max()) <= r1 - r0, "values must lie in [0, n]"
        got = to_dense(local, False, seqlen_q=r1 - r0, seqlen_k=sk)
        assert torch.equal(got.expand_as(want), want), (r0, r1)
        # exact work count
        pairs = visible_pairs(local, r1 - r0, sk)
        assert torch.equal(pairs, want.sum((-1, -2)).expand_as(pairs)), (r0, r1)


def test_slice_rows_out_of_range_values_act_clamped():
    # docs/format.md: values outside [0, Sq] act clamped, start > end is empty.
    sq = sk = 12
    raw = torch.tensor([[-3, 20], [5, 2], [13, 15], [0, 0], [4, 30]] + [[12, 12]] * 7, dtype=torch.int32)
    mask = raw.view(1, 1, sk, 2)
    clamped = mask.clamp(0, sq)
    for r0, r1 in [(0, 12), (2, 9), (6, 12)]:
        got = to_dense(slice_rows(mask, True, r0, r1, sq, sk), False, seqlen_q=r1 - r0)
        want = _dense_rows(clamped, True, sq, sk, r0, r1)
        assert torch.equal(got, want)


def test_slice_rows_spec_example_and_errors():
    m = masks.causal_document(10, [4, 3, 3])
    local = slice_rows(m, True, 4, 7)
    assert local[0, 0, :, 0].tolist() == [0, 0, 0, 0, 3, 3, 3, 3, 3, 3]
    assert local[0, 0, :, 1].tolist() == [0, 0, 0, 0, 0, 1, 2, 3, 3, 3]
    with pytest.raises(ValueError, match="r0 <= r1"):
        slice_rows(m, True, 5, 3)
    with pytest.raises(ValueError, match="seqlen_k is required"):
        slice_rows(None, True, 0, 3)


@pytest.mark.parametrize("family", sorted(masks.FAMILIES))
def test_block_pairs_sum_to_the_dense_count(family):
    mask, causal = example(family, 96)
    bounds = [(0, 32), (32, 40), (40, 96)]
    got = block_pairs(mask, causal, bounds)
    dense = to_dense(mask, causal, seqlen_q=96)
    want = torch.stack([dense[:, :, a:b].sum() for a, b in bounds])
    assert torch.equal(got, want)


def test_balancer_causal_is_exactly_even_with_zigzag_chunks():
    for world in (2, 3, 4, 8):
        b = balance_chunks(None, True, seqlen=world * 2 * 128, world=world, align=128)
        assert b.num_chunks == 2 * world
        assert b.imbalance == 1.0
        assert sorted(c for a in b.assignment for c in a) == list(range(2 * world))
        assert all(len(a) == 2 for a in b.assignment)
        assert b.assignment == [[r, 2 * world - 1 - r] for r in range(world)]  # greedy finds the zigzag
        contiguous = balance_chunks(None, True, seqlen=world * 2 * 128, world=world, align=128,
                                    strategy="contiguous")
        assert contiguous.imbalance > 1.3


@pytest.mark.parametrize("family", ["causal", "causal_document", "document", "share_question", "prefix_lm_causal",
                                    "causal_blockwise", "global_sliding_window", "random_eviction"])
@pytest.mark.parametrize("world", [2, 4])
def test_balancer_work_per_rank_within_10_percent(family, world):
    s = 8192
    mask, causal = example(family, s)
    b = balance_chunks(mask, causal, s, world, num_chunks=8 * world, align=128)
    dense = to_dense(mask, causal, seqlen_q=s)
    per_chunk = torch.stack([dense[:, :, c * b.chunk_size:(c + 1) * b.chunk_size].sum()
                             for c in range(b.num_chunks)])
    assert torch.equal(b.chunk_work, per_chunk), "the balancer's work counts must be exact"
    assert torch.equal(b.work, torch.stack([per_chunk[a].sum() for a in b.assignment]))
    assert all(len(a) == 8 for a in b.assignment), "equal tokens per rank"
    assert b.imbalance <= 1.10, (b.work.tolist(), b.imbalance)
    contiguous = balance_chunks(mask, causal, s, world, num_chunks=8 * world, align=128, strategy="contiguous")
    assert b.imbalance <= contiguous.imbalance + 1e-12


def test_balancer_default_chunking_refines_until_even():
    s, world = 8192, 2
    mask, causal = example("share_question", s)  # 2 chunks per rank: at best 8/7 (see below)
    coarse = balance_chunks(mask, causal, s, world, num_chunks=2 * world)
    assert coarse.imbalance > 1.1
    auto = balance_chunks(mask, causal, s, world)
    assert auto.num_chunks > 2 * world and auto.imbalance <= 1.02
    # causal: 2 chunks per rank are already exact, so no finer chunking is taken
    assert balance_chunks(None, True, s, world).num_chunks == 2 * world
    # S too short for finer chunks: the finest it allows
    assert balance_chunks(mask[:, :, :512], causal, 512, world).num_chunks == 2 * world


def test_balancer_errors():
    with pytest.raises(ValueError, match="multiple of"):
        balance_chunks(None, True, 1000, 2, align=128)
    with pytest.raises(ValueError, match="multiple of the world size"):
        balance_chunks(None, True, 1024, 2, num_chunks=3, align=128)
    with pytest.raises(ValueError, match="zigzag"):
        balance_chunks(None, True, 2048, 2, num_chunks=8, align=128, strategy="zigzag")
    with pytest.raises(ValueError, match="strategy"):
        balance_chunks(None, True, 1024, 2, strategy="best")
    with pytest.raises(ValueError, match="columns"):
        balance_chunks(masks.causal(512), True, 1024, 2)


def test_balance_indices_and_gather_order():
    b = balance_chunks(masks.causal_document(64, [40, 24]), True, 64, 2, num_chunks=8, align=8)
    idx = [b.indices(r) for r in range(2)]
    assert sorted(torch.cat(idx).tolist()) == list(range(64))
    assert torch.equal(b.gather_order(), torch.cat(idx))
    for r in range(2):
        assert len(idx[r]) == 32
        assert torch.equal(idx[r], torch.cat([torch.arange(a, z) for a, z in b.bounds(r)]))


def test_ulysses_heads_rule():
    assert fmd.ulysses_heads(8, 8, 4) == 1
    assert fmd.ulysses_heads(8, 2, 4) == 2   # 2 KV heads repeated twice for 4 ranks
    assert fmd.ulysses_heads(14, 2, 2) == 1
    assert fmd.ulysses_heads(8, 1, 8) == 8
    with pytest.raises(ValueError, match="multiple of the group size"):
        fmd.ulysses_heads(14, 2, 4)
    with pytest.raises(ValueError, match="multiple of the number of key/value"):
        fmd.ulysses_heads(8, 3, 4)
    for hk in (1, 2, 3, 4, 6, 12):  # the repeated KV heads split over the ranks and divide the query heads
        for world in (1, 2, 3, 4, 6, 12):
            r = fmd.ulysses_heads(12, hk, world)
            assert (hk * r) % world == 0 and 12 % (hk * r) == 0


def test_single_process_plans_equal_plain_attention():
    # A world of one (no process group): both modes are plain attention.
    torch.manual_seed(0)
    mask, causal = example("share_question", 64)
    q, k, v = (torch.randn(1, 64, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    want = flashmask_attention(q, k, v, mask, causal=causal)
    for mode in fmd.MODES:
        plan = fmd.make_plan(mask, causal, mode=mode, align=8)
        assert plan.world == 1 and plan.local_len == 64
        got = fmd.context_parallel_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan)
        torch.testing.assert_close(got, plan.shard(want), rtol=1e-12, atol=1e-12)


def test_single_process_plans_with_a_value_head_dim():
    # Dqk = 12, Dv = 4: out [.., Dv] and the gradients of both modes equal plain attention's.
    torch.manual_seed(1)
    mask, causal = example("causal_document", 64)
    q, k, v = (torch.randn(1, 64, h, d, dtype=torch.float64, requires_grad=True) for h, d in ((4, 12), (2, 12), (2, 4)))
    want = flashmask_attention(q, k, v, mask, causal=causal)
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    for mode in fmd.MODES:
        plan = fmd.make_plan(mask, causal, mode=mode, align=8)
        got = fmd.context_parallel_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan)
        assert got.shape == (1, 64, 4, 4)
        torch.testing.assert_close(got, plan.shard(want), rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(got, (q, k, v), plan.shard(dout))
        for name, g, w in zip("qkv", grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m: f"{mode} d{name}: {m}")


@pytest.mark.parametrize("family", ["causal", "causal_document", "document", "share_question"])
def test_windowed_plans_equal_the_window_on_one_process(family):
    """plan.windowed: the same sharding under the mask and the window together; made once per window."""
    torch.manual_seed(3)
    mask, causal = example(family, 64, batch_size=2)
    mask = None if family == "causal" else mask
    window = (5, 0) if causal else (5, 7)
    q, k, v = (torch.randn(2, 64, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    want = flashmask_attention(q, k, v, mask, causal=causal, window_size=window)
    assert not torch.allclose(want, flashmask_attention(q, k, v, mask, causal=causal))  # the window matters
    for mode in fmd.MODES:
        plan = fmd.make_plan(mask, causal, 64, mode=mode, align=8)
        wplan = plan.windowed(window, batch_size=2)
        assert plan.windowed(window, batch_size=2) is wplan and plan.startend_row_indices is mask
        assert torch.equal(wplan.local_index, plan.local_index) and wplan.chunks == plan.chunks
        if mode == "allgather_kv":  # the same chunks, their work under the window
            assert wplan.balance.assignment == plan.balance.assignment
            assert int(wplan.balance.work.sum()) == int(masks.to_dense(wplan.startend_row_indices, causal).sum())
            assert int(wplan.balance.work.sum()) < int(plan.balance.work.sum())
        got = fmd.context_parallel_attention(plan.shard(q), plan.shard(k), plan.shard(v), wplan)
        torch.testing.assert_close(got, plan.shard(want), rtol=1e-12, atol=1e-12)


def test_windowed_plan_raises_where_the_window_does_not_fit_the_mask():
    # causal C=2: column 0 masked on rows [2, 3); a window reaching 5 rows back masks its rows [6, 8): two runs,
    # which one (LTS, LTE) interval cannot hold
    mask = torch.tensor([[[[2, 3]] + [[8, 8]] * 7]], dtype=torch.int32)
    plan = fmd.make_plan(mask, True, 8, mode="ulysses")
    with pytest.raises(ValueError, match="separate runs"):
        plan.windowed((5, 0))
    assert plan.windowed((7, 0)).startend_row_indices[0, 0, 0].tolist() == [2, 3]  # the window hides no row of it


def test_cp_backend_sliding_window_on_one_process():
    """The fm_cp backend runs a layer's sliding window on the windowed plan (the fm_colmask result), and
    raises where the window would differ in positions (a DPO layout) or does not fit the mask."""
    pytest.importorskip("transformers")
    import flashmask.distributed.hf as cp_hf
    import flashmask.integrations.transformers as fm_hf

    torch.manual_seed(4)
    module = torch.nn.Module()
    pos = torch.cat([torch.arange(20), torch.arange(28), torch.arange(16)]).view(1, 64)
    local, plan = fmd.shard_packed_batch({"input_ids": torch.zeros(1, 64, dtype=torch.long), "position_ids": pos},
                                         mode="allgather_kv", align=8)
    q, k, v = (torch.randn(1, h, 64, 8, dtype=torch.float64) for h in (4, 2, 2))
    want, _ = fm_hf.flashmask_attention_forward(module, q, k, v, None, position_ids=pos, sliding_window=5)
    with cp_hf.context_parallel(plan):
        got, _ = cp_hf.cp_attention_forward(module, *(plan.shard(t, 2) for t in (q, k, v)), None, sliding_window=5)
    torch.testing.assert_close(got, plan.shard(want), rtol=1e-12, atol=1e-12)
    # prompt, chosen, rejected: the rejected answer's positions continue from the prompt's
    mask = masks.share_question(64, [24, 20, 20])
    pos = torch.cat([torch.arange(44), torch.arange(24, 44)]).view(1, 64)
    local, plan = fmd.shard_packed_batch({"input_ids": torch.zeros(1, 64, dtype=torch.long), "position_ids": pos,
                                          fmd.MASK_KEY: mask}, mode="ulysses")
    with cp_hf.context_parallel(plan), pytest.raises(NotImplementedError, match="'fm_cp'.*position_ids jump"):
        cp_hf.cp_attention_forward(module, *(plan.shard(t, 2) for t in (q, k, v)), None, sliding_window=5)
    # a causal C=2 mask whose masked rows and the window's form two runs in column 0
    plan = fmd.make_plan(torch.tensor([[[[2, 3]] + [[8, 8]] * 7]], dtype=torch.int32), True, 8, mode="ulysses")
    with cp_hf.context_parallel(plan), pytest.raises(NotImplementedError, match="'fm_cp'.*separate runs"):
        cp_hf.cp_attention_forward(module, q[:, :, :8], k[:, :, :8], v[:, :, :8], None, sliding_window=6)


def _llama4_like_module(chunk):
    import types

    module = torch.nn.Module()
    module.layer_idx = 0
    module.config = types.SimpleNamespace(attention_chunk_size=chunk, layer_types=["chunked_attention"])
    return module


@pytest.mark.parametrize("with_mask", [False, True], ids=["position_ids_only", "document_mask"])
def test_chunked_plans_and_the_cp_backend_equal_the_chunks_on_one_process(with_mask):
    """plan.chunked (Llama 4's chunked layers): the same sharding under the documents and the chunks
    of the batch's position_ids, in both modes, through the fm_cp backend; equal to one process."""
    pytest.importorskip("transformers")
    import flashmask.distributed.hf as cp_hf

    torch.manual_seed(5)
    pos = torch.cat([torch.arange(20), torch.arange(28), torch.arange(16)]).view(1, 64)
    batch = {"input_ids": torch.zeros(1, 64, dtype=torch.long), "position_ids": pos}
    if with_mask:
        batch[fmd.MASK_KEY] = masks.from_position_ids(pos)
    q, k, v = (torch.randn(1, h, 64, 8, dtype=torch.float64) for h in (4, 2, 2))
    mask = masks.merge_chunks(masks.from_position_ids(pos), 8, 64, pos)
    want = flashmask_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, causal=True)
    plain = flashmask_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), masks.from_position_ids(pos),
                                causal=True)
    assert not torch.allclose(want, plain)  # the chunks matter
    for mode in fmd.MODES:
        local, plan = fmd.shard_packed_batch(batch, mode=mode, align=8)
        cplan = plan.chunked(8)
        assert plan.chunked(8) is cplan and torch.equal(cplan.startend_row_indices, mask)
        with cp_hf.context_parallel(plan):
            got, _ = cp_hf.cp_attention_forward(_llama4_like_module(8), *(plan.shard(t, 2) for t in (q, k, v)), None)
        torch.testing.assert_close(got, plan.shard(want), rtol=1e-12, atol=1e-12)


def test_chunked_plan_needs_a_causal_plan():
    plan = fmd.make_plan(masks.document(16, [8, 8]), False, 16, mode="ulysses")
    with pytest.raises(ValueError, match="chunked attention needs a causal plan"):
        plan.chunked(4)


def test_cp_backend_raises_where_chunks_meet_a_position_jump():
    """A DPO row (the rejected answer's positions continue from the prompt): a chunk counted in
    positions is not one run of rows there, so a chunked layer raises rather than mask it wrongly."""
    pytest.importorskip("transformers")
    import flashmask.distributed.hf as cp_hf

    mask = masks.share_question(64, [24, 20, 20])
    pos = torch.cat([torch.arange(44), torch.arange(24, 44)]).view(1, 64)
    local, plan = fmd.shard_packed_batch({"input_ids": torch.zeros(1, 64, dtype=torch.long), "position_ids": pos,
                                          fmd.MASK_KEY: mask}, mode="ulysses")
    q, k, v = (plan.shard(torch.randn(1, 2, 64, 8), 2) for _ in range(3))
    with cp_hf.context_parallel(plan), pytest.raises(NotImplementedError, match="'fm_cp'.*attention_chunk_size=8"):
        cp_hf.cp_attention_forward(_llama4_like_module(8), q, k, v, None)
    with cp_hf.context_parallel(plan):  # a chunk no shorter than the row hides nothing
        cp_hf.cp_attention_forward(_llama4_like_module(64), q, k, v, None)

@pytest.mark.parametrize("softcap,use_sinks", [(2.0, False), (0.0, True), (1.5, True)])
def test_single_process_plans_with_softcap_and_sinks(softcap, use_sinks):
    torch.manual_seed(2)
    mask, causal = example("share_question", 64)
    q, k, v = (torch.randn(1, 64, h, d, dtype=torch.float64, requires_grad=True) for h, d in ((4, 8), (2, 8), (2, 4)))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True) if use_sinks else None
    leaves = (q, k, v) + ((sinks,) if use_sinks else ())
    want = flashmask_attention(q, k, v, mask, causal=causal, softcap=softcap, sinks=sinks)
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, dout)
    for mode in fmd.MODES:
        plan = fmd.make_plan(mask, causal, mode=mode, align=8)
        got = fmd.context_parallel_attention(plan.shard(q), plan.shard(k), plan.shard(v), plan, softcap=softcap,
                                             sinks=sinks)
        torch.testing.assert_close(got, plan.shard(want), rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(got, leaves, plan.shard(dout))
        for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m: f"{mode} {name}: {m}")


def test_shift_labels_and_padding():
    ids = torch.arange(10).view(1, 10)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    batch = {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}
    # world 1, align 4: padded to a multiple of 8 chunks per rank x 4 = 32
    local, plan = fmd.shard_packed_batch(batch, mode="allgather_kv", align=4)
    assert plan.seqlen == 32
    assert local["input_ids"].tolist() == [list(range(10)) + [0] * 22]
    assert local["shift_labels"].tolist() == [list(range(1, 10)) + [-100] * 23]
    assert int(local["num_items_in_batch"]) == 9
    assert local["position_ids"][0, 10:].tolist() == list(range(22))
    # the padded mask: the real rows see exactly the causal documents, never a padding key
    want = masks.causal_document(10, [4, 3, 3])
    dense = to_dense(plan.startend_row_indices, True, seqlen_q=32)[0, 0]
    assert torch.equal(dense[:10, :10], to_dense(want, True)[0, 0])
    assert not dense[:10, 10:].any()
    assert torch.equal(dense[10:, 10:], torch.ones(22, 22, dtype=torch.bool).tril())  # padding: causal among itself
    local, plan = fmd.shard_packed_batch(batch, mode="allgather_kv", align=4, num_chunks=2)
    assert plan.seqlen == 16


@pytest.mark.parametrize("causal,c", MODES + [(False, None)])
def test_pad_mask_hides_padding_from_real_rows(causal, c):
    g = torch.Generator().manual_seed(3)
    s, s_new = 12, 16
    mask = None if c is None else random_startend(2, 2, s, s, causal, c, generator=g)
    batch = {"input_ids": torch.zeros(2, s, dtype=torch.long), "attn_mask_startend_row_indices": mask}
    padded = fmd.pad_packed_batch(batch, 8, causal=causal)["attn_mask_startend_row_indices"]
    dense = to_dense(padded, causal, seqlen_q=s_new, seqlen_k=s_new)
    assert not dense[:, :, :s, s:].any(), "a real row sees a padding key"
    orig = to_dense(mask, causal, seqlen_q=s, seqlen_k=s)
    assert torch.equal(dense[:, :, :s, :s], orig.expand_as(dense[:, :, :s, :s]))


def test_document_mask_from_position_ids_rule():
    # docs/format.md: a document starts wherever the position does not grow by exactly 1
    pos = torch.tensor([[0, 1, 2, 5, 6, 0, 1, 1]])
    m = fmd.document_mask_from_position_ids(pos, causal=True)
    assert m[0, 0, :, 0].tolist() == [3, 3, 3, 5, 5, 7, 7, 8]
    m = fmd.document_mask_from_position_ids(pos, causal=False)
    assert m[0, 0, :, 1].tolist() == [0, 0, 0, 3, 3, 5, 5, 7]


@pytest.mark.parametrize("mod", ["flashmask.distributed.intervals", "flashmask.distributed.balance",
                                 "flashmask.distributed.sharding", "flashmask.losses"])
def test_docstring_examples(mod):
    import doctest
    import importlib
    res = doctest.testmod(importlib.import_module(mod), optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0


def test_shard_rejects_padding_attention_mask():
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.tensor([[1] * 6 + [0] * 2])}
    with pytest.raises(NotImplementedError, match="padding"):
        fmd.shard_packed_batch(batch, mode="ulysses")


# ------------------------------------------------------------------------------------------------
# multi-process: gloo, reference path, compared with one process


def _case_list(world):
    """(name, spec) of the attention cases run in one spawn of ``world`` processes."""
    cases = []
    fams = ["causal", "full", "causal_document", "document", "share_question", "global_sliding_window",
            "causal_blockwise", "prefix_lm_document", "qk_sparse", "sliding_window", "random_eviction"]
    if world > 2:
        fams = ["causal_document", "share_question", "global_sliding_window"]
    for mode in ("allgather_kv", "ulysses"):
        for fam in fams:
            cases.append((f"{mode}-{fam}", dict(mode=mode, family=fam, hq=4, hk=2, hm=1, b=1)))
        for causal, c in MODES:
            for hm_kind in (("1", "hk", "hq") if world == 2 else ("hq",)):
                cases.append((f"{mode}-random-causal{int(causal)}-C{c}-hm_{hm_kind}",
                              dict(mode=mode, family="random", causal=causal, c=c, hq=4, hk=2, hm=hm_kind, b=2)))
        cases.append((f"{mode}-mha-causal_document", dict(mode=mode, family="causal_document", hq=4, hk=4, hm=1, b=1)))
        cases.append((f"{mode}-mqa-share_question", dict(mode=mode, family="share_question", hq=4, hk=1, hm=1, b=1)))
        cases.append((f"{mode}-bf16-causal_document", dict(mode=mode, family="causal_document", hq=4, hk=2, hm=1, b=1,
                                                          dtype="bfloat16")))
        # a value head dim of its own (Dqk = 8): below and above the query/key one
        cases.append((f"{mode}-dv4-causal_document", dict(mode=mode, family="causal_document", hq=4, hk=2, hm=1, b=1,
                                                          dv=4)))
        cases.append((f"{mode}-dv12-random-causal0-C4-hm_hq", dict(mode=mode, family="random", causal=False, c=4,
                                                                   hq=4, hk=2, hm="hq", b=2, dv=12)))
        cases.append((f"{mode}-dv4-bf16-share_question", dict(mode=mode, family="share_question", hq=4, hk=1, hm=1,
                                                              b=1, dtype="bfloat16", dv=4)))
        # logit soft-capping and attention sinks (the sinks' gradient summed over the ranks)
        cases.append((f"{mode}-softcap-causal_document", dict(mode=mode, family="causal_document", hq=4, hk=2, hm=1,
                                                              b=1, softcap=2.0)))
        cases.append((f"{mode}-sinks-random-causal1-C2-hm_hq", dict(mode=mode, family="random", causal=True, c=2,
                                                                    hq=4, hk=2, hm="hq", b=2, sinks=True)))
        cases.append((f"{mode}-softcap-sinks-dv4-share_question", dict(mode=mode, family="share_question", hq=4,
                                                                       hk=1, hm=1, b=1, dv=4, softcap=1.5,
                                                                       sinks=True)))
        # a sliding window merged into the plan's mask (the sliding layers of Mistral, Gemma, GPT-OSS)
        cases.append((f"{mode}-window-causal_document", dict(mode=mode, family="causal_document", hq=4, hk=2, hm=1,
                                                             b=1, window=(6, 0))))
        cases.append((f"{mode}-window-causal", dict(mode=mode, family="causal", hq=4, hk=2, hm=1, b=2,
                                                    window=(9, 0), sinks=True)))
    if world == 2:
        # Ulysses repeating 3 KV heads (and their mask heads) to 6 for 2 ranks
        cases.append(("ulysses-gqa-replicate-hm_hk", dict(mode="ulysses", family="random", causal=True, c=2, hq=6,
                                                          hk=3, hm="hk", b=1)))
        for nc, strat in ((8, "greedy"), (4, "contiguous"), (4, "zigzag")):
            cases.append((f"allgather_kv-chunks{nc}-{strat}", dict(mode="allgather_kv", family="causal_document", hq=4,
                                                                  hk=2, hm=1, b=1, num_chunks=nc, strategy=strat)))
        cases.append(("allgather_kv-head_groups1", dict(mode="allgather_kv", family="random", causal=False, c=4, hq=4,
                                                        hk=2, hm="hq", b=2, head_groups=1)))
        cases.append(("allgather_kv-hk3-groups3", dict(mode="allgather_kv", family="random", causal=True, c=1, hq=6,
                                                       hk=3, hm="hk", b=1, head_groups=4)))
    return cases


def _errors_case(world):
    """Bad inputs raise clear errors on every rank (before any collective)."""
    q = torch.randn(1, 16, 3, 8)
    kv = torch.randn(1, 16, 3, 8)
    try:
        fmd.ulysses_attention(q, kv, kv, None, causal=True)
        raise AssertionError("Ulysses with 3 heads over 2 ranks must raise")
    except ValueError as e:
        assert "multiple of the group size" in str(e), e
    try:
        fmd.make_plan(None, True, 1001, mode="ulysses")
        raise AssertionError("S=1001 over 2 ranks must raise")
    except ValueError as e:
        assert "multiple of the group size" in str(e), e
    try:
        fmd.ulysses_attention(torch.randn(1, 16, 4, 8), torch.randn(1, 16, 2, 12), torch.randn(1, 16, 2, 4), None)
        raise AssertionError("q and k with different head dims must raise")
    except ValueError as e:
        assert "q and k must share the head dim Dqk" in str(e), e
    try:
        fmd.ulysses_attention(torch.randn(1, 16, 4, 8), torch.randn(1, 16, 2, 8), torch.randn(1, 16, 1, 4), None)
        raise AssertionError("k and v with different heads must raise")
    except ValueError as e:
        assert "k, v with the same heads" in str(e), e
    for sinks, softcap, match in ((torch.zeros(2), 0.0, "sinks must have shape [Hq] = [4]"),
                                  (None, -1.0, "softcap must be a finite float >= 0")):
        try:
            fmd.ulysses_attention(torch.randn(1, 16, 4, 8), torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 8), None,
                                  sinks=sinks, softcap=softcap)
            raise AssertionError(f"Ulysses must raise: {match}")
        except ValueError as e:
            assert match in str(e), e
    plan = fmd.make_plan(None, True, 64, mode="allgather_kv", align=8)
    try:
        n = 64 // world + 8
        fmd.allgather_kv_attention(torch.randn(1, n, 4, 8), torch.randn(1, n, 2, 8), torch.randn(1, n, 2, 8), plan)
        raise AssertionError("a wrong local length must raise")
    except ValueError as e:
        assert f"the plan gives {64 // world}" in str(e), e


def _comm_fallback_case(world, rank):
    """A process group whose tensor collectives raise "not supported" (as older gloo builds did
    for reduce_scatter): the list all-gather and all-reduce + slice fallbacks give the same result."""
    from flashmask.distributed import _comm

    def unsupported(*a, **k):
        raise RuntimeError("this op is not supported by the backend")

    saved = (_comm._all_gather_op, _comm._reduce_scatter_op, set(_comm._unsupported))
    _comm._all_gather_op = _comm._reduce_scatter_op = unsupported
    try:
        spec = dict(mode="allgather_kv", family="random", causal=True, c=2, hq=4, hk=2, hm="hq", b=2)
        _run_case(spec, world, rank, seed=77)
        assert ("all_gather", "gloo") in _comm._unsupported and ("reduce_scatter", "gloo") in _comm._unsupported
    finally:
        _comm._all_gather_op, _comm._reduce_scatter_op = saved[0], saved[1]
        _comm._unsupported.clear()
        _comm._unsupported.update(saved[2])


def _inputs(spec, s, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.get("dtype", "float64"))
    b, hq, hk, d = spec["b"], spec["hq"], spec["hk"], 8
    if spec["family"] == "random":
        causal, c = spec["causal"], spec["c"]
        hm = {"1": 1, "hk": hk, "hq": hq}[spec["hm"]] if isinstance(spec["hm"], str) else spec["hm"]
        mask = random_startend(b, hm, s, s, causal, c, generator=g)
    else:
        mask, causal = example(spec["family"], s, batch_size=b)
        if spec["family"] in ("causal", "full"):
            mask = None  # the mask-free paths
    mk = lambda h, d=d: torch.randn(b, s, h, d, generator=g, dtype=torch.float64).to(dtype)
    dv = spec.get("dv", d)
    q, k, v, w = mk(hq), mk(hk), mk(hk, dv), mk(hq, dv)
    sinks = torch.randn(hq, generator=g, dtype=torch.float64).to(dtype) if spec.get("sinks") else None
    return q, k, v, w, mask, causal, sinks


def _run_case(spec, world, rank, seed):
    s = 64
    q, k, v, w, mask, causal, sinks = _inputs(spec, s, seed)
    softcap = spec.get("softcap", 0.0)
    # one process, whole sequence
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    sr = None if sinks is None else sinks.clone().requires_grad_()
    ref = flashmask_attention(qr, kr, vr, mask, causal=causal, backend="reference", softcap=softcap, sinks=sr,
                              window_size=spec.get("window"))
    (ref.double() * w.double()).sum().backward()
    # context parallel
    plan = fmd.make_plan(mask, causal, s, mode=spec["mode"], num_chunks=spec.get("num_chunks"), align=8,
                         strategy=spec.get("strategy", "greedy"))
    if "window" in spec:
        plan = plan.windowed(spec["window"], batch_size=q.shape[0])
    ql, kl, vl = (plan.shard(t).clone().requires_grad_() for t in (q, k, v))
    sl = None if sinks is None else sinks.clone().requires_grad_()
    out = fmd.context_parallel_attention(ql, kl, vl, plan, backend="reference", head_groups=spec.get("head_groups", 2),
                                         softcap=softcap, sinks=sl)
    (out.double() * plan.shard(w).double()).sum().backward()
    if q.dtype == torch.float64:
        tol = dict(rtol=1e-10, atol=1e-10)
    else:  # one rounding to bf16 apart (the gathered keys are summed in another order)
        tol = dict(rtol=2e-2, atol=2e-2)
    assert out.shape == (q.shape[0], s // world, q.shape[2], v.shape[3])
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, plan.shard(ref.detach()), **tol)
    for name, got, want in (("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad), ("dv", vl.grad, vr.grad)):
        assert got is not None, name
        torch.testing.assert_close(got, plan.shard(want), **tol, msg=lambda m: f"{name}: {m}")
    if sinks is not None:  # every rank holds its share of the sinks' gradient: they sum to one process's
        assert sl.grad is not None and sl.grad.dtype == sinks.dtype
        total = sl.grad.clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, sr.grad, **tol, msg=lambda m: f"dsinks: {m}")
    # the plan's unshard puts the rows back in global order
    torch.testing.assert_close(plan.unshard(out.detach()), ref.detach(), **tol)
    if plan.mode == "allgather_kv":
        assert plan.imbalance >= 1.0


def _sharding_case(world, rank):
    s = 40
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 100, (2, s), generator=g)
    pos = torch.cat([torch.arange(15), torch.arange(25)]).expand(2, s)
    labels = ids.clone()
    labels[:, 0] = -100
    for mode in fmd.MODES:
        local, plan = fmd.shard_packed_batch({"input_ids": ids, "position_ids": pos, "labels": labels}, mode=mode,
                                             align=4)
        s_new = plan.seqlen
        assert s_new % (world if mode == "ulysses" else 8 * world * 4) == 0 and s_new >= s
        full_ids = torch.nn.functional.pad(ids, (0, s_new - s))
        full_tgt = torch.nn.functional.pad(torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100),
                                           (0, s_new - s), value=-100)
        idx = plan.local_index
        assert torch.equal(local["input_ids"], full_ids[:, idx])
        assert torch.equal(local["shift_labels"], full_tgt[:, idx]), "labels must be shifted before sharding"
        assert int(local["num_items_in_batch"]) == int((labels[:, 1:] != -100).sum())
        # every token is on exactly one rank
        gathered = plan.unshard(local["input_ids"])
        assert torch.equal(gathered, full_ids)
        assert "labels" not in local and "attn_mask_startend_row_indices" not in local


def _run_cases(rank, world, init_file, outdir, names, run_one):
    """One process of a gloo group: ``run_one(i, name)`` for each case, recording "ok" or the
    traceback per case in ``outdir/rank{rank}.json`` (a failing case does not stop the others)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        for i, name in enumerate(names):
            try:
                run_one(i, name)
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
            dist.barrier()
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def _spawn_cases(worker, world, names, d):
    """``worker`` in ``world`` processes; {case: [the failure of each rank where it failed]}."""
    mp.spawn(worker, args=(world, str(d / "init"), str(d), names), nprocs=world, join=True)
    out = {}
    for r in range(world):
        with open(d / f"rank{r}.json") as f:
            for name, res in json.load(f).items():
                out.setdefault(name, [])
                if res != "ok":
                    out[name].append(f"rank {r}: {res}")
    return out


def _worker(rank, world, init_file, outdir, names):
    cases = dict(_case_list(world))

    def run_one(i, name):
        if name == "errors":
            _errors_case(world)
        elif name == "comm-fallbacks":
            _comm_fallback_case(world, rank)
        elif name == "sharding":
            _sharding_case(world, rank)
        else:
            _run_case(cases[name], world, rank, seed=1000 + i)

    _run_cases(rank, world, init_file, outdir, names, run_one)


def _spawn(world, names, tmp_path_factory):
    return _spawn_cases(_worker, world, names, tmp_path_factory.mktemp(f"cp{world}"))


_NAMES = {w: [n for n, _ in _case_list(w)] + ["errors", "sharding", "comm-fallbacks"] for w in (2, 4)}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _spawn(2, _NAMES[2], tmp_path_factory)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _spawn(4, _NAMES[4], tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("name", _NAMES[2])
def test_two_processes(world2, name):
    assert name in world2, f"case {name} did not run"
    assert not world2[name], "\n".join(world2[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", _NAMES[4])
def test_four_processes(world4, name):
    assert name in world4, f"case {name} did not run"
    assert not world4[name], "\n".join(world4[name])


# ------------------------------------------------------------------------------------------------
# transformers + FSDP2 on a (dp=1, cp=2) DeviceMesh, gloo: loss and gradients equal one process's


def _hf_case(mode, rank, ckpt=False, fsdp=True, mlp_chunk=0, kind="llama", keep=False):
    """keep: the kernels' CPU stand-ins run the attention (tests/cpu_kernels.py), each layer
    checkpointed keeping its attention outputs; no attention forward may then run in the backward."""
    if keep:
        from tests import cpu_kernels

        with cpu_kernels.in_place_of_the_kernels() as calls:
            return _hf_case_body(mode, rank, ckpt, fsdp, mlp_chunk, kind, calls)
    return _hf_case_body(mode, rank, ckpt, fsdp, mlp_chunk, kind, None)


def _hf_case_body(mode, rank, ckpt, fsdp, mlp_chunk, kind, kernel_calls):
    import transformers

    import flashmask.distributed.hf as cp_hf
    import flashmask.integrations.transformers as fm_hf
    from flashmask.checkpointing import chunk_mlp, enable_activation_checkpointing
    from flashmask.distributed import fsdp as fm_fsdp
    from flashmask.losses import causal_lm_loss, final_logit_softcap

    # (Gemma 2 and GPT-OSS: every other layer a sliding window of 8 tokens, shorter than the documents)
    if kind == "gemma2":  # logit soft-capping in attention and on the final logits
        cfg = transformers.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
                                        max_position_embeddings=128,
                                        attention_dropout=0.0, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                        sliding_window=8, initializer_range=0.2, tie_word_embeddings=True)
        cls = transformers.Gemma2ForCausalLM
    elif kind == "gpt_oss":  # attention sinks (learned), a mixture of 4 experts
        cfg = transformers.GptOssConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=64, max_position_embeddings=128,
                                        sliding_window=8, attention_dropout=0.0, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls = transformers.GptOssForCausalLM
    elif kind == "deepseek_v3":  # multi-head latent attention: q/k head dim 12 + 4, v head dim 8; dense MLPs
        cfg = transformers.DeepseekV3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=2,
                                            kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=12,
                                            qk_rope_head_dim=4, v_head_dim=8, vocab_size=64,
                                            max_position_embeddings=128, attention_dropout=0.0,
                                            tie_word_embeddings=True)
        cls = transformers.DeepseekV3ForCausalLM
    else:
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=128,
                                       attention_dropout=0.0, tie_word_embeddings=True)
        cls = transformers.LlamaForCausalLM

    # float64 and a tolerance of its rounding, except where the model computes in float32 itself:
    # GPT-OSS's experts (grouped_mm takes no float64) and Gemma 2's norms (float32 inside, so the sums
    # of their weights' gradients over tokens in another order differ at float32's rounding)
    dtype = torch.float32 if kind == "gpt_oss" else torch.float64
    loss_tol = dict(rtol=1e-5, atol=1e-6) if kind == "gpt_oss" else dict(rtol=1e-10, atol=1e-10)
    grad_tol = dict(rtol=1e-4, atol=1e-6) if kind in ("gpt_oss", "gemma2") else dict(rtol=1e-8, atol=1e-10)

    def build():
        torch.manual_seed(0)
        m = cls._from_config(cfg, attn_implementation=fm_hf.ATTN_IMPLEMENTATION).to(dtype)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n.endswith("self_attn.sinks"):
                    p.normal_()  # a visible share of every row
        return m.train()

    g = torch.Generator().manual_seed(5)
    s = 60
    ids = torch.randint(0, 64, (1, s), generator=g)
    pos = torch.cat([torch.arange(25), torch.arange(20), torch.arange(15)]).view(1, s)
    labels = ids.clone()
    labels[0, [0, 25, 45]] = -100  # as the collator: no label on a document's first token

    ref = build()
    hidden = ref.model(input_ids=ids, position_ids=pos).last_hidden_state
    ref_loss = causal_lm_loss(hidden, ref.lm_head, labels, chunk_size=7, logit_softcap=final_logit_softcap(ref))
    hf_loss = ref(input_ids=ids, position_ids=pos, labels=labels).loss  # transformers upcasts to float32
    torch.testing.assert_close(ref_loss, hf_loss.to(dtype), rtol=1e-6, atol=1e-6)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    model = build()
    cp_hf.use_context_parallel(model)
    if ckpt:
        enable_activation_checkpointing(model, offload=True, min_bytes=0)
    if kernel_calls is not None:
        enable_activation_checkpointing(model, keep_attention=True)
    rows = []  # tokens per call of the MLPs (the local shard, in chunks)
    if mlp_chunk:
        chunk_mlp(model, mlp_chunk)
        for layer in model.model.layers:
            layer.mlp.gate_proj.register_forward_hook(lambda m, i, o: rows.append(i[0].numel() // i[0].shape[-1]))
    mesh = fm_fsdp.init_mesh(1, 2, device_type="cpu")
    if fsdp:
        fm_fsdp.apply_fsdp2(model, mesh)
    local, plan = fmd.shard_packed_batch({"input_ids": ids, "position_ids": pos, "labels": labels},
                                         group=fm_fsdp.cp_group(mesh), mode=mode, align=4)
    assert local["input_ids"].shape[1] == plan.seqlen // 2
    with cp_hf.context_parallel(plan):
        loss = fm_fsdp.lm_loss(model, local, chunk_size=7)
        forward_calls = None if kernel_calls is None else kernel_calls.count("fwd")
        loss.backward()
    if kernel_calls is not None:
        assert forward_calls > 0 and kernel_calls.count("fwd") == forward_calls, kernel_calls
        assert kernel_calls.count("bwd") > 0
    if not fsdp:  # a replicated model: the ranks' partial gradients are summed by hand
        fm_fsdp.sum_gradients(model, fm_fsdp.cp_group(mesh))
    total = fm_fsdp.reduce_loss(loss, mesh)
    torch.testing.assert_close(total, ref_loss.detach(), **loss_tol)
    for n, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, ref_grads[n], **grad_tol, msg=lambda m: f"{n}: {m}")
        if n.endswith("self_attn.sinks"):
            assert grad.abs().min() > 0, n
    if mlp_chunk:
        assert max(rows) == mlp_chunk and local["input_ids"].shape[1] % mlp_chunk, rows  # chunks of the shard
    # the backend refuses to run without a plan
    try:
        with torch.no_grad():
            fm_fsdp.lm_loss(model, local)
        raise AssertionError("fm_cp without a plan must raise")
    except RuntimeError as e:
        assert "context-parallel plan" in str(e), e


def _hf_dpo_case(mode, rank):
    """A share-question row (prompt | chosen | rejected) under CP: per-token log-probabilities of
    the local tokens, span sums all-reduced (differentiable) over the group, a DPO-style loss that
    every rank computes alike and backpropagates divided by the group size. Equal to one process."""
    import torch.nn.functional as F
    import transformers
    from torch.distributed.nn.functional import all_reduce

    import flashmask.distributed.hf as cp_hf
    import flashmask.integrations.transformers as fm_hf
    from flashmask.distributed import fsdp as fm_fsdp
    from flashmask.losses import linear_token_logps

    cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=128,
                                   attention_dropout=0.0, tie_word_embeddings=True)

    def build():
        torch.manual_seed(1)
        return transformers.Qwen2ForCausalLM._from_config(cfg, attn_implementation=fm_hf.ATTN_IMPLEMENTATION).double()

    g = torch.Generator().manual_seed(9)
    p_len, c_len, r_len = 20, 14, 10
    s = p_len + c_len + r_len
    ids = torch.randint(0, 64, (1, s), generator=g)
    pos = torch.cat([torch.arange(p_len + c_len), torch.arange(p_len, p_len + r_len)]).view(1, s)
    mask = masks.share_question(s, [[p_len, c_len, r_len]])
    labels = ids.clone()
    labels[0, :p_len] = -100
    tgt = F.pad(labels[:, 1:], (0, 1), value=-100)
    chosen = torch.zeros(1, s, dtype=torch.float64)
    chosen[0, p_len:p_len + c_len - 1] = 1
    rejected = torch.zeros(1, s, dtype=torch.float64)
    rejected[0, p_len + c_len:s - 1] = 1

    def dpo(c, r):
        return -F.logsigmoid(0.1 * (c - r)).mean()

    ref = build().train()
    hidden = ref.model(input_ids=ids, position_ids=pos, attn_mask_startend_row_indices=mask).last_hidden_state
    lp = linear_token_logps(hidden, ref.lm_head.weight, tgt, chunk_size=5)
    ref_loss = dpo((lp * chosen).sum(-1), (lp * rejected).sum(-1))
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    model = build().train()
    cp_hf.use_context_parallel(model)
    mesh = fm_fsdp.init_mesh(1, 2, device_type="cpu")
    fm_fsdp.apply_fsdp2(model, mesh)

    def token_logps(self, input_ids, position_ids, shift_labels):
        h = self.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return linear_token_logps(h, self.get_output_embeddings().weight, shift_labels, chunk_size=5)

    fm_fsdp.install_forward_method(model, "token_logps", token_logps)
    group = fm_fsdp.cp_group(mesh)
    local, plan = fmd.shard_packed_batch({"input_ids": ids, "position_ids": pos, "labels": labels,
                                          "attn_mask_startend_row_indices": mask, "chosen": chosen,
                                          "rejected": rejected}, group=group, mode=mode, align=4)
    with cp_hf.context_parallel(plan):
        lp = model.token_logps(local["input_ids"], local["position_ids"], local["shift_labels"])
        sums = all_reduce(torch.stack([(lp * local["chosen"]).sum(-1), (lp * local["rejected"]).sum(-1)]),
                          group=group)
        loss = dpo(sums[0], sums[1])
        (loss / plan.world).backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-10, atol=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref_grads[n], rtol=1e-8, atol=1e-10,
                                   msg=lambda m: f"{n}: {m}")


_HF_NAMES = ["hf-fsdp2-allgather_kv", "hf-fsdp2-ulysses", "hf-fsdp2-allgather_kv-offloaded-checkpoints",
             "hf-fsdp2-dpo-allgather_kv", "hf-fsdp2-dpo-ulysses", "hf-replicated-allgather_kv",
             "hf-fsdp2-ulysses-chunked-mlp", "hf-fsdp2-allgather_kv-offloaded-checkpoints-chunked-mlp",
             "hf-fsdp2-deepseek_v3-allgather_kv", "hf-fsdp2-deepseek_v3-ulysses", "hf-fsdp2-gemma2-allgather_kv",
             "hf-fsdp2-gemma2-ulysses", "hf-fsdp2-gpt_oss-allgather_kv", "hf-fsdp2-gpt_oss-ulysses",
             "hf-fsdp2-allgather_kv-kept-attention", "hf-fsdp2-ulysses-kept-attention"]


def _hf_worker(rank, world, init_file, outdir, names):
    def run_one(_, name):
        mode = "ulysses" if "ulysses" in name else "allgather_kv"
        if "dpo" in name:
            _hf_dpo_case(mode, rank)
        else:
            _hf_case(mode, rank, ckpt="checkpoints" in name, fsdp="fsdp2" in name,
                     mlp_chunk=7 if "chunked-mlp" in name else 0,
                     kind=next((k for k in ("deepseek_v3", "gemma2", "gpt_oss") if k in name), "llama"),
                     keep="kept-attention" in name)

    _run_cases(rank, world, init_file, outdir, names, run_one)


@pytest.fixture(scope="module")
def hf_world2(tmp_path_factory):
    pytest.importorskip("transformers")
    return _spawn_cases(_hf_worker, 2, _HF_NAMES, tmp_path_factory.mktemp("cp_hf"))


@pytest.mark.slow
@pytest.mark.parametrize("name", _HF_NAMES)
def test_transformers_fsdp2_context_parallel(hf_world2, name):
    assert name in hf_world2, f"case {name} did not run"
    assert not hf_world2[name], "\n".join(hf_world2[name])


@pytest.mark.parametrize("cu, match", [([0, 8, 20], "stops before"), ([0, 8, 40], "runs past"),
                                       ([4, 8, 32], "must start at 0"), ([0, 20, 8, 32], "non-decreasing")])
def test_shard_checks_cu_seq_lens(cu, match):
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long), "cu_seq_lens_q": torch.tensor(cu)}
    with pytest.raises(ValueError, match=f"cu_seq_lens_q .*{match}"):
        fmd.shard_packed_batch(batch, mode="ulysses")
