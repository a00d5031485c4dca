"""A mask passed to the Hugging Face backend by a user is checked once per batch, not once per layer."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashmask.integrations.transformers as fm_hf  # noqa: E402
import masks  # noqa: E402

LAYERS = 4


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=fm_hf.ATTN_IMPLEMENTATION).eval()


@pytest.fixture
def checks(monkeypatch):
    """Count the value checks (each one reads the mask back to the host: a device sync)."""
    calls = []
    real = fm_hf._validate_mask

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(fm_hf, "_validate_mask", counting)
    monkeypatch.setattr(fm_hf, "_checked_mask", [])
    return calls


def _forward(model, mask, s=12):
    ids = torch.randint(0, 64, (1, s))
    with torch.no_grad():
        return model(input_ids=ids, attn_mask_startend_row_indices=mask, use_cache=False).logits


def test_one_check_per_batch_not_per_layer(model, checks):
    a = masks.causal_document(12, [5, 7])
    _forward(model, a)
    assert len(checks) == 1  # LAYERS attention calls, one check
    _forward(model, a)
    assert len(checks) == 1  # the same tensor again: already checked
    b = masks.causal_document(12, [6, 6])
    _forward(model, b)
    assert len(checks) == 2  # a new batch's mask is checked once
    b[0, 0, 0, 0] = 3  # changed in place: checked again
    _forward(model, b)
    assert len(checks) == 3


def test_bad_user_mask_raises_naming_the_argument_and_column(model, checks):
    bad = masks.causal_document(12, [5, 7])
    bad[0, 0, 9, 0] = 40  # > Sq
    with pytest.raises(ValueError, match=r"attn_mask_startend_row_indices: .*column 9 .*values must lie in"):
        _forward(model, bad)
    with pytest.raises(ValueError, match="attn_mask_startend_row_indices"):  # a bad mask is never cached as good
        _forward(model, bad)
    assert len(checks) == 2


def test_masks_the_backend_builds_itself_are_not_checked(model, checks):
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]])
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (1, 12)), position_ids=pos, use_cache=False)
    assert checks == []
