"""benchmarks/bench_decode.py on the CPU: its arguments, the pairs and bytes it divides by, every
baseline computing the same bottom-right causal attention, and a tiny run to its table."""
import csv
import os
import types

import pytest
import torch

from benchmarks import bench_decode


def test_defaults_and_bad_arguments():
    a = bench_decode.parse_args([])
    assert a.batch == [1, 8] and a.q_lens == [1, 16, 128] and a.k_lens == [8192, 32768, 131072]
    assert a.heads == 32 and a.kv_heads == 8 and a.methods == list(bench_decode.METHODS)
    for bad in (["--kv-heads", "3"], ["--passes", "0"], ["--methods", "nope"], ["--q-lens", "64", "--k-lens", "32"],
                ["--k-lens", "0"]):
        with pytest.raises(SystemExit):
            bench_decode.parse_args(bad)


@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 9), (4, 9), (9, 9)])
def test_attended_pairs_count_the_bottom_right_causal_mask(sq, sk):
    seen = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    assert bench_decode.attended_pairs(sq, sk) == int(seen.sum())


def test_bytes_moved_counts_q_and_out_per_query_head_and_kv_per_key_head():
    assert bench_decode.bytes_moved(2, 3, 100, 8, 2, 64, 2) == 2 * 64 * 2 * (2 * 3 * 8 + 2 * 100 * 2)


@pytest.mark.parametrize("sq", [1, 5])
def test_every_baseline_computes_the_same_attention(sq):
    """flashmask (reference path), FlexAttention (eager) and SDPA's flash backend on the CPU give the
    same output: each gets the same bottom-right causal mask."""
    torch.manual_seed(0)
    q = torch.randn(2, sq, 4, 16)
    k, v = torch.randn(2, 37, 2, 16), torch.randn(2, 37, 2, 16)
    args = types.SimpleNamespace(flashmask_backend="reference", flex_no_compile=True)
    want = bench_decode.make_method("flashmask", q, k, v, args)()
    for method in ("flex", "sdpa_flash"):
        got = bench_decode.make_method(method, q, k, v, args)()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=method)
    if sq > 1:  # the last query sees every key, the first all but sq - 1
        assert not torch.allclose(want[:, 0], want[:, -1])


def test_a_tiny_run_writes_its_table(tmp_path, capsys):
    rows = bench_decode.main(["--device", "cpu", "--flashmask-backend", "reference", "--flex-no-compile",
                              "--methods", "flashmask,flashmask_unsplit,flex", "--batch", "1", "--q-lens", "1,3",
                              "--k-lens", "40", "--heads", "2", "--kv-heads", "1", "--head-dims", "16", "--quick",
                              "--out", str(tmp_path)])
    assert len(rows) == 6
    timed = [r for r in rows if "ms" in r]
    assert {r["method"] for r in timed} == {"flashmask", "flex"}
    assert all(r["ms"] > 0 and r["gbps"] > 0 for r in timed)
    refused = [r for r in rows if r["method"] == "flashmask_unsplit"]
    assert all("needs --flashmask-backend cuda" in r["note"] for r in refused)
    with open(os.path.join(tmp_path, "decode.csv")) as f:
        assert len(list(csv.DictReader(f))) == 6
    assert "flashmask_unsplit" in capsys.readouterr().out
