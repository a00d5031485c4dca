"""CPU checks of benchmarks/bench_train.py on the Gemma 3, DeepSeek-V3 and Llama 4 presets: their
shapes, the per-layer-type masks (document-causal, a sliding window on Gemma 3's sliding layers and
chunks on Llama 4's chunked ones) that flashmask, dense-mask SDPA and FlexAttention get, the logits
of a packed row under each against its documents run alone, and tiny end-to-end runs."""
import argparse

import pytest
import torch

import flashmask.integrations.transformers  # noqa: F401  (registers the fm_colmask backend)
from benchmarks import bench_train, train_data, train_masks
from flashmask.data import MASK_KEY
from masks.format import to_dense
from training_examples.models import build_model

CPU = torch.device("cpu")
ARCH_TINY = ["--device", "cpu", "--flashmask-backend", "reference", "--flex-no-compile", "--model-size", "tiny",
             "--vocab-size", "512", "--seqlens", "128", "--doc-len", "20,60"]


def _args(tmp_path, *extra):
    return bench_train.parse_args([*ARCH_TINY, "--out", str(tmp_path), *extra])


def _tiny(arch, method, sliding_window=None, layers=None):
    """The tiny preset of ``arch`` in float32 with the attention implementation of ``method``."""
    return build_model(arch, "tiny", attn_implementation=bench_train.ATTN_IMPLEMENTATION[method], max_length=128,
                       vocab_size=512, dtype=torch.float32, device="cpu", sliding_window=sliding_window,
                       num_layers=layers).eval()


# ------------------------------------------------------------------------------------------------ presets, CLI

def test_presets_have_the_published_attention_shapes():
    with torch.device("meta"):
        g = build_model("gemma3", "1b", attn_implementation="sdpa", max_length=131072, vocab_size=32000,
                        dtype=torch.bfloat16, device="meta")
        d = build_model("deepseek_v3", "16h", attn_implementation="sdpa", max_length=131072, vocab_size=32000,
                        dtype=torch.bfloat16, device="meta")
    c = g.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (1152, 6912, 26)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.sliding_window) == (4, 1, 256, 512)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17, 23]
    assert c.layer_types.count("sliding_attention") == 22 and c.max_position_embeddings == 131072
    assert bench_train.attention_dims(c) == (4, 1, 256, 256)
    c = d.config
    assert (c.q_lora_rank, c.kv_lora_rank, c.num_attention_heads) == (1536, 512, 16)
    assert bench_train.attention_dims(c) == (16, 16, 192, 128)
    assert all(type(layer.mlp).__name__ == "DeepseekV3MLP" for layer in d.model.layers)  # no mixture of experts
    assert train_masks.layer_windows(c) is None


def test_layers_and_window_options_of_the_presets():
    g = _tiny("gemma3", "sdpa_dense", sliding_window=5, layers=5)
    assert g.config.layer_types == ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    assert train_masks.layer_windows(g.config) == {"sliding_attention": 5, "full_attention": None}
    assert len(_tiny("deepseek_v3", "sdpa_dense", layers=3).model.layers) == 3
    for bad, match in (({"sliding_window": 4}, "sliding_window"), ({"num_layers": 0}, "num_layers")):
        with pytest.raises(ValueError, match=match):
            build_model("llama", "tiny", attn_implementation="sdpa", max_length=64, vocab_size=512,
                        dtype=torch.float32, device="cpu", **bad)
    with pytest.raises(ValueError, match="choose from"):
        build_model("gemma3", "0.5b", attn_implementation="sdpa", max_length=64, vocab_size=512,
                    dtype=torch.float32, device="cpu")


def test_cli_defaults_and_rejects_per_arch():
    assert bench_train.parse_args(["--arch", "gemma3"]).model_size == "1b"
    assert bench_train.parse_args(["--arch", "deepseek_v3"]).model_size == "16h"
    assert bench_train.parse_args([]).model_size == "0.5b"
    a = bench_train.parse_args(["--arch", "gemma3", "--layers", "6", "--sliding-window", "1024"])
    assert (a.layers, a.sliding_window, bench_train.model_name(a)) == (6, 1024, "gemma3-1b-6l")
    for bad in (["--arch", "gemma3", "--model-size", "0.5b"], ["--arch", "llama", "--model-size", "16h"],
                ["--layers", "0"], ["--arch", "llama", "--sliding-window", "64"],
                ["--arch", "deepseek_v3", "--sliding-window", "64"], ["--arch", "gemma3", "--sliding-window", "0"]):
        with pytest.raises(SystemExit):
            bench_train.parse_args(bad)


# ------------------------------------------------------------------------------------------------ masks

def test_layer_startends_are_document_causal_with_the_window():
    b = train_data.synthetic_batches(1, 2, 96, 50, (10, 40), seed=4)[0]
    startend, pos = b[MASK_KEY], b["position_ids"]
    got = train_masks.layer_startends(startend, {"sliding_attention": 7, "full_attention": None})
    assert got["full_attention"] is startend
    assert torch.equal(to_dense(got["sliding_attention"], True)[:, 0], train_masks.expected_mask(pos, 7))
    assert torch.equal(to_dense(startend, True)[:, 0], train_masks.expected_mask(pos, None))
    assert not torch.equal(train_masks.expected_mask(pos, 7), train_masks.expected_mask(pos, None))
    assert train_masks.layer_startends(startend, None) == {None: startend}
    # a window as long as the row changes nothing
    assert train_masks.layer_startends(startend, {"sliding_attention": 96})["sliding_attention"] is startend
    # chunks of 16 positions from each document's start
    got = train_masks.layer_startends(startend, {"chunked_attention": train_masks.Chunk(16)}, position_ids=pos)
    want = train_masks.expected_mask(pos, train_masks.Chunk(16))
    assert torch.equal(to_dense(got["chunked_attention"], True)[:, 0], want)
    assert not torch.equal(want, train_masks.expected_mask(pos, None))


@pytest.mark.parametrize("method, flex_mask", [  # transformers compiles its block-mask builder: slow on the CPU
    ("sdpa_dense", "block_mask"), ("flex", "block_mask"), pytest.param("flex", "position_ids", marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", ["gemma3", "deepseek_v3", "llama4"])
def test_method_masks_pass_the_check_and_a_missing_window_fails_it(arch, method, flex_mask, tmp_path, monkeypatch):
    if method == "flex":
        pytest.importorskip("torch.nn.attention.flex_attention")
    extra = ["--sliding-window", "8"] if arch == "gemma3" else []
    args = _args(tmp_path, "--arch", arch, "--flex-mask", flex_mask, *extra)
    model = _tiny(arch, method, sliding_window=8 if arch == "gemma3" else None)
    note = train_masks.check_layer_masks(method, model, args, 128, CPU, torch.float32)
    assert note == "masks checked on a 128-token row" + (" per layer type" if arch != "deepseek_v3" else "")
    if flex_mask == "position_ids" and arch != "llama4":
        b = train_data.synthetic_batches(1, 1, 128, 512, (20, 60), seed=5)[0]
        train_masks.check_hf_packed_block_mask(model, args, b, CPU, torch.float32)  # no raise
    if arch == "llama4" and flex_mask == "block_mask":  # our masks without the chunks
        monkeypatch.setattr(train_masks, "layer_startends", lambda se, windows, **kw: {t: se for t in windows})
        with pytest.raises(RuntimeError, match="chunked_attention layers' mask differs"):
            train_masks.check_layer_masks(method, model, args, 128, CPU, torch.float32)
    if arch != "gemma3":
        return
    if flex_mask == "position_ids":  # transformers' masks, had it no window on the sliding layers
        from transformers import masking_utils
        monkeypatch.setattr(masking_utils, "create_sliding_window_causal_mask", masking_utils.create_causal_mask)
        with pytest.raises(RuntimeError, match="sliding_attention layers' mask differs"):
            train_masks.check_layer_masks(method, model, args, 128, CPU, torch.float32)
        return
    # our masks without the window on the sliding layers
    monkeypatch.setattr(train_masks, "layer_startends", lambda se, windows, **kw: {t: se for t in windows})
    with pytest.raises(RuntimeError, match="sliding_attention layers' mask differs .* with the sliding window"):
        train_masks.check_layer_masks(method, model, args, 128, CPU, torch.float32)


# ------------------------------------------------------------------------------------------------ logits

def _packed_logits_vs_documents(arch, methods, sliding_window=None):
    """Logits of one packed row (documents longer than the window) under each method, each
    document's slice against the document run alone with sdpa (transformers' own masks)."""
    args = argparse.Namespace(dense_mask="additive", flex_mask="block_mask", flex_block_mask="eager")
    b = train_data.synthetic_batches(1, 1, 128, 512, (20, 60), seed=6)[0]
    pos = b["position_ids"][0]
    starts = (pos == 0).nonzero().flatten().tolist() + [128]
    alone = _tiny(arch, "sdpa_dense", sliding_window)
    with torch.no_grad():
        want = [alone(input_ids=b["input_ids"][:, s:e], use_cache=False).logits[0]
                for s, e in zip(starts[:-1], starts[1:])]
    got = {}
    for method in methods:
        model = _tiny(arch, method, sliding_window)
        kw = train_masks.mask_inputs(method, args, b, CPU, torch.float32, train_masks.layer_windows(model.config))
        with torch.no_grad():
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False, **kw).logits
        for (s, e), w in zip(zip(starts[:-1], starts[1:]), want):
            torch.testing.assert_close(logits[0, s:e], w, atol=2e-5, rtol=1e-4, msg=f"{method}, tokens {s}:{e}")
        got[method] = logits
    return got, b


@pytest.mark.parametrize("arch", ["gemma3", "deepseek_v3", "llama4"])
def test_flashmask_and_dense_sdpa_logits_equal_documents_alone(arch):
    got, b = _packed_logits_vs_documents(arch, ["flashmask", "sdpa_dense"], 8 if arch == "gemma3" else None)
    if arch == "gemma3":  # the window matters here: without it the logits differ
        model = _tiny(arch, "sdpa_dense", 8)
        no_window = train_masks.mask_inputs("sdpa_dense", argparse.Namespace(dense_mask="additive"), b, CPU,
                                            torch.float32, None)
        with torch.no_grad():
            wrong = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False,
                          **no_window).logits
        assert (wrong - got["sdpa_dense"]).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3", "deepseek_v3"])
def test_flex_logits_equal_documents_alone(arch):
    """FlexAttention's forward (transformers compiles it, also on the CPU) with our block masks."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    _packed_logits_vs_documents(arch, ["flex"], 8 if arch == "gemma3" else None)


# ------------------------------------------------------------------------------------------------ end to end

@pytest.mark.parametrize("arch", ["gemma3", "deepseek_v3", "llama4"])
def test_end_to_end_on_cpu(arch, tmp_path):
    extra = ["--sliding-window", "16"] if arch == "gemma3" else []
    rows = bench_train.run(_args(tmp_path, "--arch", arch, "--gradient-checkpointing", "--steps", "1",
                                 "--warmup-steps", "1", *extra))
    by = {r["method"]: r for r in rows}
    assert list(by) == ["flashmask", "sdpa_dense", "flex"]
    for m in ("flashmask", "sdpa_dense"):
        assert by[m]["status"] == "ok", by[m]
        assert by[m]["model"] == f"{arch}-tiny" and by[m]["params"] > 0
    assert by["flashmask"]["loss_first"] == pytest.approx(by["sdpa_dense"]["loss_first"], rel=1e-3)
    assert "masks checked on a 128-token row" in by["sdpa_dense"]["notes"]
    if arch == "gemma3":
        assert "sliding window 16 on 1/2 layers" in by["flashmask"]["notes"]
        assert "per layer type (2)" in by["sdpa_dense"]["notes"]
    if arch == "llama4":
        assert "chunks of 16 on 3/4 layers" in by["flashmask"]["notes"]
    # FlexAttention has no backward on the CPU: its masks pass the check, then the first step fails.
    flex = by["flex"]
    if flex["status"] != "ok":
        assert flex["status"] == "error" and flex["notes"].startswith("step 1/2") and "CPU" in flex["notes"], flex
