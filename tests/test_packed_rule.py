"""One packed-sequence rule everywhere: a document starts wherever the position id does not grow by
exactly 1 (transformers' ``masking_utils.find_packed_sequence_indices``)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

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
