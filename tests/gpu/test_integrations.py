"""The transformers backend on a GPU in bfloat16, with the CUDA kernels when they are built.

Same equivalences as tests/cpu/test_integrations_transformers.py (a packed batch = each document
alone; shared-sequence DPO log-probs = separate sequences), plus the gradients of a packed SFT
loss. Tolerance as in attn_helpers.assert_close_to_reference: against a float32 oracle (the same
bf16-rounded weights, each sequence alone with sdpa), the error of the packed flashmask run must
stay within twice the error of plain bf16 sdpa on the separate sequences, plus a small epsilon.
"""
import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
transformers = pytest.importorskip("transformers")

import flashmask  # noqa: E402
import flashmask.integrations.transformers as fm_hf  # noqa: E402
from flashmask.data import PackedSFTCollator, ShareQuestionCollator, model_inputs, shared_sequence_logps  # noqa: E402
from tests.attn_helpers import KernelLaunches  # noqa: E402
from tests.gpu.hf_checks import alone, check_packed_rows, check_packed_sft_gradients, docs_for  # noqa: E402
from tests.model_zoo import set_impl  # noqa: E402

NAME = fm_hf.ATTN_IMPLEMENTATION
VOCAB = 512


def head_dim():
    dims = flashmask.cuda.compiled_head_dims() if flashmask.cuda.available() else ()
    return 128 if (not dims or 128 in dims) else max(dims)


def models(kind, seed=0):
    """(bf16 model on the flashmask backend, fp32 copy of the same bf16-rounded weights)."""
    d = head_dim()
    cfgkw = dict(hidden_size=4 * d, intermediate_size=8 * d, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=d, vocab_size=VOCAB, max_position_embeddings=8192)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    torch.manual_seed(seed)
    m16 = cls[1]._from_config(cls[0](**cfgkw), attn_implementation=NAME).to("cuda", torch.bfloat16).eval()
    m32 = set_impl(copy.deepcopy(m16).float(), "sdpa")
    return m16, m32


class KernelSpy:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = flashmask.attention._cuda.attention

        def attention(*a, **k):
            self.calls += 1
            return real(*a, **k)

        monkeypatch.setattr(flashmask.attention._cuda, "attention", attention)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_batch_bf16_matches_documents_alone(kind, monkeypatch):
    spy = KernelSpy(monkeypatch)
    m16, m32 = models(kind)
    docs = docs_for(1, 10, 30, 700)
    b = PackedSFTCollator(2048, padding="max_length")([{"input_ids": d} for d in docs])
    if flashmask.cuda.available():
        flashmask.cuda.clear_mask_cache()
    with torch.no_grad():
        got = m16(**model_inputs(b, "cuda"), use_cache=False).logits
    stats = flashmask.cuda.mask_cache_stats()
    want = alone(m32, docs, "sdpa")
    base = alone(m16, docs, "sdpa")
    set_impl(m16, NAME)
    check_packed_rows(got, docs, want, base)
    if flashmask.cuda.available():
        assert spy.calls == 2  # the kernels ran, once per layer
        assert stats == (1, 1)  # both layers pass one mask tensor: its metadata is computed once


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_dpo_bf16_logps_equal_separate_sequences(kind):
    m16, m32 = models(kind, seed=1)
    g = torch.Generator().manual_seed(2)
    triples = [{k: torch.randint(0, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)
                for k, lo, hi in (("prompt_ids", 50, 400), ("chosen_ids", 20, 300), ("rejected_ids", 20, 300))}
               for _ in range(8)]
    b = ShareQuestionCollator(2048, padding="max_length")(triples)
    with torch.no_grad():
        ch, rj = shared_sequence_logps(m16(**model_inputs(b, "cuda"), use_cache=False).logits, b)

    def separate(model, name):
        out = []
        for k in range(len(triples)):
            row = int(b["pair_row"][k])
            (p0, p1), (c0, c1), (r0, r1) = (b[f"{w}_spans"][k].tolist() for w in ("prompt", "chosen", "rejected"))
            ids = b["input_ids"][row]
            res = []
            for s0, s1 in ((c0, c1), (r0, r1)):
                seq = torch.cat([ids[p0:p1], ids[s0:s1]])
                lp = alone(model, [seq], name)[0].log_softmax(-1)
                tgt = seq[p1 - p0:].cuda()
                res.append(lp[p1 - p0 - 1:-1].gather(-1, tgt[:, None]).sum())
            out.append(torch.stack(res))
        return torch.stack(out)

    want, base = separate(m32, "sdpa"), separate(m16, "sdpa")
    set_impl(m16, NAME)
    got = torch.stack([ch, rj], 1)
    e_got, e_base = (got - want).abs(), (base - want).abs()
    assert torch.isfinite(got).all()
    assert e_got.max() <= 2 * e_base.max() + 0.05, (e_got, e_base)


@pytest.mark.parametrize("kind", ["llama"])
def test_packed_sft_bf16_gradients_match_separate_documents(kind):
    m16, m32 = models(kind, seed=3)
    check_packed_sft_gradients(m16, m32, docs_for(4, 6, 50, 600), NAME, "sdpa", every_parameter=True)


@pytest.mark.parametrize("keep", [False, True])
def test_checkpointed_sft_keeps_the_attention_output(keep, monkeypatch):
    """keep_attention: the layers' recompute takes the kept attention output (one forward launch a
    layer instead of two) and the gradients stay those of the documents alone."""
    from flashmask.checkpointing import enable_activation_checkpointing

    m16, m32 = models("llama", seed=5)
    enable_activation_checkpointing(m16.train(), keep_attention=keep)
    launches = KernelLaunches(flashmask._cuda._C)
    monkeypatch.setattr(flashmask._cuda, "_C", launches)
    seen = []
    check_packed_sft_gradients(m16, m32, docs_for(5, 4, 50, 600), NAME, "sdpa", every_parameter=True,
                               after_packed=lambda: seen.append(launches.fwd_calls))
    layers = m16.config.num_hidden_layers
    assert seen == [layers * (1 if keep else 2)]
