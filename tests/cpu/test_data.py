"""flashmask.data: packing, the SFT and share-question collators, and the loss-side helpers.

The masks the collators build are checked against dense definitions written independently here
(who may attend whom), through ``masks.to_dense``.
"""
import random

import pytest
import torch

import masks
from flashmask.data import (
    IGNORE_INDEX,
    MASK_KEY,
    PackedSFTCollator,
    ShareQuestionCollator,
    logp_positions,
    model_inputs,
    pack_sequences,
    response_end_values,
    shared_sequence_logps,
)

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None


def dense(batch, causal=True):
    t = batch[MASK_KEY]
    return masks.to_dense(t, causal, seqlen_q=t.shape[2])[:, 0]  # [R, S, S] (query, key)


# ------------------------------------------------------------------------------------------------ packing

@pytest.mark.parametrize("strategy", ["bfd", "sequential", "none"])
def test_pack_sequences_covers_everything_within_capacity(strategy):
    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(200)]
    rows = pack_sequences(lengths, 64, strategy)
    assert sorted(i for r in rows for i in r) == list(range(200))
    assert all(sum(lengths[i] for i in r) <= 64 for r in rows)
    if strategy == "sequential":
        assert [i for r in rows for i in r] == list(range(200))
    if strategy == "none":
        assert len(rows) == 200


def test_pack_sequences_bfd_is_tight():
    lengths = [60, 4, 30, 30, 2, 2, 60, 4]
    rows = pack_sequences(lengths, 64)
    assert len(rows) == 3  # 60+4, 60+4, 30+30+2+2


if given is not None:
    @settings(max_examples=40, deadline=None)
    @given(st.lists(st.integers(1, 32), min_size=1, max_size=60), st.integers(32, 80),
           st.sampled_from(["bfd", "sequential"]))
    def test_pack_sequences_property(lengths, cap, strategy):
        rows = pack_sequences(lengths, cap, strategy)
        assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
        assert all(r and sum(lengths[i] for i in r) <= cap for r in rows)
        assert len(rows) <= max(1, 2 * -(-sum(lengths) // cap))  # next-fit is at worst 2x optimal


def test_pack_sequences_errors():
    with pytest.raises(ValueError, match="lengths must lie"):
        pack_sequences([3, 9], 8)
    with pytest.raises(ValueError, match="lengths must lie"):
        pack_sequences([0], 8)
    with pytest.raises(ValueError, match="strategy"):
        pack_sequences([3], 8, "ffd2")
    with pytest.raises(ValueError, match="max_length"):
        pack_sequences([3], 0)


# ------------------------------------------------------------------------------------------------ SFT

def _sft_docs(seed=0, n=9, lo=1, hi=12):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 200, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)}
            for _ in range(n)]


@pytest.mark.parametrize("packing", ["bfd", "sequential", "none"])
@pytest.mark.parametrize("padding", ["longest", "max_length"])
def test_sft_collator_layout_and_mask(packing, padding):
    docs = _sft_docs()
    collate = PackedSFTCollator(16, pad_token_id=255, packing=packing, padding=padding)
    b = collate(docs)
    ids, labels, pos, t = b["input_ids"], b["labels"], b["position_ids"], b[MASK_KEY]
    nrows, s = ids.shape
    assert t.shape == (nrows, 1, s, 1) and t.dtype == torch.int32
    assert labels.shape == pos.shape == ids.shape and ids.dtype == pos.dtype == labels.dtype == torch.long
    if padding == "max_length":
        assert s == 16
    masks.validate(t, True, s)

    # Recover the documents from the rows: every doc appears once, contiguous, positions 0..n-1.
    rows = pack_sequences([len(d["input_ids"]) for d in docs], 16, packing)
    seen = 0
    for r, row in enumerate(rows):
        col = 0
        seg_of_col = torch.full((s,), -1)
        for k, i in enumerate(row):
            x = docs[i]["input_ids"]
            n = len(x)
            assert torch.equal(ids[r, col:col + n], x)
            assert pos[r, col:col + n].tolist() == list(range(n))
            assert labels[r, col] == IGNORE_INDEX  # nothing predicts a document's first token
            assert torch.equal(labels[r, col + 1:col + n], x[1:])
            seg_of_col[col:col + n] = k
            col += n
            seen += 1
        # padding: pad id, label -100, positions 0.. restarting
        assert (ids[r, col:] == 255).all() and (labels[r, col:] == IGNORE_INDEX).all()
        assert pos[r, col:].tolist() == list(range(s - col))
        seg_of_col[col:] = len(row)  # padding is one more segment
        # Dense check: i attends j iff j <= i and same segment.
        i = torch.arange(s)
        want = (i[None, :] <= i[:, None]) & (seg_of_col[:, None] == seg_of_col[None, :])
        assert torch.equal(dense(b)[r], want)
    assert seen == len(docs)


def test_sft_collator_matches_causal_document_builder():
    docs = [{"input_ids": [1] * 4}, {"input_ids": [2] * 3}, {"input_ids": [3] * 3}]
    b = PackedSFTCollator(10, packing="sequential")(docs)
    assert torch.equal(b[MASK_KEY], masks.causal_document(10, [4, 3, 3]))
    assert b[MASK_KEY][0, 0, :, 0].tolist() == [4, 4, 4, 4, 7, 7, 7, 10, 10, 10]  # docs/format.md worked example


def test_sft_collator_padding_to_multiple():
    b = PackedSFTCollator(64, pad_to_multiple_of=8)([{"input_ids": [1] * 13}])
    assert b["input_ids"].shape == (1, 16)
    assert b[MASK_KEY][0, 0, :, 0].tolist() == [13] * 13 + [16] * 3


def test_sft_collator_label_sources():
    collate = PackedSFTCollator(32, packing="sequential")
    b = collate([{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]},
                 {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
                 {"input_ids": [4, 4], "assistant_masks": [1, 1]},
                 [9, 9, 9]])  # a bare list of ids: every token is a label
    assert b["labels"][0].tolist() == [-100, -100, 7, 8, -100, 2, 3, -100, 4, -100, 9, 9]


def test_sft_collator_collate_rows_and_truncation():
    collate = PackedSFTCollator(8, truncation=True)
    b = collate.collate_rows([[{"input_ids": [1, 2]}, {"input_ids": [3, 4, 5]}], [{"input_ids": list(range(10))}]])
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]]
    with pytest.raises(ValueError, match="row 0 holds 9 tokens"):
        PackedSFTCollator(8).collate_rows([[{"input_ids": [1] * 5}, {"input_ids": [1] * 4}]])


def test_sft_collator_errors():
    with pytest.raises(ValueError, match="max_length=4"):
        PackedSFTCollator(4)([{"input_ids": [1] * 5}])
    with pytest.raises(ValueError, match="empty"):
        PackedSFTCollator(4)([{"input_ids": []}])
    with pytest.raises(KeyError, match="input_ids"):
        PackedSFTCollator(4)([{"ids": [1]}])
    with pytest.raises(ValueError, match="labels has shape"):
        PackedSFTCollator(4)([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match="integer"):
        PackedSFTCollator(4)([{"input_ids": torch.tensor([1.0, 2.0])}])
    with pytest.raises(ValueError, match="no samples"):
        PackedSFTCollator(4)([])
    with pytest.raises(ValueError, match="padding"):
        PackedSFTCollator(4, padding="right")
    with pytest.raises(ValueError, match="pad_token_id"):
        PackedSFTCollator(4, pad_token_id=-1)


@pytest.mark.parametrize("ids, err, match", [
    ([1.5, 2.0], ValueError, r"sample 0 input_ids must hold integer token ids, got torch.float32 values such as 1.5"),
    ([2.0, 3.0], ValueError, r"sample 0 input_ids must hold integer token ids, got torch.float32"),  # no rounding
    ("hello", TypeError, r"sample 0 input_ids must be a sequence of ints \(token ids\), got str 'hello'"),
    (["a", "b"], TypeError, r"sample 0 input_ids must be a sequence of ints \(token ids\), got list"),
    (7, TypeError, r"sample 0 input_ids must be a sequence of ints \(token ids\), got int 7"),
    ([True, False], ValueError, r"integer token ids, got torch.bool"),
])
def test_collators_take_integer_token_ids_only(ids, err, match):
    with pytest.raises(err, match=match):
        PackedSFTCollator(8)([{"input_ids": ids}])
    with pytest.raises(err, match=match.replace("input_ids", "chosen_ids")):
        ShareQuestionCollator(8)([{"prompt_ids": [1], "chosen_ids": ids, "rejected_ids": [2]}])
    with pytest.raises(err, match=match.replace("input_ids", "labels")):
        PackedSFTCollator(8)([{"input_ids": [1, 2], "labels": ids}])


def test_collators_take_ints_from_lists_tuples_tensors_and_numpy():
    np = pytest.importorskip("numpy")
    b = PackedSFTCollator(8, packing="sequential")([{"input_ids": [1, 2]}, {"input_ids": (3,)},
                                                   {"input_ids": torch.tensor([4], dtype=torch.int32)},
                                                   {"input_ids": np.array([5, 6])}])
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6]]


# ------------------------------------------------------------------------------------------------ share question

def _triples(seed=0, n=7):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, c, r = (int(x) for x in torch.randint(1, 7, (3,), generator=g))
        out.append({"prompt_ids": torch.randint(0, 200, (p,), generator=g),
                    "chosen_ids": torch.randint(0, 200, (c,), generator=g).tolist(),
                    "rejected_ids": torch.randint(0, 200, (r,), generator=g)})
    return out


def test_share_question_single_triple_matches_spec_example():
    b = ShareQuestionCollator(10)([{"prompt_ids": [1] * 4, "chosen_ids": [2] * 3, "rejected_ids": [3] * 3}])
    assert b[MASK_KEY][0, 0, :, 0].tolist() == [10, 10, 10, 10, 7, 7, 7, 10, 10, 10]
    assert torch.equal(b[MASK_KEY], masks.share_question(10, [4, 3, 3]))


@pytest.mark.parametrize("packing", ["bfd", "sequential", "none"])
def test_share_question_layout_mask_and_targets(packing):
    triples = _triples()
    b = ShareQuestionCollator(24, pad_token_id=250, packing=packing)(triples)
    ids, pos, t = b["input_ids"], b["position_ids"], b[MASK_KEY]
    nrows, s = ids.shape
    n = len(triples)
    masks.validate(t, True, s)
    assert b["pair_row"].shape == (n,) and b["chosen_spans"].shape == (n, 2)
    d = dense(b)
    part_of_col = torch.full((nrows, s), -1)  # 0 prompt, 1 chosen, 2 rejected
    pair_of_col = torch.full((nrows, s), -1)
    rows = pack_sequences([sum(len(x) for x in tr.values()) for tr in triples], 24, packing)
    order = [i for r in rows for i in r]
    for k, i in enumerate(order):  # pairs are numbered in row order
        tr = triples[i]
        p, c, r_ = (torch.as_tensor(tr[key]) for key in ("prompt_ids", "chosen_ids", "rejected_ids"))
        row = int(b["pair_row"][k])
        (p0, p1), (c0, c1), (r0, r1) = (b[f"{w}_spans"][k].tolist() for w in ("prompt", "chosen", "rejected"))
        assert p1 - p0 == len(p) and c0 == p1 and c1 - c0 == len(c) and r0 == c1 and r1 - r0 == len(r_)
        assert torch.equal(ids[row, p0:p1], p) and torch.equal(ids[row, c0:c1], c) and torch.equal(ids[row, r0:r1], r_)
        assert pos[row, p0:r1].tolist() == list(range(len(p) + len(c))) + list(range(len(p), len(p) + len(r_)))
        part_of_col[row, p0:p1], part_of_col[row, c0:c1], part_of_col[row, r0:r1] = 0, 1, 2
        pair_of_col[row, p0:r1] = k
        # Pre-shifted targets: chosen from p1-1 .. c1-2; rejected from p1-1 and r0 .. r1-2.
        cl, rl = b["chosen_labels"][row], b["rejected_labels"][row]
        assert cl[p1 - 1:c1 - 1].tolist() == c.tolist()
        assert rl[p1 - 1] == r_[0] and rl[r0:r1 - 1].tolist() == r_[1:].tolist()
    assert torch.equal(b["pair_index"], pair_of_col)
    pad = pair_of_col < 0
    assert (ids[pad] == 250).all()
    assert (b["chosen_labels"][pad] == IGNORE_INDEX).all() and (b["rejected_labels"][pad] == IGNORE_INDEX).all()
    n_targets = sum(len(tr["chosen_ids"]) + len(tr["rejected_ids"]) for tr in triples)
    assert int((b["chosen_labels"] != IGNORE_INDEX).sum() + (b["rejected_labels"] != IGNORE_INDEX).sum()) == n_targets

    # Dense semantics: causal; same pair; rejected never sees chosen; prompt sees only prompt;
    # chosen never sees rejected (causality); padding sees padding only.
    i = torch.arange(s)
    causal = i[None, :] <= i[:, None]
    for row in range(nrows):
        pq, pk = pair_of_col[row][:, None], pair_of_col[row][None, :]
        aq, ak = part_of_col[row][:, None], part_of_col[row][None, :]
        same = pq == pk
        parts_ok = (ak == 0) | (aq == ak)
        pad_q, pad_k = (pq < 0), (pk < 0)
        real = causal & same & parts_ok & ~pad_q
        padding = causal & pad_q & pad_k
        assert torch.equal(d[row], real | padding)


def test_share_question_trl_key_names_and_collate_rows():
    f = {"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4, 5]}
    c = ShareQuestionCollator(12)
    b = c.collate_rows([[f, f], [f]])
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5] * 2, [1, 2, 3, 4, 5] + [0] * 5]
    assert b["pair_row"].tolist() == [0, 0, 1]
    assert b["prompt_spans"].tolist() == [[0, 2], [5, 7], [0, 2]]


def test_share_question_truncation():
    c = ShareQuestionCollator(8, truncation=True)
    b = c([{"prompt_ids": list(range(10)), "chosen_ids": [20, 21], "rejected_ids": [30, 31, 32]}])
    assert b["input_ids"].tolist() == [[7, 8, 9, 20, 21, 30, 31, 32]]  # the prompt keeps its end
    b = c([{"prompt_ids": [1, 2, 3], "chosen_ids": list(range(20, 30)), "rejected_ids": list(range(30, 40))}])
    p0, p1 = b["prompt_spans"][0].tolist()
    assert p1 - p0 == 1 and b["input_ids"].shape[1] == 8
    (c0, c1), (r0, r1) = b["chosen_spans"][0].tolist(), b["rejected_spans"][0].tolist()
    assert c1 - c0 >= 1 and r1 - r0 >= 1 and r1 == 8


def test_share_question_errors():
    with pytest.raises(ValueError, match="max_length=8"):
        ShareQuestionCollator(8)([{"prompt_ids": [1] * 5, "chosen_ids": [1] * 2, "rejected_ids": [1] * 2}])
    with pytest.raises(ValueError, match="chosen_ids is empty"):
        ShareQuestionCollator(8)([{"prompt_ids": [1], "chosen_ids": [], "rejected_ids": [1]}])
    with pytest.raises(KeyError, match="needs keys"):
        ShareQuestionCollator(8)([{"prompt": "x"}])
    with pytest.raises(ValueError, match=">= 3"):
        ShareQuestionCollator(2)


# ------------------------------------------------------------------------------------------------ loss helpers

def test_shared_sequence_logps_against_loop():
    triples = _triples(seed=3, n=6)
    b = ShareQuestionCollator(20)(triples)
    nrows, s = b["input_ids"].shape
    logits = torch.randn(nrows, s, 37, dtype=torch.float64, requires_grad=True)
    # keep the targets inside the toy vocabulary
    b["chosen_labels"] = torch.where(b["chosen_labels"] >= 0, b["chosen_labels"] % 37, b["chosen_labels"])
    b["rejected_labels"] = torch.where(b["rejected_labels"] >= 0, b["rejected_labels"] % 37, b["rejected_labels"])
    ch, rj = shared_sequence_logps(logits, b)
    lp = logits.log_softmax(-1)
    for k in range(len(triples)):
        row = int(b["pair_row"][k])
        (p0, p1), (c0, c1), (r0, r1) = (b[f"{w}_spans"][k].tolist() for w in ("prompt", "chosen", "rejected"))
        ids = b["input_ids"][row] % 37
        want_c = sum(lp[row, t - 1, ids[t]] for t in range(c0, c1))
        want_r = lp[row, p1 - 1, ids[r0]] + sum(lp[row, t - 1, ids[t]] for t in range(r0 + 1, r1))
        torch.testing.assert_close(ch[k].double(), want_c, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rj[k].double(), want_r, rtol=1e-5, atol=1e-5)
    # [T, V] input (logits at logp_positions only) gives the same; averages divide by lengths.
    need = logp_positions(b)
    ch2, rj2 = shared_sequence_logps(logits[need], b, chunk_size=3)
    torch.testing.assert_close(ch2, ch)
    torch.testing.assert_close(rj2, rj)
    cm, rm = shared_sequence_logps(logits, b, average=True)
    clen = (b["chosen_spans"][:, 1] - b["chosen_spans"][:, 0]).float()
    torch.testing.assert_close(cm, ch / clen)
    (ch.sum() - rj.sum()).backward()
    assert logits.grad is not None and logits.grad[~need].abs().max() == 0
    with pytest.raises(ValueError, match="T = logp_positions"):
        shared_sequence_logps(logits[need][:-1], b)


def test_response_end_values_and_model_inputs():
    b = ShareQuestionCollator(32)(_triples(seed=5, n=4))
    nrows, s = b["input_ids"].shape
    values = torch.arange(nrows * s, dtype=torch.float32).view(nrows, s)
    ch, rj = response_end_values(values, b)
    for k in range(4):
        row = int(b["pair_row"][k])
        assert ch[k] == values[row, b["chosen_spans"][k, 1] - 1]
        assert rj[k] == values[row, b["rejected_spans"][k, 1] - 1]
    mi = model_inputs(b)
    assert set(mi) == {"input_ids", "position_ids", MASK_KEY}


def test_docstring_examples():
    import doctest
    import importlib

    attempted = 0
    for name in ("", ".packing", ".sft", ".share_question", ".batches"):
        res = doctest.testmod(importlib.import_module("flashmask.data" + name))
        assert res.failed == 0, f"flashmask.data{name}"
        attempted += res.attempted
    assert attempted > 5
