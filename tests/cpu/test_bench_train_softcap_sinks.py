"""CPU checks of benchmarks/bench_train.py on the Gemma 2 (logit soft-capping) and GPT-OSS
(attention sinks) presets: their shapes, the methods offered (SDPA, which can compute neither, is
an n/a row with the reason), eager attention's dense masks and fit, the chunked loss with the final
soft-capping, the logits of a packed row under flashmask and eager attention against each
document run alone (where the option visibly matters), a CUDA backend that refuses options the
kernels lack, and tiny end-to-end runs."""
import argparse

import pytest
import torch

import flashmask
import flashmask.integrations.transformers  # noqa: F401  (registers the fm_colmask backend)
from benchmarks import bench_train, cuda_memory, train_data, train_masks
from flashmask import _checks
from training_examples.models import build_model

CPU = torch.device("cpu")
ARCH_TINY = ["--device", "cpu", "--flashmask-backend", "reference", "--flex-no-compile", "--model-size", "tiny",
             "--vocab-size", "512", "--seqlens", "128", "--doc-len", "20,60"]


def _args(tmp_path, *extra):
    return bench_train.parse_args([*ARCH_TINY, "--out", str(tmp_path), *extra])


def _tiny(arch, method, sliding_window=8):
    return build_model(arch, "tiny", attn_implementation=bench_train.ATTN_IMPLEMENTATION[method], max_length=128,
                       vocab_size=512, dtype=torch.float32, device="cpu", sliding_window=sliding_window).eval()


def _sharpen(model, softcap=2.0, sinks_std=2.0):
    """Scores of several units, a cap of a few units (Gemma 2) and sinks of a few units (GPT-OSS), so
    that the option changes the logits; the same for every model built with the same seed."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.mul_(60.0)
            if getattr(attn, "attn_logit_softcapping", None):
                attn.attn_logit_softcapping = softcap
            if hasattr(attn, "sinks"):
                attn.sinks.copy_(torch.randn(attn.sinks.shape, generator=g) * sinks_std)
    return model


# ------------------------------------------------------------------------------------------------ presets, CLI

def test_presets_have_the_published_attention_shapes():
    with torch.device("meta"):
        g = build_model("gemma2", "2b", attn_implementation="eager", max_length=131072, vocab_size=32000,
                        dtype=torch.bfloat16, device="meta")
        o = build_model("gpt_oss", "20b", attn_implementation="eager", max_length=131072, vocab_size=32000,
                        dtype=torch.bfloat16, device="meta")
    c = g.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (2304, 9216, 8)
    assert bench_train.attention_dims(c) == (8, 4, 256, 256) and c.query_pre_attn_scalar == 256
    assert (c.attn_logit_softcapping, c.final_logit_softcapping, c.sliding_window) == (50.0, 30.0, 4096)
    assert c.layer_types == ["sliding_attention", "full_attention"] * 4
    assert train_masks.layer_windows(c) == {"sliding_attention": 4096, "full_attention": None}
    c = o.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (2880, 2880, 8)
    assert bench_train.attention_dims(c) == (64, 8, 64, 64) and c.sliding_window == 128
    assert c.layer_types == ["sliding_attention", "full_attention"] * 4
    assert (c.num_local_experts, c.num_experts_per_tok) == (1, 1)  # one expert every token takes: a dense MLP
    assert c.rope_parameters["rope_type"] == "yarn"
    assert all(layer.self_attn.sinks.shape == (64,) for layer in o.model.layers)


def test_gpt_oss_single_expert_runs_dense_with_the_model_s_values_and_gradients():
    """The preset's one expert runs as a dense MLP (no token gather and scatter) with the values and
    gradients of transformers' own expert loop."""
    from training_examples.models import _single_expert_forward
    dense = _tiny("gpt_oss", "eager_dense")
    loop = _tiny("gpt_oss", "eager_dense")
    for layer in loop.model.layers:
        del layer.mlp.experts.forward  # back to the class's expert loop
    for m in (dense, loop):
        assert all((layer.mlp.experts.forward.__func__ is _single_expert_forward) == (m is dense)
                   for layer in m.model.layers)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights of a few units, so that the clamped SwiGLU clamps somewhere
        for a, b in zip(dense.model.layers, loop.model.layers):
            for n, p in a.mlp.experts.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 3)
                dict(b.mlp.experts.named_parameters())[n].copy_(p)
    ids = torch.randint(0, 512, (2, 40), generator=g)
    out = [m(input_ids=ids).logits for m in (dense, loop)]
    assert out[0].abs().max() > 0
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)
    for o in out:
        o.square().mean().backward()
    for (n, a), (_, b) in zip(dense.named_parameters(), loop.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_cli_defaults_per_arch():
    for arch, size in (("gemma2", "2b"), ("gpt_oss", "20b")):
        a = bench_train.parse_args(["--arch", arch])
        assert a.model_size == size and a.methods == ["flashmask", "flex", "eager_dense"]
        a = bench_train.parse_args(["--arch", arch, "--layers", "26", "--sliding-window", "1024"])
        assert (a.layers, a.sliding_window, bench_train.model_name(a)) == (26, 1024, f"{arch}-{size}-26l")
    assert bench_train.parse_args([]).methods == ["flashmask", "sdpa_dense", "flex"]
    assert bench_train.parse_args(["--arch", "gemma3"]).methods == ["flashmask", "sdpa_dense", "flex"]
    assert bench_train.parse_args(["--methods", "eager_dense,flashmask"]).methods == ["eager_dense", "flashmask"]
    for bad in (["--arch", "gemma2", "--model-size", "1b"], ["--arch", "gpt_oss", "--sliding-window", "0"]):
        with pytest.raises(SystemExit):
            bench_train.parse_args(bad)


# ------------------------------------------------------------------------------------------------ masks, loss

@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("method", ["eager_dense", "flex"])
def test_method_masks_pass_the_check(arch, method, tmp_path, monkeypatch):
    if method == "flex":
        pytest.importorskip("torch.nn.attention.flex_attention")
    args = _args(tmp_path, "--arch", arch, "--sliding-window", "8", "--dense-mask", "bool")
    model = _tiny(arch, method)
    assert train_masks.check_layer_masks(method, model, args, 128, CPU, torch.float32) == \
        "masks checked on a 128-token row per layer type"
    if method == "eager_dense":  # eager attention adds its mask to the scores: additive whatever --dense-mask says
        b = train_data.synthetic_batches(1, 1, 128, 512, (20, 60), seed=5)[0]
        masks = train_masks.mask_inputs(method, args, b, CPU, torch.float32, train_masks.layer_windows(model.config))
        assert {m.dtype for m in masks["attention_mask"].values()} == {torch.float32}
    # without the window on the sliding layers the check fails
    monkeypatch.setattr(train_masks, "layer_startends", lambda se, windows, **kw: {t: se for t in windows})
    with pytest.raises(RuntimeError, match="sliding_attention layers' mask differs .* with the sliding window"):
        train_masks.check_layer_masks(method, model, args, 128, CPU, torch.float32)


def test_eager_fit_counts_the_masks_and_one_layers_attention_weights(tmp_path, monkeypatch):
    from benchmarks.dense_masks import eager_fit
    fits, note = eager_fit(1, 8, 2, 1024, 1024, torch.bfloat16, CPU)
    assert fits and note == "2 S^2 additive mask(s) = 0.0 GB + one layer's attention weights >= 0.0 GB"
    # 2 masks of 2 bytes + 2 x 8 heads of 2 bytes per (query, key) pair: 36 bytes; half the free memory below
    monkeypatch.setattr(cuda_memory, "free_memory_bytes", lambda device: 2 * 36 * 1024 ** 2 - 2)
    fits, note = eager_fit(1, 8, 2, 1024, 1024, torch.bfloat16, torch.device("cuda"))
    assert not fits and note.startswith("does not fit (2 S^2 additive mask(s)")
    monkeypatch.setattr(cuda_memory, "free_memory_bytes", lambda device: 2 * 36 * 1024 ** 2)
    assert eager_fit(1, 8, 2, 1024, 1024, torch.bfloat16, torch.device("cuda"))[0]


def test_chunked_loss_applies_the_final_softcap():
    model = build_model("gemma2", "tiny", attn_implementation="eager", max_length=64, vocab_size=320,
                        dtype=torch.float32, device="cpu")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(300.0)  # logits of tens of units: the cap at 30 bends them
    b = train_data.synthetic_batches(1, 2, 64, 320, (5, 30), seed=0)[0]
    inputs = dict(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False)
    full = model(labels=b["labels"], **inputs).loss
    hidden = model.get_decoder()(**inputs).last_hidden_state
    head, labels = model.get_output_embeddings(), b["labels"]
    chunked = bench_train.chunked_lm_loss(hidden, head, labels, chunk=24, softcap=30.0)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)
    assert abs(float(bench_train.chunked_lm_loss(hidden, head, labels, chunk=24)) - float(full)) > 1e-2
    g_full = torch.autograd.grad(full, head.weight)[0]
    torch.testing.assert_close(torch.autograd.grad(chunked, head.weight)[0], g_full, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------ logits

@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_flashmask_and_eager_logits_equal_documents_alone(arch):
    """A packed row (documents longer than the window) under flashmask and eager attention with our
    dense masks: each document's logits equal the document run alone (eager, transformers' masks);
    and without the option (no cap, sinks that take nothing) they differ: the comparison sees it."""
    args = argparse.Namespace(dense_mask="additive")
    b = train_data.synthetic_batches(1, 1, 128, 512, (20, 60), seed=6)[0]
    starts = (b["position_ids"][0] == 0).nonzero().flatten().tolist() + [128]
    spans = list(zip(starts[:-1], starts[1:]))
    alone = _sharpen(_tiny(arch, "eager_dense"))
    with torch.no_grad():
        want = [alone(input_ids=b["input_ids"][:, s:e], use_cache=False).logits[0] for s, e in spans]
    for method in ("flashmask", "eager_dense"):
        model = _sharpen(_tiny(arch, method))
        kw = train_masks.mask_inputs(method, args, b, CPU, torch.float32, train_masks.layer_windows(model.config))
        with torch.no_grad():
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False, **kw).logits
        for (s, e), w in zip(spans, want):
            torch.testing.assert_close(logits[0, s:e], w, atol=1e-4, rtol=1e-4, msg=f"{method}, tokens {s}:{e}")
    off = _sharpen(_tiny(arch, "flashmask"), softcap=None, sinks_std=0.0)
    if arch == "gpt_oss":
        with torch.no_grad():
            for layer in off.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink
    kw = train_masks.mask_inputs("flashmask", args, b, CPU, torch.float32, None)
    with torch.no_grad():
        wrong = off(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False, **kw).logits
    assert (wrong[0, :starts[1]] - want[0]).abs().max() > 1e-2


@pytest.mark.slow
def test_flex_logits_with_softcap_equal_documents_alone():
    """transformers' flex_attention (compiled by transformers, also on the CPU) with our block masks
    and its soft-capping score_mod. (Its sinks need the LSE, which it does not return on the CPU.)"""
    pytest.importorskip("torch.nn.attention.flex_attention")
    args = argparse.Namespace(dense_mask="additive", flex_mask="block_mask", flex_block_mask="eager")
    b = train_data.synthetic_batches(1, 1, 128, 512, (20, 60), seed=6)[0]
    windows = {"sliding_attention": 8, "full_attention": None}
    with torch.no_grad():
        outs = [_sharpen(_tiny("gemma2", m))(input_ids=b["input_ids"], position_ids=b["position_ids"],
                                             use_cache=False,
                                             **train_masks.mask_inputs(m, args, b, CPU, torch.float32, windows)).logits
                for m in ("eager_dense", "flex")]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ end to end

def test_cuda_backend_takes_the_options(tmp_path, monkeypatch):
    monkeypatch.setattr(flashmask.cuda, "available", lambda: True)
    monkeypatch.setattr(_checks, "kernel_unsupported_reason", lambda q, k, v: None)
    for arch in ("gemma2", "gpt_oss"):
        args = _args(tmp_path, "--arch", arch, "--flashmask-backend", "cuda")
        notes = bench_train.check_method("flashmask", args, _tiny(arch, "flashmask"), 128, CPU, torch.float32)
        assert notes[0].startswith("sliding window 8 on 1/2 layers")


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_end_to_end_on_cpu(arch, tmp_path):
    rows = bench_train.run(_args(tmp_path, "--arch", arch, "--gradient-checkpointing", "--steps", "1",
                                 "--warmup-steps", "1", "--sliding-window", "16",
                                 "--methods", "flashmask,sdpa_dense,flex,eager_dense"))
    by = {r["method"]: r for r in rows}
    assert list(by) == ["flashmask", "sdpa_dense", "flex", "eager_dense"]
    for m in ("flashmask", "eager_dense"):
        assert by[m]["status"] == "ok", by[m]
        assert by[m]["model"] == f"{arch}-tiny" and by[m]["attn_implementation"] == \
            bench_train.ATTN_IMPLEMENTATION[m]
    assert by["eager_dense"]["attn_implementation"] == "eager"
    assert by["flashmask"]["loss_first"] == pytest.approx(by["eager_dense"]["loss_first"], rel=1e-3)
    option = "attention softcap 50" if arch == "gemma2" else "sinks"
    assert option in by["flashmask"]["notes"] and option in by["eager_dense"]["notes"]
    dense = by["sdpa_dense"]
    assert dense["status"] == "n/a" and dense["notes"].startswith(bench_train.NO_SDPA[arch])
    assert "transformers refuses attn_implementation='sdpa'" in dense["notes"]
    # FlexAttention has no backward on the CPU (and, for the sinks, returns no LSE there): an error row.
    flex = by["flex"]
    if flex["status"] != "ok":
        assert flex["status"] == "error" and flex["notes"].startswith("step 1/2") and "CPU" in flex["notes"], flex
