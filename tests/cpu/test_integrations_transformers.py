"""The transformers backend ("fm_colmask") on tiny randomly initialised models, on the CPU.

Oracle: each document (or prompt + response) run alone through the same weights with ``sdpa``
and ``use_cache=False``. Works on transformers 4.53+ and 5.x.
"""
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashmask.integrations.transformers as fm_hf  # noqa: E402
from flashmask.data import (  # noqa: E402
    MASK_KEY,
    PackedSFTCollator,
    ShareQuestionCollator,
    logp_positions,
    model_inputs,
    pack_sequences,
    response_end_values,
    shared_sequence_logps,
)
from tests.model_zoo import set_impl  # noqa: E402

NAME = fm_hf.ATTN_IMPLEMENTATION
VOCAB = 256
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=256, attention_dropout=0.0)




def make_model(kind, name=NAME, seed=0):
    if kind == "llama":
        cfg, cls = transformers.LlamaConfig(**TINY), transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg, cls = transformers.Qwen2Config(**TINY), transformers.Qwen2ForCausalLM
    elif kind == "qwen2_sw":  # layer 0 full attention, layer 1 a sliding window of 4 tokens
        cfg = transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=4, max_window_layers=1)
        cls = transformers.Qwen2ForCausalLM
        assert cfg.layer_types == ["full_attention", "sliding_attention"]
    elif kind == "qwen2_sw16":  # a window longer than any test triple
        cfg = transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=1)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral_sw":
        cfg, cls = transformers.MistralConfig(**TINY, sliding_window=3), transformers.MistralForCausalLM
    elif kind == "gemma3_sw":  # layer 0 a sliding window of 4 tokens (Gemma 3's local layers), layer 1 global
        if not hasattr(transformers, "Gemma3TextConfig"):
            pytest.skip("this transformers has no Gemma 3")
        cfg = transformers.Gemma3TextConfig(**TINY, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                            layer_types=["sliding_attention", "full_attention"])
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    return cls._from_config(cfg, attn_implementation=name).eval()


_cache = {}


def model_for(kind):
    if kind not in _cache:
        _cache[kind] = make_model(kind)
    return set_impl(_cache[kind], NAME)


def separate_logits(model, seqs):
    """Logits of each sequence run alone with sdpa."""
    set_impl(model, "sdpa")
    try:
        with torch.no_grad():
            return [model(input_ids=torch.as_tensor(s)[None], use_cache=False).logits[0] for s in seqs]
    finally:
        set_impl(model, NAME)


def random_docs(seed, n=7, lo=2, hi=13):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g) for _ in range(n)]


def unpack_rows(docs, rows):
    """(row, start column, document index) of each document as the collator laid them out."""
    out = []
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            out.append((r, col, i))
            col += len(docs[i])
    return out


# ------------------------------------------------------------------------------------------------ registration

def test_backend_name_is_accepted_by_transformers():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert all(s not in NAME for s in ("flash", "sdpa", "flex_attention"))
    assert ALL_ATTENTION_FUNCTIONS[NAME] is fm_hf.flashmask_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[NAME] is fm_hf.padding_mask_function
    assert fm_hf.register() == NAME  # idempotent


@pytest.mark.parametrize("bad", ["flashmask", "my_sdpa", "flex_attention_fm", "paged|fm", "org/repo:fn", "eager", ""])
def test_register_rejects_reserved_names(bad):
    with pytest.raises(ValueError):
        fm_hf.register(bad)


def test_from_config_and_from_pretrained_select_backend(tmp_path, monkeypatch):
    calls = []
    real = fm_hf.flashmask_attention
    monkeypatch.setattr(fm_hf, "flashmask_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**TINY), attn_implementation=NAME)
    assert model.config._attn_implementation == NAME
    model = make_model("llama")
    assert model.config._attn_implementation == NAME
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME)
    assert loaded.config._attn_implementation == NAME
    with torch.no_grad():
        loaded(input_ids=torch.randint(0, VOCAB, (1, 9)))
    assert len(calls) == 2  # one per layer


def test_use_flashmask_switches_an_existing_model():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**TINY),
                                                        attn_implementation="sdpa").eval()
    docs = random_docs(1, n=3)
    want = separate_logits(model, docs)
    assert fm_hf.use_flashmask(model) is model and model.config._attn_implementation == NAME
    b = PackedSFTCollator(64, packing="sequential")([{"input_ids": d} for d in docs])
    with torch.no_grad():
        got = model(**model_inputs(b)).logits
    col = 0
    for d, w in zip(docs, want):
        torch.testing.assert_close(got[0, col:col + len(d)], w, atol=2e-5, rtol=1e-4)
        col += len(d)
    with pytest.raises(TypeError):
        fm_hf.use_flashmask(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------------ packed SFT

@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen2_sw", "mistral_sw", "gemma3_sw"])
@pytest.mark.parametrize("source", ["startend", "position_ids"])
def test_packed_batch_matches_documents_alone(kind, source):
    """Two packed rows with padding: logits at every real token equal the document run alone."""
    model = model_for(kind)
    docs = random_docs(len(kind) * 10 + len(source))
    collate = PackedSFTCollator(24, pad_token_id=0, padding="max_length")
    b = collate([{"input_ids": d} for d in docs])
    inputs = model_inputs(b)
    if source == "position_ids":
        del inputs[MASK_KEY]  # the backend derives the documents from the restarting position_ids
    with torch.no_grad():
        got = model(**inputs, use_cache=False).logits
    want = separate_logits(model, docs)
    rows = pack_sequences([len(d) for d in docs], 24, "bfd")  # the collator's grouping
    for r, start, i in unpack_rows(docs, rows):
        torch.testing.assert_close(got[r, start:start + len(docs[i])], want[i], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2_sw"])
def test_cu_seq_lens_match_documents_alone(kind):
    """TRL / DataCollatorWithFlattening style: one flattened row with cu_seq_lens_q/k."""
    model = model_for(kind)
    docs = random_docs(7, n=4)
    ids = torch.cat(docs)[None]
    cu = torch.tensor([0] + [len(d) for d in docs]).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    mx = max(len(d) for d in docs)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=mx,
                    max_length_k=mx, use_cache=False).logits
    want = torch.cat(separate_logits(model, docs))
    torch.testing.assert_close(got[0], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_transformers_flattening_collator(flash_kwargs):
    """DataCollatorWithFlattening (what TRL's padding-free mode builds on): position_ids, and
    cu_seq_lens_q/k with return_flash_attn_kwargs; its loss equals the documents' own losses."""
    model = model_for("llama")
    docs = random_docs(8, n=4)
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    b = collate([{"input_ids": d.tolist(), "labels": d.tolist()} for d in docs])
    assert ("cu_seq_lens_q" in b) == flash_kwargs
    with torch.no_grad():
        out = model(**b, use_cache=False)
    want = torch.cat(separate_logits(model, docs))
    torch.testing.assert_close(out.logits[0], want, atol=2e-5, rtol=1e-4)
    set_impl(model, "sdpa")
    with torch.no_grad():
        n = sum(len(d) - 1 for d in docs)
        sep = sum(model(input_ids=d[None], labels=d[None], use_cache=False).loss * (len(d) - 1) for d in docs) / n
    set_impl(model, NAME)
    torch.testing.assert_close(out.loss, sep, atol=1e-5, rtol=1e-5)


def test_resolve_mask_sources_agree_with_collator():
    docs = random_docs(3, n=5)
    b = PackedSFTCollator(64, packing="sequential", padding="longest")([{"input_ids": d} for d in docs])
    s = b["input_ids"].shape[1]
    cu = torch.tensor([0] + [len(d) for d in docs]).cumsum(0)
    from_cu = fm_hf._resolve_mask({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, True, 1, s, s, "cpu")
    from_pos = fm_hf._resolve_mask({"position_ids": b["position_ids"]}, True, 1, s, s, "cpu")
    assert torch.equal(from_cu, b[MASK_KEY]) and torch.equal(from_pos, b[MASK_KEY])
    # non-causal: document mask (LTS = doc end, UTE = doc start)
    import masks
    nc = fm_hf._resolve_mask({"position_ids": b["position_ids"]}, False, 1, s, s, "cpu")
    assert torch.equal(nc, masks.document(s, [len(d) for d in docs]))
    # cu_seqlens over two rows of a flattened batch: every row starts a document
    cu2 = torch.tensor([0, 3, 10, 16])
    two = fm_hf._resolve_mask({"cu_seq_lens_q": cu2, "cu_seq_lens_k": cu2}, True, 2, 8, 8, "cpu")
    assert two[:, 0, :, 0].tolist() == [[3, 3, 3, 8, 8, 8, 8, 8], [2, 2, 8, 8, 8, 8, 8, 8]]


def test_packed_sft_loss_and_gradients_equal_separate_documents():
    """labels -100 on each document's first token: the packed loss is the token-weighted mean of
    the documents' own losses (nothing is predicted across a boundary), and so are the gradients."""
    model = make_model("llama", seed=3).train()
    docs = random_docs(11, n=6)
    b = PackedSFTCollator(32)([{"input_ids": d} for d in docs])
    n_targets = sum(len(d) - 1 for d in docs)
    assert int((b["labels"] != -100).sum()) == n_targets
    loss = model(**b, use_cache=False).loss
    loss.backward()
    g_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    set_impl(model, "sdpa")
    total = 0.0
    for d in docs:
        lo = model(input_ids=d[None], labels=d[None], use_cache=False).loss * (len(d) - 1) / n_targets
        lo.backward()
        total = total + lo.detach()
    set_impl(model, NAME)
    torch.testing.assert_close(loss.detach(), total, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(g_packed[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


# ------------------------------------------------------------------------------------------------ padding, decoding

@pytest.mark.parametrize("side", ["right", "left"])
def test_2d_padding_mask_matches_sdpa(side):
    model = model_for("qwen2")
    g = torch.Generator().manual_seed(5)
    lens = [9, 5, 7]
    s = max(lens)
    ids = torch.randint(1, VOCAB, (3, s), generator=g)
    am = torch.zeros(3, s, dtype=torch.long)
    for i, n in enumerate(lens):
        if side == "right":
            am[i, :n] = 1
        else:
            am[i, s - n:] = 1
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=am, use_cache=False).logits
        set_impl(model, "sdpa")
        want = model(input_ids=ids, attention_mask=am, use_cache=False).logits
        set_impl(model, NAME)
    real = am.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "mistral_sw"])
def test_greedy_generation_with_dynamic_cache_matches_sdpa(kind):
    model = model_for(kind)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(1, VOCAB, (2, 6), generator=g)
    am = torch.ones_like(ids)
    am[1, :2] = 0  # left padding
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(input_ids=ids, attention_mask=am, **kw)
        set_impl(model, "sdpa")
        want = model.generate(input_ids=ids, attention_mask=am, **kw)
        set_impl(model, NAME)
    assert torch.equal(got, want)


def test_dense_4d_mask_is_converted_exactly():
    model = model_for("llama")
    docs = random_docs(4, n=3)
    b = PackedSFTCollator(32, packing="sequential")([{"input_ids": d} for d in docs])
    import masks
    s = b["input_ids"].shape[1]
    dense = masks.to_dense(b[MASK_KEY], True, s)  # [1, 1, S, S] bool
    with torch.no_grad():
        want = model(**model_inputs(b)).logits
        got = model(input_ids=b["input_ids"], position_ids=b["position_ids"], attention_mask=dense).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_no_dense_mask_reaches_the_attention_function():
    seen = []

    def spy(module, q, k, v, attention_mask, **kw):
        seen.append(None if attention_mask is None else tuple(attention_mask.shape))
        return fm_hf.flashmask_attention_forward(module, q, k, v, attention_mask, **kw)

    transformers.AttentionInterface.register("fm_colmask_spy", spy)
    transformers.masking_utils.AttentionMaskInterface.register("fm_colmask_spy", fm_hf.padding_mask_function)
    model = make_model("qwen2_sw", name="fm_colmask_spy")
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
        model(input_ids=ids, attention_mask=torch.ones(2, 10, dtype=torch.long), use_cache=False)
    assert seen == [None, None, (2, 10), (2, 10)]


# ------------------------------------------------------------------------------------------------ DPO / reward

def _triples(seed, n=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, c, r = (int(x) for x in torch.randint(1, 8, (3,), generator=g))
        out.append({k: torch.randint(0, VOCAB, (m,), generator=g)
                    for k, m in (("prompt_ids", p), ("chosen_ids", c), ("rejected_ids", r))})
    return out


def _separate_logps(model, triples):
    out = []
    for t in triples:
        p = t["prompt_ids"]
        res = []
        for key in ("chosen_ids", "rejected_ids"):
            seq = torch.cat([p, t[key]])
            lp = separate_logits(model, [seq])[0].double().log_softmax(-1)
            res.append(sum(lp[j - 1, seq[j]] for j in range(len(p), len(seq))))
        out.append(res)
    return torch.tensor(out)  # [N, 2]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen2_sw16"])
def test_dpo_shared_sequence_logps_equal_separate_sequences(kind):
    model = model_for(kind)
    triples = _triples(len(kind))
    b = ShareQuestionCollator(40, padding="max_length")(triples)
    assert b["input_ids"].shape[0] >= 2  # several rows, several triples per row
    with torch.no_grad():
        logits = model(**model_inputs(b), use_cache=False).logits
    ch, rj = shared_sequence_logps(logits, b)
    # the triples are numbered in row order; recover each one's tokens from its spans
    ordered = []
    for k in range(len(triples)):
        row = int(b["pair_row"][k])
        (p0, p1), (c0, c1), (r0, r1) = (b[f"{w}_spans"][k].tolist() for w in ("prompt", "chosen", "rejected"))
        ids = b["input_ids"][row]
        ordered.append({"prompt_ids": ids[p0:p1], "chosen_ids": ids[c0:c1], "rejected_ids": ids[r0:r1]})
    want = _separate_logps(model, ordered)
    torch.testing.assert_close(ch.double(), want[:, 0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(rj.double(), want[:, 1], atol=1e-4, rtol=1e-5)

    # LM head only at the needed columns gives the same.
    with torch.no_grad():
        hidden = model.get_decoder()(**model_inputs(b), use_cache=False).last_hidden_state
        ch2, rj2 = shared_sequence_logps(model.get_output_embeddings()(hidden[logp_positions(b)]), b)
    torch.testing.assert_close(ch2, ch, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rj2, rj, atol=1e-5, rtol=1e-5)

    # Reward-model scores: hidden state at each response's last token = that of the separate sequence.
    hc, hr = response_end_values(hidden, b)
    for k, t in enumerate(ordered):
        set_impl(model, "sdpa")
        with torch.no_grad():
            for key, h in (("chosen_ids", hc[k]), ("rejected_ids", hr[k])):
                seq = torch.cat([t["prompt_ids"], t[key]])[None]
                alone = model.get_decoder()(input_ids=seq, use_cache=False).last_hidden_state[0, -1]
                torch.testing.assert_close(h, alone, atol=2e-5, rtol=1e-4)
        set_impl(model, NAME)


def test_dpo_layout_longer_than_a_sliding_window_raises():
    """Rejected positions continue from the prompt, past the chosen span: a window of 4 tokens would
    hide different prompt tokens than in the separate sequence, and that mask has no column form."""
    model = model_for("qwen2_sw")
    triple = {"prompt_ids": list(range(1, 7)), "chosen_ids": [7, 8, 9], "rejected_ids": [10, 11]}
    b = ShareQuestionCollator(40)([triple])
    with pytest.raises(NotImplementedError, match="sliding_window=4"):
        model(**model_inputs(b), use_cache=False)


# ------------------------------------------------------------------------------------------------ errors

def test_softcap_and_sinks_reach_flashmask_attention(monkeypatch):
    """Gemma 2's softcap and GPT-OSS's s_aux arrive as flashmask_attention's softcap and sinks (the
    models themselves against eager: tests/cpu/test_model_zoo.py)."""
    seen = []
    real = fm_hf.flashmask_attention

    def spy(*a, **kw):
        seen.append((kw["softcap"], kw["sinks"]))
        return real(*a, **kw)

    monkeypatch.setattr(fm_hf, "flashmask_attention", spy)
    m = torch.nn.Module()
    q = torch.randn(1, 4, 5, 8)
    k = v = torch.randn(1, 2, 5, 8)
    sinks = torch.zeros(4)
    fm_hf.flashmask_attention_forward(m, q, k, v, None, softcap=30.0)
    fm_hf.flashmask_attention_forward(m, q, k, v, None, s_aux=sinks)
    fm_hf.flashmask_attention_forward(m, q, k, v, None, softcap=None, s_aux=None)
    assert seen == [(30.0, None), (0.0, sinks), (0.0, None)]
    with pytest.raises(ValueError, match="got both s_aux and sinks"):
        fm_hf.flashmask_attention_forward(m, q, k, v, None, s_aux=sinks, sinks=sinks)
    with pytest.raises(ValueError, match=r"sinks must have shape \[Hq\] = \[4\]"):
        fm_hf.flashmask_attention_forward(m, q, k, v, None, s_aux=torch.zeros(2))


def test_dropout_in_training_raises():
    model = transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**{**TINY, "attention_dropout": 0.1}),
                                                        attn_implementation=NAME)
    ids = torch.randint(0, VOCAB, (1, 5))
    model.eval()(input_ids=ids)  # eval: dropout is 0
    with pytest.raises(NotImplementedError, match="dropout"):
        model.train()(input_ids=ids)


def test_unsupported_arguments_raise():
    m = torch.nn.Module()
    q = torch.randn(1, 4, 5, 8)
    k = v = torch.randn(1, 2, 5, 8)
    f = fm_hf.flashmask_attention_forward
    for kw, what in [({"head_mask": torch.ones(4)}, "head_mask"),
                     ({"sliding_window": 2, "is_causal": False}, "sliding")]:
        with pytest.raises(NotImplementedError, match=what):
            f(m, q, k, v, None, **kw)
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k"):
        f(m, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 5]))
    with pytest.raises(NotImplementedError, match="cu_seq_lens_q != cu_seq_lens_k"):
        f(m, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 5]), cu_seq_lens_k=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="int32"):
        f(m, q, k, v, None, **{MASK_KEY: torch.zeros(1, 1, 5, 1)})
    with pytest.raises(NotImplementedError, match="additive bias"):
        f(m, q, k, v, torch.randn(1, 1, 5, 5))
    # static caches: keys that do not end at the last query
    with pytest.raises(NotImplementedError, match="static cache"):
        fm_hf.padding_mask_function(batch_size=1, q_length=3, q_offset=0, kv_length=16, kv_offset=0,
                                    attention_mask=None)
    with pytest.raises(NotImplementedError, match="extra mask functions"):
        fm_hf.padding_mask_function(batch_size=1, q_length=3, kv_length=3, use_vmap=True)


def test_mask_function_gives_the_segments_of_the_model_mask():
    """What transformers' own mask function hides between neighbours (packed documents, Llama 4's
    chunks) comes back as int32 segment ids (0 on padding); a plain causal mask as the padding mask."""
    from transformers.masking_utils import and_masks, causal_mask_function, packed_sequence_mask_function

    f = fm_hf.padding_mask_function
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])  # the packed-sequence index of each token
    packed = and_masks(causal_mask_function, packed_sequence_mask_function(docs))
    kw = dict(batch_size=1, q_length=8, q_offset=0, kv_length=8, kv_offset=0)
    assert f(**kw, mask_function=packed).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3]]
    am = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])
    got = f(**kw, mask_function=packed, attention_mask=am)
    assert got.dtype == torch.int32 and got.tolist() == [[1, 1, 1, 2, 2, 3, 3, 0]]
    assert f(**kw, mask_function=causal_mask_function) is None
    assert f(**kw, mask_function=causal_mask_function, attention_mask=am).tolist() == [am.bool().tolist()[0]]

    chunked = types.SimpleNamespace(attention_chunk_size=4)
    chunks = and_masks(causal_mask_function, lambda b, h, q, kv: q // 4 == kv // 4)
    assert f(**kw, mask_function=chunks, config=chunked).tolist() == [[1, 1, 1, 1, 2, 2, 2, 2]]
    with pytest.raises(NotImplementedError, match="chunked attention.*KV cache"):
        f(batch_size=1, q_length=1, q_offset=7, kv_length=8, kv_offset=0, mask_function=chunks, config=chunked)


def test_attention_function_reads_documents_and_chunks_from_segment_ids():
    """Segment ids split the documents of position_ids further (a chunk inside a document), and an
    explicit document mask of a chunked layer; a chunked layer without them, or with another explicit
    mask (DPO's shared prompt), raises rather than attend across its chunks."""
    import masks
    from flashmask import reference_attention

    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 10, 8), torch.randn(1, 1, 10, 8), torch.randn(1, 1, 10, 8)
    m = torch.nn.Module()
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    seg = torch.tensor([[1, 1, 1, 1, 2, 2, 3, 3, 3, 3]], dtype=torch.int32)  # chunks of 4 within each document
    seg[0, 9] = 0  # the last token is padding
    got, _ = fm_hf.flashmask_attention_forward(m, q, k, v, seg, position_ids=pos)
    mask = masks.from_cu_seqlens(torch.tensor([0, 4, 6, 10]), seqlen=10)
    mask[..., 9, 0] = 0
    want = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, causal=True)[0]
    torch.testing.assert_close(got[:, :9], want[:, :9])  # the padded query's row is never read

    m.layer_idx, m.config = 0, types.SimpleNamespace(attention_chunk_size=4, layer_types=["chunked_attention"])
    with pytest.raises(NotImplementedError, match="attention_chunk_size=4.*without the model's mask"):
        fm_hf.flashmask_attention_forward(m, q, k, v, None, position_ids=pos)
    # an explicit document mask (C=1) takes the chunks of the segments; a C=2 one raises
    got, _ = fm_hf.flashmask_attention_forward(m, q, k, v, seg, **{MASK_KEY: masks.from_cu_seqlens(
        torch.tensor([0, 6, 10]), seqlen=10)})
    torch.testing.assert_close(got[:, :9], want[:, :9])
    with pytest.raises(NotImplementedError, match=f"attention_chunk_size=4.*{MASK_KEY} other than a causal doc"):
        fm_hf.flashmask_attention_forward(m, q, k, v, seg, **{MASK_KEY: masks.share_question(10, [4, 3, 3])})
    m.config.attention_chunk_size = 10  # a chunk no shorter than the row hides nothing
    fm_hf.flashmask_attention_forward(m, q, k, v, None, position_ids=pos)


def test_attention_function_handles_gqa_noncausal_and_window_directly():
    """Direct calls against the reference path with dense masks (what sdpa would compute)."""
    import masks
    from flashmask import reference_attention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 8)
    k, v = torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    m = torch.nn.Module()
    m.is_causal = False
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]] * 2)
    out, w = fm_hf.flashmask_attention_forward(m, q, k, v, None, position_ids=pos)
    assert w is None and out.shape == (2, 9, 4, 8)
    want, _ = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  masks.document(9, [4, 3, 2], batch_size=2), causal=False)
    torch.testing.assert_close(out, want)
    m.is_causal = True
    out, _ = fm_hf.flashmask_attention_forward(m, q, k, v, None, sliding_window=3, scaling=0.3)
    want, _ = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  masks.sliding_window(9, 3, batch_size=2), causal=True, softmax_scale=0.3)
    torch.testing.assert_close(out, want)


def test_docstring_examples():
    import doctest

    res = doctest.testmod(fm_hf)
    assert res.failed == 0 and res.attempted >= 3


@pytest.mark.parametrize("cu, match", [
    ([0, 8, 20], r"cu_seq_lens_q must end at the number of tokens B \* S = 32, got cu_seq_lens_q\[-1\]=20 \(stops"),
    ([0, 8, 40], r"cu_seq_lens_q must end at .* B \* S = 32, got cu_seq_lens_q\[-1\]=40 \(runs past"),
    ([4, 8, 32], r"cu_seq_lens_q must start at 0, got \[4, 8, 32\]"),
    ([0, 20, 8, 32], r"cu_seq_lens_q must be non-decreasing, got .*cu_seq_lens_q\[2\]=8 < cu_seq_lens_q\[1\]=20"),
    ([[0, 8, 32]], r"cu_seq_lens_q must be a 1-D integer tensor"),
])
@pytest.mark.parametrize("bsz", [1, 2])
def test_cu_seq_lens_must_cover_the_batch_exactly(cu, match, bsz):
    """cu_seq_lens index the B * S = 32 flattened tokens: from 0, never down, to the last token."""
    m = torch.nn.Module()
    s = 32 // bsz
    q = torch.randn(bsz, 4, s, 8)
    k = v = torch.randn(bsz, 2, s, 8)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        fm_hf.flashmask_attention_forward(m, q, k, v, None, cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t)
    with pytest.raises(ValueError, match=match):  # a bad tensor is never remembered as checked
        fm_hf.flashmask_attention_forward(m, q, k, v, None, cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t)
    good = torch.tensor([0, 8, 8, 32], dtype=torch.int32)  # a repeat is an empty document
    fm_hf.flashmask_attention_forward(m, q, k, v, None, cu_seq_lens_q=good, cu_seq_lens_k=good)


def test_packed_position_ids_split_whatever_use_cache_eager_only_without_cache():
    """What the README says to users comparing backends on a row packed by position_ids alone:
    flashmask splits it with and without the cache, eager only with use_cache=False."""
    fm, eager = make_model("llama"), make_model("llama", name="eager")
    ids = torch.randint(0, VOCAB, (1, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        fm_cache, fm_plain = (fm(input_ids=ids, position_ids=pos, use_cache=c).logits for c in (True, False))
        eager_cache, eager_plain = (eager(input_ids=ids, position_ids=pos, use_cache=c).logits for c in (True, False))
    torch.testing.assert_close(fm_cache, fm_plain)
    torch.testing.assert_close(fm_plain, eager_plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fm_cache[:, :5], eager_cache[:, :5], atol=1e-5, rtol=1e-5)  # the first document
    assert (fm_cache[:, 5:] - eager_cache[:, 5:]).abs().max() > 1e-3  # eager's second document sees the first


def test_from_config_sets_the_backend_on_the_config_passed():
    cfg = transformers.LlamaConfig(**TINY)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)
    assert model.config._attn_implementation == NAME
    assert cfg._attn_implementation == NAME  # the README's warning: copy the config per model


# ------------------------------------------------------------------------------------------------ kept masks

def _masks_passed(monkeypatch):
    """The mask tensors the backend passes flashmask_attention, call by call."""
    passed, attend = [], fm_hf.flashmask_attention
    monkeypatch.setattr(fm_hf, "flashmask_attention", lambda q, k, v, m=None, **kw: passed.append(m) or
                        attend(q, k, v, m, **kw))
    return passed


@pytest.mark.parametrize("source", ["startend", "position_ids", "cu_seq_lens"])
def test_every_layer_gets_the_same_mask_tensor(monkeypatch, source):
    """One tensor for all layers of a forward (the kernels then compute its metadata once), and still
    each document's result."""
    model = model_for("llama")
    docs = random_docs(11, n=4)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    cu = torch.tensor([0] + [len(d) for d in docs]).cumsum(0).to(torch.int32)
    inputs = dict(input_ids=ids, position_ids=pos, use_cache=False)
    if source == "startend":
        inputs[MASK_KEY] = fm_hf.from_starts(fm_hf.document_starts(pos), True)
    elif source == "cu_seq_lens":
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=ids.shape[1], max_length_k=ids.shape[1])
    passed = _masks_passed(monkeypatch)
    with torch.no_grad():
        got = model(**inputs).logits
    assert len(passed) == 2 and passed[1] is passed[0]
    torch.testing.assert_close(got[0], torch.cat(separate_logits(model, docs)), atol=2e-5, rtol=1e-4)


def test_layer_mask_is_built_again_after_an_in_place_change(monkeypatch):
    """The same position_ids tensor with new documents written into it gives the new mask."""
    import masks
    from flashmask import reference_attention

    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 10, 8), torch.randn(1, 1, 10, 8), torch.randn(1, 1, 10, 8)
    m = torch.nn.Module()
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    passed = _masks_passed(monkeypatch)
    for lens in ([6, 4], [3, 7]):
        pos.copy_(torch.cat([torch.arange(n) for n in lens])[None])
        outs = [fm_hf.flashmask_attention_forward(m, q, k, v, None, position_ids=pos)[0] for _ in range(2)]
        assert passed[-1] is passed[-2]
        want = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   masks.causal_document(10, lens), causal=True)[0]
        for out in outs:
            torch.testing.assert_close(out, want)
    assert passed[0] is not passed[-1]


def test_a_dense_mask_is_not_kept_alive():
    """Layer masks are found again by their inputs, held weakly: a 4-D mask is O(S^2)."""
    import gc
    import weakref

    model = model_for("llama")
    ids = torch.randint(1, VOCAB, (1, 10))
    dense = torch.ones(1, 1, 10, 10, dtype=torch.bool).tril()
    alive = weakref.ref(dense)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=dense, use_cache=False)
    del dense
    gc.collect()
    assert alive() is None


def test_inference_mode_runs_and_keeps_no_layer_mask():
    """Inference tensors have no version counter: the layer mask is built on each call instead."""
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 2, 10, 8), torch.randn(1, 1, 10, 8), torch.randn(1, 1, 10, 8)
    m = torch.nn.Module()
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    want, _ = fm_hf.flashmask_attention_forward(m, q, k, v, None, position_ids=pos)
    fm_hf._layer_masks.clear()
    with torch.inference_mode():
        got, _ = fm_hf.flashmask_attention_forward(m, q, k, v, None, position_ids=pos.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(fm_hf._layer_masks) == 0


def test_window_position_check_follows_in_place_changes():
    """The check that a window means the same in indices and positions runs again when position_ids
    change in place: the rejected answer's positions continuing from the prompt fail it."""
    import masks

    torch.manual_seed(5)
    q, k, v = torch.randn(1, 2, 12, 8), torch.randn(1, 1, 12, 8), torch.randn(1, 1, 12, 8)
    m = torch.nn.Module()
    mask = masks.share_question(12, [6, 3, 3])
    pos = torch.arange(12)[None]
    kw = {MASK_KEY: mask, "position_ids": pos, "sliding_window": 4}
    fm_hf.flashmask_attention_forward(m, q, k, v, None, **kw)  # positions = indices: the check passes
    pos.copy_(torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 6, 7, 8]]))
    with pytest.raises(NotImplementedError, match="sliding_window=4"):
        fm_hf.flashmask_attention_forward(m, q, k, v, None, **kw)
