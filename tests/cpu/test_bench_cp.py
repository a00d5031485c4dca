"""``python -m benchmarks.bench_cp`` end to end on the CPU (gloo, 2 processes, reference path, tiny sizes).

Keeps the GPU benchmark runnable: both subcommands run, write their CSV, and the packed-SFT
losses at CP=2 equal those of one process (the same model, data and optimizer steps). A second
invocation with the same ``--out`` appends its rows (CSV and JSON) instead of replacing the first's.
"""
import csv
import json
import os
import subprocess
import sys

import pytest

from tests import ROOT


def _run(args, out, ok=True):
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "benchmarks.bench_cp", *args, "--device", "cpu", "--tiny", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    if not ok:
        return r
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def _runs(path):
    with open(path) as f:
        return json.load(f)["runs"]


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_attn_dry_run(tmp_path):
    # two invocations into one folder, as the device scripts run them: the second appends its rows
    _run(["attn", "--nproc", "2", "--families", "causal_document"], tmp_path)
    assert {r["family"] for r in _rows(tmp_path / "attn.csv")} == {"causal_document"}
    out = _run(["attn", "--nproc", "2", "--families", "share_question"], tmp_path)
    with open(tmp_path / "attn.csv") as f:
        assert f.read().count("family,seqlen,") == 1, "one header"
    rows = _rows(tmp_path / "attn.csv")
    assert len(rows) == 12 and [r["family"] for r in rows] == ["causal_document"] * 6 + ["share_question"] * 6
    assert {(r["family"], r["cp_mode"], r["mode"]) for r in rows} == {
        (f, m, mode) for f in ("causal_document", "share_question") for m in ("none", "allgather_kv", "ulysses")
        for mode in ("fwd", "fwdbwd")}
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows)
    assert all(r["speedup"] for r in rows if r["cp"] == "2")
    assert "speedup" in out
    runs = _runs(tmp_path / "attn.json")
    assert [len(run["rows"]) for run in runs] == [6, 6]
    assert [run["meta"]["args"]["families"] for run in runs] == [["causal_document"], ["share_question"]]
    assert [r["family"] for run in runs for r in run["rows"]] == [r["family"] for r in rows]


@pytest.mark.slow
def test_results_with_another_header_are_refused(tmp_path):
    """An existing CSV written with other columns stops the run before any work, untouched."""
    old = "family,seqlen,ms\ncausal_document,256,1.0\n"
    (tmp_path / "attn.csv").write_text(old)
    r = _run(["attn", "--nproc", "2", "--families", "causal_document"], tmp_path, ok=False)
    assert r.returncode != 0
    assert "attn.csv has another header" in r.stderr and "missing ['heads'" in r.stderr, r.stderr[-2000:]
    assert (tmp_path / "attn.csv").read_text() == old and not (tmp_path / "attn.json").exists()
    # a JSON that is not a results file is refused alike
    (tmp_path / "attn.csv").unlink()
    (tmp_path / "attn.json").write_text("[1, 2]")
    r = _run(["attn", "--nproc", "2", "--families", "causal_document"], tmp_path, ok=False)
    assert r.returncode != 0 and "not a bench_cp results file" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "attn.csv").exists()


@pytest.mark.slow
def test_train_dry_run_matches_one_process(tmp_path):
    pytest.importorskip("transformers")
    _run(["train", "--cp", "1"], tmp_path / "one")
    _run(["train", "--nproc", "2"], tmp_path / "two")
    # the MLPs of the 64 local tokens in chunks of 24 (--offload alone would chunk by 65536: a no-op here);
    # into the same folder: its row is appended to the allgather_kv one
    out = _run(["train", "--nproc", "2", "--cp-mode", "ulysses", "--offload", "--mlp-chunk", "24"], tmp_path / "two")
    assert "MLP chunk 24" in out
    one = _rows(tmp_path / "one" / "train.csv")[0]
    rows = _rows(tmp_path / "two" / "train.csv")
    assert [(r["cp_mode"], r["mlp_chunk"]) for r in rows] == [("allgather_kv", "0"), ("ulysses", "24")]
    assert one["mlp_chunk"] == "0"
    assert [[r["cp_mode"] for r in run["rows"]] for run in _runs(tmp_path / "two" / "train.json")] == [
        ["allgather_kv"], ["ulysses"]]
    for row in rows:
        assert row["status"] == "ok" and row["cp"] == "2"
        assert float(row["tokens_per_s_per_gpu"]) > 0
        # same model, data and steps: the same losses (first and last step) as one process
        for k in ("loss_first", "loss_last"):
            assert abs(float(row[k]) - float(one[k])) < 1e-4, (row["cp_mode"], k, row[k], one[k])
