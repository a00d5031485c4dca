"""The transformers backend on a model whose value head dim differs from its query/key head dim: a
small random DeepSeek-V3 (Dqk = 128 + 64 = 192, Dv = 128) in bfloat16 on the GPU, its attention
forced onto the kernels (a fallback to the reference path raises), against eager attention.

Tolerance as in tests/gpu/test_integrations.py: against a float32 oracle (the same bf16-rounded
weights, each document alone with eager), the error of the packed flashmask run must stay within
twice the error of plain bf16 eager on the separate documents, plus a small epsilon.
"""
import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3Config"):
    pytest.skip("this transformers has no DeepSeek-V3", allow_module_level=True)

import flashmask.integrations.transformers as fm_hf  # noqa: E402
from flashmask import _cuda  # noqa: E402
from flashmask.data import PackedSFTCollator, model_inputs  # noqa: E402
from tests.gpu.hf_checks import (  # noqa: E402
    alone,
    check_packed_rows,
    check_packed_sft_gradients,
    check_padded_batch,
    docs_for,
)
from tests.model_zoo import set_impl  # noqa: E402

NAME = fm_hf.ATTN_IMPLEMENTATION
VOCAB = 512
QK_NOPE, QK_ROPE, V_DIM = 128, 64, 128
BACKEND = "cuda"  # the kernels: never the reference path


@pytest.fixture(autouse=True)
def kernel_calls(monkeypatch):
    """Every attention call of the backend goes to the kernels (backend=BACKEND); returns the count."""
    probe = torch.empty(1, 1, 1, QK_NOPE + QK_ROPE, device="cuda", dtype=torch.bfloat16)
    reason = _cuda.unavailable_reason() if not _cuda.available() else _cuda.build_unsupported_reason(probe, V_DIM)
    if reason is not None:
        pytest.skip(f"no kernel for head dims ({QK_NOPE + QK_ROPE}, {V_DIM}): {reason}")
    calls = []
    real = fm_hf.flashmask_attention

    def forced(*args, **kwargs):
        calls.append(args[2].shape[-1])  # v's head dim
        return real(*args, backend=BACKEND, **kwargs)

    monkeypatch.setattr(fm_hf, "flashmask_attention", forced)
    return calls


def models(seed=0):
    """(bf16 model on the flashmask backend, float32 copy of the same bf16-rounded weights on eager).
    Dense MLPs only: a mixture of experts would route a token differently on a bf16 rounding step
    and blur what is compared here, the attention."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, first_k_dense_replace=2, kv_lora_rank=128, q_lora_rank=192,
        qk_nope_head_dim=QK_NOPE, qk_rope_head_dim=QK_ROPE, v_head_dim=V_DIM, max_position_embeddings=8192,
        attention_dropout=0.0)
    torch.manual_seed(seed)
    m16 = transformers.DeepseekV3ForCausalLM._from_config(cfg, attn_implementation=NAME).to("cuda", torch.bfloat16)
    m32 = set_impl(copy.deepcopy(m16).float(), "eager")
    return m16.eval(), m32.eval()


@pytest.mark.parametrize("source", ["position_ids", "mask"])
def test_packed_batch_bf16_matches_documents_alone(source, kernel_calls):
    m16, m32 = models()
    docs = docs_for(1, 10, 30, 700)
    b = PackedSFTCollator(2048, padding="max_length")([{"input_ids": d} for d in docs])
    inputs = model_inputs(b, "cuda")
    if source == "position_ids":  # the documents told apart by restarting positions only
        del inputs["attn_mask_startend_row_indices"]
    with torch.no_grad():
        got = m16(**inputs, use_cache=False).logits
    assert kernel_calls == [V_DIM] * 2  # the kernels ran, once per layer, on the unpadded value
    want, base = alone(m32, docs, "eager"), alone(m16, docs, "eager")
    set_impl(m16, NAME)
    check_packed_rows(got, docs, want, base)


def test_padded_batch_bf16_matches_eager():
    m16, m32 = models(seed=1)
    check_padded_batch(m16, m32, NAME, VOCAB, "padded batch")


def test_packed_sft_bf16_gradients_match_separate_documents():
    m16, m32 = models(seed=3)
    check_packed_sft_gradients(m16.train(), m32.train(), docs_for(4, 6, 50, 600), NAME, "eager")
