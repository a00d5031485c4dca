"""The transformers backend ("fm_colmask") on the attention of today's open model families, float32 on
the CPU, against transformers' eager attention.

Families (tests/model_zoo.py): Llama 3, Qwen3, Mistral (sliding window), Phi-3 (head dim 96), Gemma 2
(soft-capping, sliding and global layers, head dim 256), Gemma 3 (sliding and global, head dim 256),
GPT-OSS (attention sinks, sliding and global, head dim 64, a tiny mixture of experts), DeepSeek-V3
(multi-head latent attention: q/k 192, v 128) and Llama 4 (chunked attention and a global layer
without RoPE; it does not pass position_ids to its attention). For each: what reaches the attention
(head dims, heads, window per layer, softcap, sinks), then logits and every parameter's gradient (the sinks'
included) on a plain batch, on padded batches (right and left), and on one row packed from documents
told apart only by restarting position_ids, against eager on each document alone.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashmask.integrations.transformers as fm_hf  # noqa: E402
from tests import model_zoo as zoo  # noqa: E402
from tests.model_zoo import VOCAB, make_model, padded_batch, set_impl  # noqa: E402
from tests.model_zoo import logits_and_grads as zoo_logits_and_grads  # noqa: E402

NAME = fm_hf.ATTN_IMPLEMENTATION
TOL = dict(atol=2e-5, rtol=1e-4)


def families():
    return [pytest.param(f, id=f, marks=pytest.mark.skipif(not zoo.has_family(transformers, f),
                                                           reason=f"this transformers has no {f}"))
            for f in zoo.FAMILIES]


def logits_and_grads(model, name, batches):
    return zoo_logits_and_grads(model, name, batches, restore=NAME)


def assert_grads_close(model, got, want):
    assert got.keys() == want.keys() and len(got) > 10
    for n in zoo.sinks_parameters(model):  # the sinks are learned: they get a gradient on both sides
        assert n in got and got[n].abs().sum() > 0, n
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("family", families())
def test_the_family_attention_reaches_the_backend(family, monkeypatch):
    """Each layer's call: q/k and v head dims, query and key/value heads, the window of sliding layers
    (none on global ones), softcap and sinks, as the family has them."""
    seen = []
    real = fm_hf.flashmask_attention

    def spy(q, k, v, *a, **kw):
        seen.append((q.shape[-1], v.shape[-1], q.shape[2], k.shape[2], kw["window_size"], kw["softcap"],
                     kw["sinks"] is not None))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(fm_hf, "flashmask_attention", spy)
    model = make_model(transformers, family, NAME).eval()
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (1, 2 * zoo.WINDOW)), use_cache=False)
    a = zoo.SHAPES[family]
    # transformers' window w (key j visible from query i iff i - w < j <= i) is flash-attn's (w - 1, 0)
    want = [(a["dqk"], a["dv"], a["hq"], a["hk"], None if w is None else (w - 1, 0), a["softcap"], a["sinks"])
            for w in a["windows"]]
    assert seen == want


def _feature_off(model, family):
    """Turn the family's soft-capping or sinks off in place (eager reads them on every call)."""
    for layer in model.model.layers:
        attn = layer.self_attn
        if family == "gemma2":
            attn.attn_logit_softcapping = None
        else:
            with torch.no_grad():
                attn.sinks.fill_(float("-inf"))  # exp(-inf) = 0: no sink


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_the_options_change_the_logits_far_beyond_the_tolerance(family):
    """Without this, the comparisons below could not tell a model that ignores softcap or sinks."""
    model = make_model(transformers, family, "eager").eval()
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        on = model(input_ids=ids, use_cache=False).logits
        _feature_off(model, family)
        off = model(input_ids=ids, use_cache=False).logits
    assert (on - off).abs().max() > 1000 * TOL["atol"] * max(1.0, float(on.abs().max()))


@pytest.mark.parametrize("family", families())
def test_plain_batch_matches_eager(family):
    model = make_model(transformers, family, NAME, seed=1)
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))
    batch = [{"input_ids": ids, "labels": ids}]
    (got,), got_g = logits_and_grads(model, NAME, batch)
    (want,), want_g = logits_and_grads(model, "eager", batch)
    torch.testing.assert_close(got, want, **TOL)
    assert_grads_close(model, got_g, want_g)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", families())
def test_padded_batch_matches_eager(family, side):
    model = make_model(transformers, family, NAME, seed=2)
    batch = [padded_batch([13, 6, 9], side, seed=2)]
    (got,), got_g = logits_and_grads(model, NAME, batch)
    (want,), want_g = logits_and_grads(model, "eager", batch)
    real = batch[0]["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], **TOL)
    assert_grads_close(model, got_g, want_g)


def packed_row(seed=3):
    """Documents of 5, 11, 4 and 9 tokens in one row, told apart by restarting position_ids only; each
    document's first token has no label."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 11, 4, 9)]
    labels = [d.clone() for d in docs]
    for x in labels:
        x[0] = -100
    row = {"input_ids": torch.cat(docs)[None], "position_ids": torch.cat([torch.arange(len(d)) for d in docs])[None],
           "labels": torch.cat(labels)[None]}
    return docs, row


@pytest.mark.parametrize("chunk", [zoo.CHUNK, 1024], ids=["chunked", "chunk_longer_than_the_row"])
def test_llama4_packed_row_matches_eager_on_the_row(chunk):
    """Llama 4 does not pass position_ids on to its attention: the backend reads the documents (and,
    with chunks, the chunks) from the model's own mask, so it matches eager on the same packed row on
    any transformers (reading neither, it attended across the documents)."""
    if not zoo.has_family(transformers, "llama4"):
        pytest.skip("this transformers has no llama4")
    model = make_model(transformers, "llama4", NAME, seed=4, attention_chunk_size=chunk)
    _, row = packed_row(seed=4)
    (got,), got_g = logits_and_grads(model, NAME, [row])
    (want,), want_g = logits_and_grads(model, "eager", [row])
    torch.testing.assert_close(got, want, **TOL)
    assert_grads_close(model, got_g, want_g)
    whole = dict(row, position_ids=torch.arange(row["input_ids"].shape[1])[None])
    (across,), _ = logits_and_grads(model, "eager", [whole])
    assert (across - want).abs().max() > 1000 * TOL["atol"]


@pytest.mark.parametrize("family", families())
def test_packed_row_matches_each_document_alone_under_eager(family):
    """One row of documents told apart by restarting position_ids only (some longer than the sliding
    window); each document's first token has no label, so the packed loss is the token-weighted mean
    of the documents' own losses."""
    if family == "llama4" and not zoo.chunks_follow_documents(transformers):
        pytest.skip("this transformers counts Llama 4's chunks from the packed row's first token")
    model = make_model(transformers, family, NAME, seed=3)
    docs, row = packed_row()
    (got,), got_g = logits_and_grads(model, NAME, [row])

    n_targets = sum(len(d) - 1 for d in docs)
    set_impl(model, "eager")
    model.zero_grad()
    want = []
    for d in docs:
        out = model(input_ids=d[None], labels=d[None], use_cache=False)
        (out.loss * (len(d) - 1) / n_targets).backward()
        want.append(out.logits.detach()[0])
    want_g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    set_impl(model, NAME)
    col = 0
    for d, w in zip(docs, want):
        torch.testing.assert_close(got[0, col:col + len(d)], w, **TOL)
        col += len(d)
    assert_grads_close(model, got_g, want_g)
