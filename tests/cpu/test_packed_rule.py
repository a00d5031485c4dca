"""One packed-sequence rule everywhere: a document starts wherever the position id does not grow by
exactly 1 (transformers' ``masking_utils.find_packed_sequence_indices``)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import masks

# Rows of position ids: restarting documents, jumps, repeats, negative and descending values.
POSITIONS = st.integers(1, 3).flatmap(
    lambda b: st.integers(1, 24).flatmap(
        lambda s: st.lists(st.lists(st.integers(-3, 8), min_size=s, max_size=s), min_size=b, max_size=b)))


def _transformers_starts(pos: torch.Tensor) -> torch.Tensor:
    """bool [B, S] from transformers' own function (its sequence index changes where a document starts)."""
    mu = pytest.importorskip("transformers.masking_utils")
    if not hasattr(mu, "find_packed_sequence_indices"):
        pytest.skip("this transformers has no find_packed_sequence_indices")
    idx = mu.find_packed_sequence_indices(pos)
    if idx is None:  # transformers' shortcut for "one document per row"
        idx = torch.zeros_like(pos)
    return torch.cat([torch.ones_like(pos[:, :1], dtype=torch.bool), idx[:, 1:] != idx[:, :-1]], 1)


def test_the_issue_example_is_two_documents_everywhere():
    pos = torch.tensor([[0, 1, 2, 5, 6, 7]])
    want = masks.causal_document(6, [3, 3])
    assert torch.equal(masks.from_position_ids(pos), want)
    fm_hf = pytest.importorskip("flashmask.integrations.transformers")
    assert torch.equal(fm_hf._resolve_mask({"position_ids": pos}, True, 1, 6, 6, "cpu"), want)


@settings(max_examples=200, deadline=None)
@given(POSITIONS)
def test_document_starts_match_transformers(rows):
    pos = torch.tensor(rows)
    assert torch.equal(masks.document_starts(pos), _transformers_starts(pos))


@settings(max_examples=100, deadline=None)
@given(POSITIONS, st.booleans())
def test_hugging_face_backend_uses_the_same_rule(rows, causal):
    fm_hf = pytest.importorskip("flashmask.integrations.transformers")
    pos = torch.tensor(rows)
    b, s = pos.shape
    got = fm_hf._resolve_mask({"position_ids": pos}, causal, b, s, s, "cpu")
    if s == 1:  # one token: nothing to separate, the backend leaves the mask out
        assert got is None
    else:
        assert torch.equal(got, masks.from_position_ids(pos, causal=causal))


def test_document_starts_rejects_non_integer_ids():
    with pytest.raises(ValueError, match="integer tensor"):
        masks.document_starts(torch.zeros(1, 4))


# --------------------------------------------------------------------------------------------------
# The three entry points (masks, the context-parallel batch sharding, the Hugging Face backend)
# derive the same documents from the same position ids or cu_seqlens.

TRICKY_POSITIONS = [
    [[0, 1, 2, 3, 0, 1, 2]],  # restarts at 0
    [[0, 1, 2, 5, 6, 7]],  # a jump forward
    [[4, 5, 6, 2, 3, 4, 5]],  # a jump back, not to 0
    [[0, 0, 0, 1, 1, 2]],  # repeats
    [[3, 4, 5, 6]],  # one document that does not start at 0
    [[7, 8, 9, 10], [0, 1, 0, 1]],  # batch rows: one document, then two
    [[2, 1, 0, -1, 0]],  # descending and negative
]


def _dense(mask, causal, b, s):
    """The boolean [B, S, S] mask an entry point means (None: plain causal or full attention)."""
    if mask is None:
        return masks.to_dense(None, causal, seqlen_q=s, seqlen_k=s)[:, 0].expand(b, s, s)
    return masks.to_dense(mask, causal)[:, 0]


def _sharded_mask(batch, causal):
    """The global mask that shard_packed_batch plans with (one process: nothing is padded)."""
    fmd = pytest.importorskip("flashmask.distributed")
    _, plan = fmd.shard_packed_batch(batch, mode="ulysses", causal=causal)
    return plan.startend_row_indices


def _entry_points_from_positions(pos, causal):
    fmd = pytest.importorskip("flashmask.distributed")
    fm_hf = pytest.importorskip("flashmask.integrations.transformers")
    b, s = pos.shape
    ids = torch.zeros(b, s, dtype=torch.long)
    return {
        "masks.from_position_ids": masks.from_position_ids(pos, causal=causal),
        "distributed.document_mask_from_position_ids": fmd.document_mask_from_position_ids(pos, causal=causal),
        "distributed.shard_packed_batch": _sharded_mask({"input_ids": ids, "position_ids": pos}, causal),
        "transformers backend": fm_hf._resolve_mask({"position_ids": pos}, causal, b, s, s, "cpu"),
    }


def _assert_all_agree(got, want, causal, b, s):
    for name, mask in got.items():
        assert torch.equal(_dense(mask, causal, b, s), want), name


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rows", TRICKY_POSITIONS)
def test_entry_points_agree_on_tricky_position_ids(rows, causal):
    pos = torch.tensor(rows)
    b, s = pos.shape
    starts = [[t == 0 or r[t] != r[t - 1] + 1 for t in range(s)] for r in rows]  # the rule, in Python
    lens = [[b_ - a for a, b_ in zip(st_, st_[1:] + [s])]
            for st_ in ([t for t in range(s) if row[t]] for row in starts)]
    want = _dense((masks.causal_document if causal else masks.document)(s, lens), causal, b, s)
    _assert_all_agree(_entry_points_from_positions(pos, causal), want, causal, b, s)


@settings(max_examples=60, deadline=None)
@given(POSITIONS, st.booleans())
def test_entry_points_agree_on_any_position_ids(rows, causal):
    pos = torch.tensor(rows)
    b, s = pos.shape
    got = _entry_points_from_positions(pos, causal)
    _assert_all_agree(got, _dense(got["masks.from_position_ids"], causal, b, s), causal, b, s)


@st.composite
def _cu_cases(draw):
    """(B, S, cu_seqlens over the flattened B * S tokens): cuts anywhere, repeats allowed."""
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    cuts = sorted(draw(st.lists(st.integers(0, b * s), max_size=6)))
    return b, s, [0] + cuts + [b * s]


@settings(max_examples=80, deadline=None)
@given(_cu_cases(), st.booleans())
def test_entry_points_agree_on_cu_seqlens(case, causal):
    """A document starts at every boundary and at every row start (documents never cross rows)."""
    fm_hf = pytest.importorskip("flashmask.integrations.transformers")
    b, s, cu_list = case
    cu = torch.tensor(cu_list, dtype=torch.int32)
    bounds = sorted(set(cu_list) | set(range(0, b * s, s)))
    lens = [[y - x for x, y in zip(bounds, bounds[1:]) if r * s <= x < (r + 1) * s] for r in range(b)]
    want = _dense((masks.causal_document if causal else masks.document)(s, lens), causal, b, s)
    got = {
        "distributed.shard_packed_batch": _sharded_mask(
            {"input_ids": torch.zeros(b, s, dtype=torch.long), "cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, causal),
        "transformers backend": fm_hf._resolve_mask({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, causal, b, s, s,
                                                    "cpu"),
    }
    if b == 1:
        got["masks.from_cu_seqlens"] = masks.from_cu_seqlens(cu, causal=causal)
    _assert_all_agree(got, want, causal, b, s)
