"""CPU checks of benchmarks/step_profile.py and bench_train --profile: which kernels count as
attention, the split of a profiled step, and the columns, table and traces of a tiny run."""
import csv
import json

import pytest
import torch

from benchmarks import bench_train
from benchmarks.step_profile import profile_step, split_times

TINY = ["--device", "cpu", "--flashmask-backend", "reference", "--flex-no-compile", "--model-size", "tiny",
        "--vocab-size", "512", "--seqlens", "256", "--steps", "1", "--warmup-steps", "1", "--doc-len", "16,100"]


def test_attention_kernels_are_told_by_name():
    kernels = [
        ("void flashmask::sm90::fwd_kernel<flashmask::sm90::FwdTraits<64, 64, cutlass::bfloat16_t>>", 500.0),
        ("void flashmask::sm90::bwd_kernel<flashmask::sm90::BwdTraits<64, 64, cutlass::bfloat16_t>>", 1000.0),
        ("triton_tem_fused_flex_attention_0", 700.0),
        ("triton_tem_fused_flex_attention_backward_mul_1", 1300.0),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", 250.0),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", 250.0),
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 4000.0),
        ("void at::native::elementwise_kernel<128, 4>", 1000.0),
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 1000.0),
    ]
    out = split_times(kernels)
    assert out["total_ms"] == pytest.approx(10.0)
    assert out["attention_ms"] == pytest.approx(4.0)
    assert out["attention_share"] == pytest.approx(0.4)
    assert out["top"][0] == ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", pytest.approx(5.0), 2)
    assert len(out["top"]) == 5
    assert split_times([])["attention_share"] is None


def test_a_cpu_step_is_split_into_attention_and_the_rest(tmp_path):
    q = torch.randn(1, 4, 256, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)

    def step():
        o = torch.nn.functional.scaled_dot_product_attention(q @ w, q, q, is_causal=True)
        o.square().sum().backward()

    out = profile_step(step, torch.device("cpu"), tmp_path / "t.json")
    assert 0 < out["attention_ms"] < out["total_ms"] <= out["wall_ms"] * 1.05
    assert 0 < out["attention_share"] < 1
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_bench_train_profile_adds_columns_a_table_and_traces(tmp_path, capsys):
    args = bench_train.parse_args([*TINY, "--out", str(tmp_path), "--profile", "--methods", "flashmask,sdpa_dense"])
    rows = bench_train.run(args)
    out = capsys.readouterr().out
    by = {r["method"]: r for r in rows}
    for m in ("flashmask", "sdpa_dense"):
        r = by[m]
        assert r["status"] == "ok", r
        assert 0 < r["kernel_ms"] <= r["profiled_ms"] * 1.05 and (tmp_path / f"trace_{m}_256.json").exists()
    # SDPA's operator is attention; the reference path is plain tensor operators, not told apart.
    assert 0 < by["sdpa_dense"]["attn_share"] < 1 and by["sdpa_dense"]["attn_kernel_ms"] > 0
    assert by["flashmask"]["attn_kernel_ms"] == 0
    assert "free-attention bound" in out and "profiled step" in out
    with open(tmp_path / "train.csv") as f:
        assert all(float(r["kernel_ms"]) > 0 for r in csv.DictReader(f))
    rows = json.loads((tmp_path / "train.json").read_text())["rows"]
    top = rows[1]["profile_top"]  # sdpa_dense's operators taking the most time, longest first
    assert 5 < len(top) <= bench_train.PROFILE_TOP and any("scaled_dot_product" in n for n, _, _ in top)
    assert [ms for _, ms, _ in top] == sorted((ms for _, ms, _ in top), reverse=True)


def test_without_profile_the_columns_stay_empty(tmp_path, capsys):
    rows = bench_train.run(bench_train.parse_args([*TINY, "--out", str(tmp_path), "--methods", "flashmask"]))
    assert rows[0]["status"] == "ok" and rows[0].get("kernel_ms") is None
    assert "free-attention bound" not in capsys.readouterr().out and not list(tmp_path.glob("trace_*"))
