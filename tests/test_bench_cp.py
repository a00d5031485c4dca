"""benchmarks/bench_cp.py end to end on the CPU (gloo, 2 processes, reference path, tiny sizes).

Keeps the GPU benchmark runnable: both subcommands run, write their CSV, and the packed-SFT
losses at CP=2 equal those of one process (the same model, data and optimizer steps).
"""
import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_cp.py")


def _run(args, out):
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, SCRIPT, *args, "--device", "cpu", "--tiny", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_attn_dry_run(tmp_path):
    out = _run(["attn", "--nproc", "2"], tmp_path)
    rows = _rows(tmp_path / "attn.csv")
    assert {(r["family"], r["cp_mode"], r["mode"]) for r in rows} == {
        (f, m, mode) for f in ("causal_document", "share_question") for m in ("none", "allgather_kv", "ulysses")
        for mode in ("fwd", "fwdbwd")}
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows)
    assert all(r["speedup"] for r in rows if r["cp"] == "2")
    assert "speedup" in out


def test_train_dry_run_matches_one_process(tmp_path):
    pytest.importorskip("transformers")
    _run(["train", "--cp", "1"], tmp_path / "one")
    _run(["train", "--nproc", "2"], tmp_path / "two")
    # the MLPs of the 64 local tokens in chunks of 24 (--offload alone would chunk by 65536: a no-op here)
    out = _run(["train", "--nproc", "2", "--cp-mode", "ulysses", "--offload", "--mlp-chunk", "24"], tmp_path / "uly")
    assert "MLP chunk 24" in out
    one = _rows(tmp_path / "one" / "train.csv")[0]
    assert one["mlp_chunk"] == "0" and _rows(tmp_path / "uly" / "train.csv")[0]["mlp_chunk"] == "24"
    for sub in ("two", "uly"):
        row = _rows(tmp_path / sub / "train.csv")[0]
        assert row["status"] == "ok" and row["cp"] == "2"
        assert float(row["tokens_per_s_per_gpu"]) > 0
        # same model, data and steps: the same losses (first and last step) as one process
        for k in ("loss_first", "loss_last"):
            assert abs(float(row[k]) - float(one[k])) < 1e-4, (sub, k, row[k], one[k])
