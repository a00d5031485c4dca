"""The transformers backend on the model families of tests/model_zoo.py in bfloat16 on the GPU, each
at its attention shape (head dims 64, 96, 128, 256 and DeepSeek-V3's (192, 128), GQA, sliding and
global layers with a 256-token window, Gemma 2's soft-capping, GPT-OSS's sinks), against eager.

Where the kernels take every option a family's layers use, its attention is forced onto them
(backend="cuda": a fallback to the reference path raises). Soft-capping and sinks are not kernel
options yet (flashmask._cuda.KERNEL_OPTIONS): Gemma 2 and GPT-OSS then run with backend="auto", and
the tests assert that every call fell back to the reference path with the one-time warning naming
the option (and, separately, that backend="cuda" raises naming it). Once the kernels list an option,
the same tests force its families onto them.

Tolerance as in tests/gpu/test_transformers_mla.py: against a float32 oracle (the same bf16-rounded
weights, eager), the error of the flashmask run must stay within twice the error of plain bf16
eager, plus a small epsilon. Dense MLPs (GPT-OSS with one expert, DeepSeek-V3 without its mixture
layer): a mixture of experts would route a token differently on a bf16 rounding step and blur what
is compared here, the attention.
"""
import copy
import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
transformers = pytest.importorskip("transformers")

import flashmask  # noqa: E402
import flashmask.integrations.transformers as fm_hf  # noqa: E402
from flashmask import _cuda  # noqa: E402
from flashmask.data import PackedSFTCollator, model_inputs, pack_sequences  # noqa: E402
from tests import model_zoo  # noqa: E402
from tests.gpu.hf_checks import alone, check_close, check_packed_sft_gradients, docs_for  # noqa: E402
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
}


def options_of(family):
    s = model_zoo.SHAPES[family]
    return [name for name, used in (("softcap", s["softcap"] > 0), ("sinks", s["sinks"])) if used]


def on_kernels(family):
    return all(o in _cuda.KERNEL_OPTIONS for o in options_of(family))


@pytest.fixture
def family_calls(monkeypatch):
    """Routes the backend's attention calls: to the kernels (backend="cuda") where they take every option
    of the call, else to backend="auto", recording the warnings. Returns a list of (where, warning texts)."""
    if not _cuda.available():
        pytest.skip(_cuda.unavailable_reason())
    calls = []
    real = fm_hf.flashmask_attention
    monkeypatch.setattr(flashmask.attention, "_warned", set())

    def route(*args, **kwargs):
        used = [o for o, on in (("softcap", kwargs.get("softcap")), ("sinks", kwargs.get("sinks") is not None)) if on]
        if all(o in _cuda.KERNEL_OPTIONS for o in used):
            calls.append(("kernels", []))
            return real(*args, backend="cuda", **kwargs)
        flashmask.attention._warned.clear()  # the one-time warning, once per call here
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = real(*args, **kwargs)
        calls.append(("reference", [str(w.message) for w in caught]))
        return out

    monkeypatch.setattr(fm_hf, "flashmask_attention", route)
    return calls


def check_routing(family, calls, layers=2):
    """Every layer's call went where it should: the kernels, or the reference path with the warning that
    names the option the kernels lack."""
    assert len(calls) >= layers, calls
    if on_kernels(family):
        assert all(where == "kernels" for where, _ in calls), calls
        return
    for where, msgs in calls:
        assert where == "reference"
        assert any("using the reference path" in m and any(f"({o})" in m for o in options_of(family))
                   for m in msgs), msgs


def skip_without_kernels(family):
    s = model_zoo.SHAPES[family]
    probe = torch.empty(1, 1, 1, s["dqk"], device="cuda", dtype=torch.bfloat16)
    reason = _cuda.build_unsupported_reason(probe, s["dv"])
    if reason is not None:
        pytest.skip(f"no kernel for head dims ({s['dqk']}, {s['dv']}): {reason}")
    if not model_zoo.has_family(transformers, family):
        pytest.skip(f"this transformers has no {family}")




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
    for r, row in enumerate(pack_sequences([len(d) for d in docs], 2048)):
        col = 0
        for i in row:
            n = len(docs[i])
            check_close(got[r, col:col + n], want[i], base[i], f"{family} doc {i}")
            col += n


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_bf16_matches_eager(family, family_calls):
    m16, m32 = models(family, seed=1)
    g = torch.Generator().manual_seed(2)
    lens = [700, 300, 520]
    ids = torch.randint(0, VOCAB, (3, max(lens)), generator=g).cuda()
    am = torch.zeros(3, max(lens), dtype=torch.long, device="cuda")
    for i, n in enumerate(lens):
        am[i, max(lens) - n:] = 1  # left padding
    with torch.no_grad():
        got = m16(input_ids=ids, attention_mask=am, use_cache=False).logits
        want = m32(input_ids=ids, attention_mask=am, use_cache=False).logits
        base = set_impl(m16, "eager")(input_ids=ids, attention_mask=am, use_cache=False).logits
    set_impl(m16, NAME)
    check_routing(family, family_calls)
    real = am.bool()
    check_close(got[real], want[real], base[real], f"{family} padded batch")


def assert_sinks_have_grads(model):
    assert all(p.grad is not None for p in model_zoo.sinks_parameters(model).values())


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sft_bf16_gradients_match_separate_documents(family, family_calls):
    """Every parameter's gradient (the sinks' included) of a packed SFT loss."""
    m16, m32 = models(family, seed=3)
    check_packed_sft_gradients(
        m16.train(), m32.train(), docs_for(4, 6, 50, 600), NAME, "eager",
        after_packed=lambda: check_routing(family, family_calls),
        on_grads=assert_sinks_have_grads)


@pytest.mark.parametrize("family", [f for f in FAMILIES if options_of(f)])
def test_forced_kernels_name_the_option_they_lack(family):
    """backend="cuda" on a layer with soft-capping or sinks: a clear error while the kernels lack it."""
    if on_kernels(family):
        pytest.skip(f"the kernels take {options_of(family)}")
    skip_without_kernels(family)
    if not _cuda.available():
        pytest.skip(_cuda.unavailable_reason())
    s = model_zoo.SHAPES[family]
    q = torch.randn(1, 64, s["hq"], s["dqk"], device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 64, s["hk"], s["dqk"], device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 64, s["hk"], s["dv"], device="cuda", dtype=torch.bfloat16)
    kw = {"softcap": s["softcap"]} if s["softcap"] else {"sinks": torch.zeros(s["hq"], device="cuda")}
    option = options_of(family)[0]
    with pytest.raises(RuntimeError, match=rf"backend='cuda' cannot run: the kernels do not support .*\({option}\)"):
        flashmask.flashmask_attention(q, k, v, causal=True, backend="cuda", **kw)
