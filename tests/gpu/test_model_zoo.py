"""The transformers backend on the model families of tests/model_zoo.py in bfloat16 on the GPU, each
at its attention shape (head dims 64, 96, 128, 256 and DeepSeek-V3's (192, 128), GQA, sliding and
global layers with a 256-token window, Llama 4's 256-token chunks, Gemma 2's soft-capping, GPT-OSS's
sinks), against eager.

Every family's attention is forced onto the kernels (backend="cuda": a fallback to the reference
path raises), soft-capping and sinks included.

Tolerance as in tests/gpu/test_transformers_mla.py: against a float32 oracle (the same bf16-rounded
weights, eager), the error of the flashmask run must stay within twice the error of plain bf16
eager, plus a small epsilon. Dense MLPs (GPT-OSS with one expert, DeepSeek-V3 without its mixture
layer): a mixture of experts would route a token differently on a bf16 rounding step and blur what
is compared here, the attention.
"""
import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
transformers = pytest.importorskip("transformers")

import flashmask.integrations.transformers as fm_hf  # noqa: E402
from flashmask import _cuda  # noqa: E402
from flashmask.data import PackedSFTCollator, model_inputs  # noqa: E402
from tests import model_zoo  # noqa: E402
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
WINDOW = 256
# per family: a GPU size (hidden 512, or 384 for Phi-3's 4 heads of 96), weights at a standard deviation
# that keeps the scores at a few units, a window shorter than the documents, dense MLPs
GPU_SIZE = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, max_position_embeddings=8192,
                initializer_range=0.05)
OVERRIDES = {
    "llama3": {}, "qwen3": {}, "gemma2": {}, "gemma3": {},
    "mistral": {},
    "phi3": dict(hidden_size=384, num_attention_heads=4, num_key_value_heads=2),
    "gpt_oss": dict(num_local_experts=1, num_experts_per_tok=1),
    "deepseek_v3": dict(first_k_dense_replace=2),
    "llama4": dict(moe_layers=[], attention_chunk_size=WINDOW),
}


@pytest.fixture
def family_calls(monkeypatch):
    """Forces the backend's attention calls onto the kernels (backend="cuda") and counts them."""
    if not _cuda.available():
        pytest.skip(_cuda.unavailable_reason())
    calls = []
    real = fm_hf.flashmask_attention

    def route(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, backend="cuda", **kwargs)

    monkeypatch.setattr(fm_hf, "flashmask_attention", route)
    return calls


def check_routing(family, calls, layers=2):
    """Every layer's call reached the kernels with the family's options."""
    assert len(calls) >= layers, calls
    s = model_zoo.SHAPES[family]
    for kw in calls:
        assert kw.get("softcap", 0.0) == s["softcap"], (family, kw.get("softcap"))
        assert (kw.get("sinks") is not None) == bool(s["sinks"]), family


def skip_without_kernels(family):
    s = model_zoo.SHAPES[family]
    probe = torch.empty(1, 1, 1, s["dqk"], device="cuda", dtype=torch.bfloat16)
    reason = _cuda.build_unsupported_reason(probe, s["dv"])
    if reason is not None:
        pytest.skip(f"no kernel for head dims ({s['dqk']}, {s['dv']}): {reason}")
    if not model_zoo.has_family(transformers, family):
        pytest.skip(f"this transformers has no {family}")




def skip_unless_chunks_follow_documents(family):
    if family == "llama4" and not model_zoo.chunks_follow_documents(transformers):
        pytest.skip("this transformers counts Llama 4's chunks from the packed row's first token (the CPU tests "
                    "check the backend against eager on such a row)")


def models(family, seed=0):
    """(bf16 model on the flashmask backend, float32 copy of the same bf16-rounded weights on eager)."""
    skip_without_kernels(family)
    cfg = dict(GPU_SIZE, **OVERRIDES[family])
    if model_zoo.SHAPES[family]["windows"] != (None, None):
        cfg["sliding_window"] = WINDOW
    m16 = model_zoo.make_model(transformers, family, NAME, seed=seed, **cfg).to("cuda", torch.bfloat16)
    m32 = set_impl(copy.deepcopy(m16).float(), "eager")
    return m16.eval(), m32.eval()




FAMILIES = list(model_zoo.FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_bf16_matches_documents_alone(family, family_calls):
    """Documents (some longer than the window) told apart by restarting position_ids only."""
    skip_unless_chunks_follow_documents(family)
    m16, m32 = models(family)
    docs = docs_for(1, 8, 30, 700)
    b = PackedSFTCollator(2048, padding="max_length")([{"input_ids": d} for d in docs])
    inputs = model_inputs(b, "cuda")
    del inputs["attn_mask_startend_row_indices"]
    with torch.no_grad():
        got = m16(**inputs, use_cache=False).logits
    check_routing(family, family_calls)
    want, base = alone(m32, docs, "eager"), alone(m16, docs, "eager")
    set_impl(m16, NAME)
    check_packed_rows(got, docs, want, base, what=f"{family} ")


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_bf16_matches_eager(family, family_calls):
    m16, m32 = models(family, seed=1)
    check_padded_batch(m16, m32, NAME, VOCAB, f"{family} padded batch",
                       after=lambda: check_routing(family, family_calls))


def assert_sinks_have_grads(model):
    assert all(p.grad is not None for p in model_zoo.sinks_parameters(model).values())


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sft_bf16_gradients_match_separate_documents(family, family_calls):
    """Every parameter's gradient (the sinks' included) of a packed SFT loss (the collator's document
    mask: Llama 4's chunks counted from each document's start on any transformers)."""
    m16, m32 = models(family, seed=3)
    check_packed_sft_gradients(
        m16.train(), m32.train(), docs_for(4, 6, 50, 600), NAME, "eager",
        after_packed=lambda: check_routing(family, family_calls),
        on_grads=assert_sinks_have_grads)
