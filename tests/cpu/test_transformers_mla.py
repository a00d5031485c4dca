"""The transformers backend ("fm_colmask") on a model whose value head dim differs from its query/key
head dim: a tiny random DeepSeek-V3 (multi-head latent attention, here Dqk = 16 + 8 = 24 and
Dv = 12), float32 on the CPU, against transformers' eager attention: logits and parameter
gradients on a plain batch and a padded batch (the packed row by restarting position_ids is in
tests/cpu/test_model_zoo.py, at DeepSeek-V3's real head dims).
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3Config"):
    pytest.skip("this transformers has no DeepSeek-V3", allow_module_level=True)

import flashmask.integrations.transformers as fm_hf  # noqa: E402
from tests.model_zoo import logits_and_grads as zoo_logits_and_grads  # noqa: E402
from tests.model_zoo import padded_batch  # noqa: E402

NAME = fm_hf.ATTN_IMPLEMENTATION
VOCAB = 128
QK_NOPE, QK_ROPE, V_DIM = 16, 8, 12




def make_model(seed=0):
    # Layer 0 dense, layer 1 a small mixture of experts, as in the real model.
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
        qk_nope_head_dim=QK_NOPE, qk_rope_head_dim=QK_ROPE, v_head_dim=V_DIM, max_position_embeddings=256,
        attention_dropout=0.0)
    assert cfg.qk_nope_head_dim + cfg.qk_rope_head_dim != cfg.v_head_dim
    torch.manual_seed(seed)
    return transformers.DeepseekV3ForCausalLM._from_config(cfg, attn_implementation=NAME)


def logits_and_grads(model, name, batches):
    return zoo_logits_and_grads(model, name, batches, restore=NAME)


def assert_grads_close(got, want):
    assert got.keys() == want.keys() and len(got) > 10
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=2e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_value_reaches_the_backend_unpadded(monkeypatch):
    seen = []
    real = fm_hf.flashmask_attention

    def spy(q, k, v, *a, **kw):
        out = real(q, k, v, *a, **kw)
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1], out.shape[-1]))
        return out

    monkeypatch.setattr(fm_hf, "flashmask_attention", spy)
    model = make_model().eval()
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (2, 9)), use_cache=False)
    dqk = QK_NOPE + QK_ROPE
    assert seen == [(dqk, dqk, V_DIM, V_DIM)] * 2


def test_plain_batch_matches_eager():
    model = make_model(seed=1).train()
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))
    batch = [{"input_ids": ids, "labels": ids}]
    (got,), got_g = logits_and_grads(model, NAME, batch)
    (want,), want_g = logits_and_grads(model, "eager", batch)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert_grads_close(got_g, want_g)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_matches_eager(side):
    model = make_model(seed=2).train()
    batch = [padded_batch([11, 6, 8], side, seed=2, vocab=VOCAB)]
    (got,), got_g = logits_and_grads(model, NAME, batch)
    (want,), want_g = logits_and_grads(model, "eager", batch)
    real = batch[0]["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    assert_grads_close(got_g, want_g)


def test_attention_function_with_an_unpadded_and_a_zero_padded_value():
    """transformers' flash_attention_* integration pads the value to the query/key head dim and crops
    the output; ours takes either: the padded columns of the output come back zero."""
    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 4, 10, 24, generator=g), torch.randn(2, 2, 10, 24, generator=g)
    v = torch.randn(2, 2, 10, 12, generator=g)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]] * 2)
    out, _ = fm_hf.flashmask_attention_forward(module, q, k, v, None, scaling=0.2, position_ids=pos)
    assert out.shape == (2, 10, 4, 12)
    padded, _ = fm_hf.flashmask_attention_forward(module, q, k, torch.nn.functional.pad(v, (0, 12)), None,
                                                  scaling=0.2, position_ids=pos)
    assert padded.shape == (2, 10, 4, 24)
    torch.testing.assert_close(padded[..., :12], out, rtol=1e-6, atol=1e-6)
    assert (padded[..., 12:] == 0).all()
    # against a dense computation: three causal documents, GQA (query head h reads key head h // 2)
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2])
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(10, 10, dtype=torch.bool).tril()
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    p = (q @ kk.transpose(-1, -2) * 0.2).masked_fill(~allowed, float("-inf")).softmax(-1)
    torch.testing.assert_close(out, (p @ vv).transpose(1, 2), atol=1e-5, rtol=1e-5)
