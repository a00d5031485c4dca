"""CPU checks of benchmarks/bench_train.py: the synthetic packed data, the chunked loss, the CLI, a
tiny end-to-end run (flashmask, dense-mask SDPA, flex), error rows, and the --find-max search."""
import csv
import json

import pytest
import torch

from benchmarks import bench_train, cuda_memory, train_data, train_masks
from benchmarks.dense_masks import dense_fit, dense_mask
from flashmask.data import MASK_KEY
from masks.format import to_dense
from training_examples.models import build_model

# A tiny model and a small vocabulary keep a CPU step at tens of milliseconds.
TINY = ["--device", "cpu", "--flashmask-backend", "reference", "--flex-no-compile", "--model-size", "tiny",
        "--vocab-size", "512", "--seqlens", "256", "--steps", "2", "--warmup-steps", "1", "--doc-len", "16,100"]


def _args(tmp_path, *extra):
    return bench_train.parse_args([*TINY, "--out", str(tmp_path), *extra])


def test_synthetic_batches_fill_rows_with_packed_documents():
    batches = train_data.synthetic_batches(3, 2, 300, 50, (10, 120), seed=1)
    again = train_data.synthetic_batches(3, 2, 300, 50, (10, 120), seed=1)
    assert len(batches) == 3
    for b, b2 in zip(batches, again):
        assert all(torch.equal(b[k], b2[k]) for k in b)  # the same data for every method
        assert b["input_ids"].shape == (2, 300) and b[MASK_KEY].shape == (2, 1, 300, 1)
        assert int(b["input_ids"].max()) < 50
        pos, labels = b["position_ids"], b["labels"]
        starts = pos == 0
        assert starts[:, 0].all() and (labels[starts] == -100).all() and (labels[~starts] >= 0).all()
        # every document but the row's last one is 10..120 tokens; the mask is the causal-document one
        doc = starts.long().cumsum(1)
        for r in range(2):
            lens = torch.bincount(doc[r])[1:]
            assert int(lens.sum()) == 300 and (lens[:-1] >= 10).all() and (lens <= 120).all()
            same = (doc[r][:, None] == doc[r][None, :]) & torch.ones(300, 300, dtype=torch.bool).tril()
            assert torch.equal(to_dense(b[MASK_KEY][r:r + 1], True)[0, 0], same)
    stats = train_data.data_stats(batches)
    assert stats["docs_per_row"] >= 3 and 0 < stats["density"] < 0.5


def test_chunked_loss_equals_transformers_loss():
    model = build_model("llama", "tiny", attn_implementation="sdpa", max_length=64, vocab_size=320,
                        dtype=torch.float32, device="cpu")
    b = train_data.synthetic_batches(1, 2, 64, 320, (5, 30), seed=0)[0]
    inputs = dict(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False)
    full = model(labels=b["labels"], **inputs).loss
    hidden = model.get_decoder()(**inputs).last_hidden_state
    chunked = bench_train.chunked_lm_loss(hidden, model.get_output_embeddings(), b["labels"], chunk=24)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)
    g_full = torch.autograd.grad(full, model.get_output_embeddings().weight)[0]
    g_chunk = torch.autograd.grad(chunked, model.get_output_embeddings().weight)[0]
    torch.testing.assert_close(g_chunk, g_full, rtol=1e-4, atol=1e-6)


def test_dense_mask_additive_matches_bool():
    b = train_data.synthetic_batches(1, 2, 40, 10, (3, 9), seed=2)[0]
    dense = dense_mask(b[MASK_KEY], True, 40)
    add = dense_mask(b[MASK_KEY], True, 40, chunk_bytes=50, dtype=torch.bfloat16)
    assert add.dtype == torch.bfloat16 and torch.equal(add == 0, dense)
    assert (add[~dense] == torch.finfo(torch.bfloat16).min).all()
    fits, note = dense_fit(1, 1, 1024, 1024, torch.bfloat16, torch.device("cpu"), additive=True)
    assert fits and "additive" in note


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        bench_train.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--find-max" in out and "--gradient-checkpointing" in out and "0.5b" in out


def test_cli_rejects_bad_values():
    for bad in (["--methods", "eager"], ["--doc-len", "100,10"], ["--steps", "0"], ["--doc-len", "5"],
                ["--vocab-size", "100"], ["--keep-attention"]):
        with pytest.raises(SystemExit):
            bench_train.parse_args(bad)


def test_keep_attention_on_cpu(tmp_path, capsys):
    """--keep-attention: the losses of plain checkpointing (the steps' updates included); each row says
    whether its attention was kept (on the CPU nothing is: the reference path's ops are recomputed)."""
    args = _args(tmp_path, "--gradient-checkpointing", "--keep-attention", "--methods", "flashmask,sdpa_dense")
    rows = bench_train.run(args)
    plain = bench_train.run(_args(tmp_path, "--gradient-checkpointing", "--methods", "flashmask"))
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert all("attention recomputed" in r["notes"] for r in rows)
    assert rows[0]["losses"] == pytest.approx(plain[0]["losses"], rel=1e-5)
    assert "keeping the attention outputs" in capsys.readouterr().out


@pytest.mark.slow
def test_end_to_end_on_cpu(tmp_path, capsys):
    rows = bench_train.run(_args(tmp_path, "--gradient-checkpointing"))
    out = capsys.readouterr().out
    by = {r["method"]: r for r in rows}
    assert list(by) == ["flashmask", "sdpa_dense", "flex"]
    for m in ("flashmask", "sdpa_dense"):
        r = by[m]
        assert r["status"] == "ok", r
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and len(r["step_ms"]) == 2 and len(r["losses"]) == 3
        assert r["peak_mem_bytes"] is None  # no CUDA: no memory numbers
        assert r["params"] > 0 and r["docs_per_row"] > 1 and 0 < r["density"] < 1
    # Same initial weights, same first batch, the same mask: the same first loss.
    assert by["flashmask"]["loss_first"] == pytest.approx(by["sdpa_dense"]["loss_first"], rel=1e-3)
    assert "reference path" in by["flashmask"]["notes"] and "additive" in by["sdpa_dense"]["notes"]
    # FlexAttention has no backward on the CPU (torch 2.13): an error row, and the run goes on.
    flex = by["flex"]
    if flex["status"] != "ok":
        assert flex["status"] == "error" and "CPU" in flex["notes"], flex
    with open(tmp_path / "train.csv") as f:
        assert [r["method"] for r in csv.DictReader(f)] == ["flashmask", "sdpa_dense", "flex"]
    with open(tmp_path / "train.json") as f:
        data = json.load(f)
    assert len(data["rows"]) == 3 and data["meta"]["env"]["transformers"]
    assert "fm speedup" in out and "tok/s" in out and "step 2/3" in out


@pytest.mark.slow
def test_errors_become_rows_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """An OOM in one method and a dense mask that does not fit are rows; the other methods run."""
    real_step = bench_train.train_step

    def step(model, opt, batch, mask_kw, args):
        if "attention_mask" in mask_kw:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(model, opt, batch, mask_kw, args)

    monkeypatch.setattr(bench_train, "train_step", step)
    rows = bench_train.run(_args(tmp_path, "--methods", "sdpa_dense,flashmask", "--seqlens", "64,128"))
    got = [(r["seqlen"], r["method"], r["status"]) for r in rows]
    assert got == [(64, "sdpa_dense", "oom"), (64, "flashmask", "ok"), (128, "sdpa_dense", "oom"),
                   (128, "flashmask", "ok")]
    assert rows[0]["notes"] == "step 1/3 (warmup): OOM"

    # --flashmask-backend cuda on a CPU model: an error row that says why (the kernels are not built,
    # or, where they are, they need CUDA tensors)
    rows = bench_train.run(_args(tmp_path, "--methods", "flashmask", "--flashmask-backend", "cuda"))
    notes = rows[0]["notes"]
    assert rows[0]["status"] == "error"
    assert "kernels unavailable" in notes or "kernels run on CUDA tensors, got cpu" in notes, notes

    monkeypatch.setattr(cuda_memory, "free_memory_bytes", lambda device: 10_000)
    rows = bench_train.run(_args(tmp_path, "--methods", "sdpa_dense", "--seqlens", "128"))
    assert rows[0]["status"] == "n/a" and rows[0]["notes"].startswith("does not fit")
    assert "n/a" in capsys.readouterr().out


def test_find_max_doubles_until_oom(tmp_path, capsys, monkeypatch):
    real_step = bench_train.train_step

    def step(model, opt, batch, mask_kw, args):
        if batch["input_ids"].shape[1] >= 512:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real_step(model, opt, batch, mask_kw, args)

    monkeypatch.setattr(bench_train, "train_step", step)
    rows = bench_train.run(_args(tmp_path, "--methods", "flashmask", "--seqlens", "64,128", "--find-max",
                                 "--steps", "1", "--warmup-steps", "0"))
    got = [(r["seqlen"], r["status"], r["find_max"]) for r in rows]
    assert got == [(64, "ok", False), (128, "ok", False), (256, "ok", True), (512, "oom", True)]
    with open(tmp_path / "train.json") as f:
        assert json.load(f)["meta"]["find_max"] == {"flashmask": {"longest_seqlen": 256, "stopped": "512: oom"}}
    assert "longest context trained with flashmask (* rows): 256 tokens" in capsys.readouterr().out


def test_find_max_stops_at_the_bound(tmp_path, capsys):
    rows = bench_train.run(_args(tmp_path, "--methods", "sdpa_dense", "--seqlens", "64", "--find-max",
                                 "--max-seqlen", "128", "--steps", "1", "--warmup-steps", "0"))
    assert [(r["seqlen"], r["method"], r["status"], r["find_max"]) for r in rows] == [
        (64, "sdpa_dense", "ok", False), (128, "sdpa_dense", "ok", True)]
    with open(tmp_path / "train.json") as f:
        assert json.load(f)["meta"]["find_max"] == {
            "sdpa_dense": {"longest_seqlen": 128, "stopped": "bound --max-seqlen 128 reached"}}


@pytest.mark.slow
def test_find_max_searches_every_method(tmp_path, capsys, monkeypatch):
    """Each method doubles on its own: here the dense mask stops fitting at 256 while flashmask goes on."""
    real_fits = dense_fit

    def fits(batch, heads, seqlen_q, seqlen_k, *a, **kw):
        if seqlen_q >= 256:
            return False, "does not fit (test)"
        return real_fits(batch, heads, seqlen_q, seqlen_k, *a, **kw)

    monkeypatch.setattr(bench_train, "dense_fit", fits)
    rows = bench_train.run(_args(tmp_path, "--methods", "flashmask,sdpa_dense", "--seqlens", "64", "--find-max",
                                 "--max-seqlen", "512", "--steps", "1", "--warmup-steps", "0"))
    got = [(r["seqlen"], r["method"], r["status"]) for r in rows if r["find_max"]]
    assert got == [(128, "flashmask", "ok"), (256, "flashmask", "ok"), (512, "flashmask", "ok"),
                   (128, "sdpa_dense", "ok"), (256, "sdpa_dense", "n/a")]
    with open(tmp_path / "train.json") as f:
        fm = json.load(f)["meta"]["find_max"]
    assert fm["flashmask"]["longest_seqlen"] == 512 and fm["sdpa_dense"] == {"longest_seqlen": 128,
                                                                              "stopped": "256: n/a"}
    out = capsys.readouterr().out
    assert "longest context trained with sdpa_dense (* rows): 128 tokens (256: n/a)" in out


@pytest.mark.slow
def test_hf_packed_block_mask_matches_the_library_mask(tmp_path):
    """--flex-mask position_ids relies on transformers building the packed-document block mask from
    the restarting position_ids; bench_train checks it against the library mask before timing."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    args = _args(tmp_path, "--flex-mask", "position_ids")
    model = build_model("llama", "tiny", attn_implementation="flex_attention", max_length=256,
                        vocab_size=512, dtype=torch.float32, device="cpu")
    b = train_data.synthetic_batches(1, 1, 256, 512, (16, 100), seed=3)[0]
    train_masks.check_hf_packed_block_mask(model, args, b, torch.device("cpu"), torch.float32)  # no raise
    b["position_ids"] = torch.arange(256)[None]  # one document: a different mask
    with pytest.raises(RuntimeError, match="differs"):
        train_masks.check_hf_packed_block_mask(model, args, b, torch.device("cpu"), torch.float32)
