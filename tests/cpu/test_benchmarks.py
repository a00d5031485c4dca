"""CPU checks of the benchmark suite: the pair counter and the FlexAttention mask_mod against
``masks.format.to_dense``, the tile classifier, the CLIs, and a tiny end-to-end run on the CPU."""
import csv
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import masks
from benchmarks import (
    bench_kernels,
    bench_memory,
    bench_scaling,
    bench_train,
    cli,
    dense_masks,
    flex,
    flops,
    methods,
    report,
    tiles,
    timing,
)
from masks.examples import example
from masks.format import to_dense
from tests import ROOT
from tests.attn_helpers import random_startend

LAYOUTS = [(True, 1), (True, 2), (False, 2), (False, 4)]
SIZES = [(1, 1), (1, 5), (5, 1), (17, 17), (9, 23), (23, 9), (64, 64)]


def _dense_pairs(t, causal, sq):
    return to_dense(t, causal, sq).sum((-1, -2))


@pytest.mark.parametrize("causal,c", LAYOUTS)
@pytest.mark.parametrize("sq,sk", SIZES)
def test_count_pairs_matches_dense_random(causal, c, sq, sk):
    g = torch.Generator().manual_seed(sq * 1000 + sk * 10 + c + causal)
    for _ in range(6):
        t = random_startend(2, 3, sq, sk, causal, c, generator=g)
        assert torch.equal(flops.count_pairs(t, causal, sq), _dense_pairs(t, causal, sq))


@pytest.mark.parametrize("causal,c", LAYOUTS)
def test_count_pairs_out_of_range_values(causal, c):
    """Values outside [0, Sq] (which validate() rejects) still count like to_dense reads them."""
    g = torch.Generator().manual_seed(7)
    sq, sk = 13, 11
    t = torch.randint(-4, sq + 5, (2, 1, sk, c), generator=g, dtype=torch.int32)
    assert torch.equal(flops.count_pairs(t, causal, sq), _dense_pairs(t, causal, sq))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sq,sk", SIZES)
def test_count_pairs_without_mask(causal, sq, sk):
    want = to_dense(None, causal, sq, sk).sum()
    assert int(flops.count_pairs(None, causal, sq, sk).sum()) == int(want)


@pytest.mark.parametrize("family", list(masks.FAMILIES))
@pytest.mark.parametrize("seqlen", [1, 2, 7, 33, 128, 300])
def test_count_pairs_every_family(family, seqlen):
    t, causal = example(family, seqlen, batch_size=2)
    assert torch.equal(flops.count_pairs(t, causal), _dense_pairs(t, causal, seqlen))


def test_total_pairs_heads_and_batch():
    g = torch.Generator().manual_seed(3)
    t1 = random_startend(2, 1, 20, 20, True, 1, generator=g)
    per = _dense_pairs(t1, True, 20)  # [2, 1]
    assert flops.total_pairs(t1, True, batch=2, heads=4, seqlen_q=20, seqlen_k=20) == 4 * int(per.sum())
    t2 = random_startend(1, 2, 20, 20, False, 4, generator=g)
    per = _dense_pairs(t2, False, 20)  # [1, 2]: each mask head covers 3 of 6 query heads
    assert flops.total_pairs(t2, False, batch=3, heads=6, seqlen_q=20, seqlen_k=20) == 3 * 3 * int(per.sum())
    assert flops.total_pairs(None, True, batch=1, heads=2, seqlen_q=4, seqlen_k=4) == 2 * 10
    assert flops.attn_flops(10, 128, "fwd") == 4 * 128 * 10
    assert flops.attn_flops(10, 128, "fwdbwd") == 3.5 * 4 * 128 * 10
    assert flops.attn_flops(10, 128, "bwd") == 2.5 * 4 * 128 * 10
    # a value head dim of its own: QK^T costs 2 * Dqk and PV 2 * Dv per pair
    assert flops.attn_flops(10, 192, "fwd", 128) == 2 * (192 + 128) * 10
    assert flops.attn_flops(10, 192, "bwd", 128) == 2.5 * 2 * (192 + 128) * 10
    assert flops.attn_flops(10, 192, "fwdbwd", 128) == 3.5 * 2 * (192 + 128) * 10
    assert flops.attn_flops(10, 128, "fwd", 128) == flops.attn_flops(10, 128, "fwd")


def _grid(b, h, sq, sk):
    return (torch.arange(b).view(b, 1, 1, 1), torch.arange(h).view(1, h, 1, 1),
            torch.arange(sq).view(1, 1, sq, 1), torch.arange(sk).view(1, 1, 1, sk))


@pytest.mark.parametrize("causal,c", LAYOUTS)
@pytest.mark.parametrize("sq,sk", [(16, 16), (9, 23), (23, 9)])
@pytest.mark.parametrize("hm", [1, 2])
def test_flex_mask_mod_matches_dense(causal, c, sq, sk, hm):
    g = torch.Generator().manual_seed(sq + sk + c + hm)
    heads = 4
    for _ in range(4):
        t = random_startend(2, hm, sq, sk, causal, c, generator=g)
        mm = flex.flex_mask_mod(t, causal, sq, num_heads=heads)
        got = mm(*_grid(2, heads, sq, sk)).expand(2, heads, sq, sk)
        want = to_dense(t, causal, sq).repeat_interleave(heads // hm, dim=1)
        assert torch.equal(got, want)


@pytest.mark.parametrize("family", list(masks.FAMILIES))
def test_flex_mask_mod_every_family(family):
    t, causal = example(family, 96)
    got = flex.flex_mask_mod(t, causal)(*_grid(1, 1, 96, 96))
    assert torch.equal(got, to_dense(t, causal))


def test_flex_mask_mod_cache_reuses_function_and_follows_values():
    cache = flex.FlexMaskModCache()
    a, _ = example("causal_document", 64)
    b, _ = example("sliding_window", 64)
    fa = cache.get(a, True, 64, 2)
    fb = cache.get(b, True, 64, 2)
    assert fa is fb
    assert torch.equal(fb(*_grid(1, 1, 64, 64)), to_dense(b, True))
    c, _ = example("causal_blockwise", 64)  # C=2: another layout, another function
    assert cache.get(c, True, 64, 2) is not fa


@pytest.mark.parametrize("causal,c", LAYOUTS)
def test_flex_create_block_mask_on_cpu(causal, c):
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(11 + c)
    s, blk = 256, 128
    t = random_startend(1, 1, s, s, causal, c, generator=g)
    bm = fa.create_block_mask(flex.flex_mask_mod(t, causal), None, None, s, s, device="cpu")
    dense = to_dense(t, causal)[0, 0]
    want = dense.view(s // blk, blk, s // blk, blk).any(3).any(1).int()
    assert torch.equal(bm.to_dense()[0, 0], want)
    assert flex.block_mask_bytes(bm) == flex.block_mask_bytes_estimate(1, 1, s, s)


@pytest.mark.parametrize("causal,c", LAYOUTS)
@pytest.mark.parametrize("sq,sk,bm,bn", [(40, 40, 8, 4), (37, 29, 8, 8), (29, 37, 4, 16), (64, 64, 128, 64)])
def test_tile_stats_is_sound(causal, c, sq, sk, bm, bn):
    """Skipped tiles hold no attended pair; live tiles not marked partial hold no masked pair."""
    g = torch.Generator().manual_seed(sq * bm + sk * bn + c)
    for _ in range(4):
        t = random_startend(2, 1, sq, sk, causal, c, generator=g)
        st = tiles.tile_stats(t, causal, sq, bm, bn, return_maps=True)
        dense = to_dense(t, causal, sq)
        for b in range(2):
            for i in range(st["live_map"].shape[2]):
                for j in range(st["live_map"].shape[3]):
                    tile = dense[b, 0, i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
                    if not st["live_map"][b, 0, i, j]:
                        assert not tile.any()
                    elif not st["partial_map"][b, 0, i, j]:
                        assert tile.all()
        assert st["tiles"] == 2 * -(-sq // bm) * -(-sk // bn)


def test_tile_stats_causal_document():
    t, _ = example("causal_document", 1024)
    full = tiles.tile_stats(None, True, 1024, 128, 64, seqlen_k=1024)
    doc = tiles.tile_stats(t, True, 1024, 128, 64)
    assert 0 < doc["live"] < full["live"] <= full["tiles"]


def test_dense_mask_in_chunks_and_is_plain():
    g = torch.Generator().manual_seed(5)
    t = random_startend(2, 1, 33, 33, False, 4, generator=g)
    assert torch.equal(dense_masks.dense_mask(t, False, 33, chunk_bytes=100), to_dense(t, False, 33))
    assert flops.is_plain(example("causal", 64)[0], True, 64)
    assert flops.is_plain(example("full", 64)[0], False, 64)
    assert not flops.is_plain(example("causal_document", 64)[0], True, 64)
    fits, note = dense_masks.dense_fit(1, 1, 1024, 1024, torch.bfloat16, torch.device("cpu"))
    assert fits and "GB" in note


def test_parse_helpers():
    assert cli.parse_int_list("8192, 32k,128K,2m") == [8192, 32768, 131072, 2097152]
    with pytest.raises(ValueError):
        cli.parse_int_list("8x")
    assert cli.parse_choice_list("all", ("a", "b"), "x") == ["a", "b"]
    with pytest.raises(ValueError):
        cli.parse_choice_list("a,c", ("a", "b"), "x")
    assert report.fmt_len(32768) == "32K" and report.fmt_bytes(3 * 2 ** 30) == "3.00 GiB"
    assert "--" in report.format_table(["a", "b"], [[1, 2.5]])


@pytest.mark.parametrize("module", [bench_kernels, bench_scaling, bench_memory, bench_train])
def test_cli_help(module, capsys):
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_scripts_run_as_modules_without_cuda_or_triton():
    """In a fresh interpreter with triton unimportable and no GPU: import every module, and run each
    script with --help as `python -m benchmarks.x --help` would (from the checkout root)."""
    code = """
import runpy, sys
sys.modules['triton'] = None  # any `import triton` now fails
for name in ('bench_kernels', 'bench_scaling', 'bench_memory', 'bench_train'):
    sys.argv = [name + '.py', '--help']
    try:
        runpy.run_module('benchmarks.' + name, run_name='__main__', alter_sys=True)
    except SystemExit as e:
        assert e.code == 0, (name, e.code)
    else:
        raise AssertionError(name + ' --help did not exit')
import benchmarks.bench_kernels, benchmarks.bench_scaling, benchmarks.bench_memory, benchmarks.bench_train
import benchmarks.bench_cp, benchmarks.plot_results
import benchmarks.cli, benchmarks.cuda_memory, benchmarks.dense_masks, benchmarks.errors, benchmarks.flex
import benchmarks.flops, benchmarks.methods, benchmarks.output, benchmarks.report, benchmarks.tiles
import benchmarks.timing
import torch
assert not torch.cuda.is_initialized()
print('IMPORTS-OK')
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "IMPORTS-OK" in r.stdout and r.stdout.count("usage:") == 4


@pytest.mark.slow
def test_bench_kernels_end_to_end_on_cpu(tmp_path, capsys):
    rows = bench_kernels.run(bench_kernels.parse_args([
        "--device", "cpu", "--flashmask-backend", "reference", "--flex-no-compile", "--families",
        "causal,global_sliding_window", "--seqlens", "64", "--heads", "2", "--head-dims", "16", "--modes",
        "fwd,fwdbwd", "--methods", "flashmask,flex,sdpa_dense,sdpa_flash", "--warmup", "0", "--rep", "0",
        "--out", str(tmp_path), "--plot"]))
    out = capsys.readouterr().out
    by = {(r["family"], r["mode"], r["method"]): r for r in rows}
    # sdpa_flash takes only plain masks: rows for causal, none for global_sliding_window
    assert ("causal", "fwd", "sdpa_flash") in by and ("global_sliding_window", "fwd", "sdpa_flash") not in by
    assert len(rows) == 2 * 2 * 3 + 2
    for fam in ("causal", "global_sliding_window"):
        for mode in ("fwd", "fwdbwd"):
            for m in ("flashmask", "sdpa_dense"):
                r = by[(fam, mode, m)]
                assert r["status"] == "ok" and r["ms"] > 0 and r["tflops"] > 0, r
        assert by[(fam, "fwd", "flex")]["status"] == "ok"  # flex backward does not run on the CPU: an error row
        assert by[(fam, "fwdbwd", "flex")]["status"] == "error"
        assert by[(fam, "fwd", "flex")]["mask_build_ms"] is not None
    dens = {r["family"]: r["density"] for r in rows}
    assert dens["causal"] == pytest.approx((64 * 65 / 2) / 64 ** 2)
    with open(tmp_path / "kernels.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    with open(tmp_path / "kernels.json") as f:
        data = json.load(f)
    assert len(data["rows"]) == len(rows) and "env" in data["meta"]
    assert (tmp_path / "plots" / "causal.png").exists()
    assert "vs flex" in out and "global_sliding_window" in out

    # The README chart and the per-family charts, redrawn from the CSV alone.
    from benchmarks import plot_results
    plot_results.main([str(tmp_path / "kernels.csv"), str(tmp_path / "summary.png"), "--seqlen", "64",
                       "--panels", "fwd:16,fwdbwd:16", "--per-family", str(tmp_path / "from_csv")])
    assert (tmp_path / "summary.png").stat().st_size > 0
    summary = plot_results.load([str(tmp_path / "kernels.csv")])
    assert summary[("causal", 64, "fwd", 16)]["flashmask"] == pytest.approx(
        by[("causal", "fwd", "flashmask")]["tflops"], rel=1e-4)
    assert plot_results.parse_panels("fwd:128,bwd:64") == [("fwd", 128), ("bwd", 64)]
    with pytest.raises(ValueError, match="mode:head_dim"):
        plot_results.parse_panels("forward:128")
    capsys.readouterr()
    for bad in (["--panels", "forward:16"], ["--seqlen", "65"]):
        with pytest.raises(SystemExit):
            plot_results.main([str(tmp_path / "kernels.csv"), str(tmp_path / "bad.png")] + bad)
    err = capsys.readouterr().err
    assert "mode:head_dim" in err and "no timed rows at --seqlen 65" in err
    assert sorted(p.name for p in (tmp_path / "from_csv").iterdir()) == ["causal.png", "global_sliding_window.png"]
    parsed = plot_results.read_rows([str(tmp_path / "kernels.csv")])
    timed = {(r["family"], r["mode"], r["method"]): r["tflops"] for r in rows if r["tflops"] is not None}
    assert {(r["family"], r["mode"], r["method"]): r["tflops"] for r in parsed if r["tflops"] is not None} == \
        pytest.approx(timed, rel=1e-4)


def test_bench_kernels_deterministic_flashmask_on_cpu(tmp_path, capsys, monkeypatch):
    """flashmask_det: opt-in (not in the default methods), backward rows only, next to flashmask."""
    assert "flashmask_det" not in bench_kernels.parse_args(["--out", str(tmp_path)]).methods
    rows = bench_kernels.run(bench_kernels.parse_args([
        "--device", "cpu", "--flashmask-backend", "reference", "--families", "causal_document", "--seqlens", "64",
        "--heads", "2", "--head-dims", "16", "--modes", "fwd,bwd,fwdbwd", "--methods", "flashmask,flashmask_det",
        "--warmup", "0", "--rep", "0", "--out", str(tmp_path)]))
    assert [(r["mode"], r["method"]) for r in rows] == [
        ("fwd", "flashmask"), ("bwd", "flashmask"), ("fwdbwd", "flashmask"), ("bwd", "flashmask_det"),
        ("fwdbwd", "flashmask_det")]
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["tflops"] > 0 for r in rows), rows
    det = {r["mode"]: r for r in rows if r["method"] == "flashmask_det"}
    fm = {r["mode"]: r for r in rows if r["method"] == "flashmask"}
    assert det["bwd"]["pairs"] == fm["bwd"]["pairs"] and det["bwd"]["density"] == fm["bwd"]["density"]
    out = capsys.readouterr().out
    assert "[   5/5]" in out and "det ms" in out and "det cost" in out
    # the deterministic flag reaches flashmask_attention
    import flashmask
    p = methods.Problem(example("causal", 32)[0], True, 1, 2, 16, 32, torch.float32, torch.device("cpu"))
    seen, real = [], flashmask.flashmask_attention

    def spy(*a, **k):
        seen.append(k["deterministic"])
        return real(*a, **k)

    monkeypatch.setattr(flashmask, "flashmask_attention", spy)
    q, k, v, _ = timing.make_inputs(1, 32, 2, 16, torch.float32, torch.device("cpu"))
    for m in ("flashmask", "flashmask_det"):
        methods.prepare_method(m, p, methods.Options(flashmask_backend="reference")).attn(q, k, v)
    assert seen == [False, True]
    assert methods.method_modes("flashmask_det", ["fwd"]) == [] and methods.method_modes("flex", ["fwd"]) == ["fwd"]


def test_flashmask_plain_passes_no_mask_on_the_plain_families_only(tmp_path, capsys, monkeypatch):
    """flashmask_plain: opt-in, flashmask_attention with no mask tensor, rows for causal and full only."""
    assert "flashmask_plain" in methods.EXTRA_METHODS and "flashmask_plain" not in methods.METHODS
    import flashmask
    seen, real = [], flashmask.flashmask_attention

    def spy(q, k, v, startend, **kw):
        seen.append(startend is None)
        return real(q, k, v, startend, **kw)

    monkeypatch.setattr(flashmask, "flashmask_attention", spy)
    rows = bench_kernels.run(bench_kernels.parse_args([
        "--device", "cpu", "--flashmask-backend", "reference", "--families", "causal,full,causal_document",
        "--seqlens", "64", "--heads", "2", "--head-dims", "16", "--modes", "fwd", "--methods",
        "flashmask,flashmask_plain", "--warmup", "0", "--rep", "0", "--out", str(tmp_path)]))
    plain = {r["family"]: r for r in rows if r["method"] == "flashmask_plain"}
    assert sorted(plain) == ["causal", "full"] and all(r["status"] == "ok" for r in plain.values()), rows
    fm = {r["family"]: r for r in rows if r["method"] == "flashmask"}
    assert all(plain[f]["pairs"] == fm[f]["pairs"] for f in plain)
    assert True in seen and False in seen
    # the summary gives its TFLOP/s (and its speed against cuDNN's, '-' where cuDNN did not run)
    out = capsys.readouterr().out
    assert "plain TF/s" in out and "plain vs cudnn" in out
    cudnn = dict(plain["causal"], method="sdpa_cudnn", ms=2 * plain["causal"]["ms"])
    table = bench_kernels.summary_table(rows + [cudnn])
    causal_line = next(line for line in table.splitlines() if line.startswith("causal "))
    assert causal_line.rstrip().endswith("2.00x"), table
    # the same output as with the family's mask tensor
    for family, causal in (("causal", True), ("full", False)):
        p = methods.Problem(example(family, 48)[0], causal, 1, 2, 16, 48, torch.float32, torch.device("cpu"))
        q, k, v, _ = timing.make_inputs(1, 48, 2, 16, torch.float32, torch.device("cpu"))
        opt = methods.Options(flashmask_backend="reference")
        fm, plain = (methods.prepare_method(m, p, opt) for m in ("flashmask", "flashmask_plain"))
        assert fm.mask_bytes > 0 and plain.mask_bytes == 0
        torch.testing.assert_close(fm.attn(q, k, v), plain.attn(q, k, v))
    p = methods.Problem(example("document", 48)[0], False, 1, 2, 16, 48, torch.float32, torch.device("cpu"))
    with pytest.raises(methods.Skip):
        methods.prepare_method("flashmask_plain", p, methods.Options(flashmask_backend="reference"))


def test_flex_flash_asks_for_the_flash_backend(monkeypatch):
    """flex_flash is flex with kernel_options BACKEND=FLASH (plain flex passes none), on the same
    block mask."""
    from torch.nn.attention.flex_attention import flex_attention
    seen = []

    def spy(q, k, v, **kw):
        seen.append((kw["kernel_options"], kw["block_mask"].shape))
        return flex_attention(q, k, v, block_mask=kw["block_mask"], enable_gqa=kw["enable_gqa"])

    monkeypatch.setattr(flex, "compiled_flex_attention", lambda compile=True: spy)
    mask, causal = example("sliding_window", 64)
    p = methods.Problem(mask, causal, 1, 2, 16, 64, torch.float32, torch.device("cpu"))
    q, k, v, _ = timing.make_inputs(1, 64, 2, 16, torch.float32, torch.device("cpu"))
    q, k, v = q.detach(), k.detach(), v.detach()
    opt = methods.Options(flex_compile=False)
    outs = [methods.prepare_method(m, p, opt).attn(q, k, v) for m in ("flex", "flex_flash")]
    assert [o for o, _ in seen] == [None, {"BACKEND": "FLASH"}] and seen[0][1] == seen[1][1]
    torch.testing.assert_close(outs[0], outs[1])
    assert "flex_flash" in methods.EXTRA_METHODS and "flex_flash" not in methods.METHODS


def test_bench_kernels_gqa_on_cpu(tmp_path, capsys):
    """--kv-heads: every method gets k and v with fewer heads (Flex and SDPA through enable_gqa), the
    rows say so, and the methods agree on the output."""
    rows = bench_kernels.run(bench_kernels.parse_args([
        "--device", "cpu", "--flashmask-backend", "reference", "--flex-no-compile", "--families",
        "causal_document", "--seqlens", "64", "--heads", "4", "--kv-heads", "2", "--head-dims", "16", "--modes",
        "fwd,fwdbwd", "--methods", "flashmask,flex,sdpa_dense", "--warmup", "0", "--rep", "0", "--out", str(tmp_path)]))
    by = {(r["mode"], r["method"]): r for r in rows}
    assert all(r["heads"] == 4 and r["kv_heads"] == 2 for r in rows)
    for key in (("fwd", "flashmask"), ("fwdbwd", "flashmask"), ("fwd", "sdpa_dense"), ("fwdbwd", "sdpa_dense"),
                ("fwd", "flex")):
        assert by[key]["status"] == "ok", by[key]
    with open(tmp_path / "kernels.csv") as f:
        assert {r["kv_heads"] for r in csv.DictReader(f)} == {"2"}
    mask, causal = example("causal_document", 64)
    p = methods.Problem(mask, causal, 1, 4, 16, 64, torch.float32, torch.device("cpu"), kv_heads=2)
    q, k, v, _ = timing.make_inputs(1, 64, 4, 16, torch.float32, torch.device("cpu"), kv_heads=2)
    assert q.shape == (1, 64, 4, 16) and k.shape == v.shape == (1, 64, 2, 16)
    opt = methods.Options(flashmask_backend="reference", flex_compile=False)
    q, k, v = q.detach(), k.detach(), v.detach()  # Flex has no CPU backward
    outs = {m: methods.prepare_method(m, p, opt).attn(q, k, v) for m in ("flashmask", "flex", "sdpa_dense")}
    torch.testing.assert_close(outs["flex"], outs["flashmask"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs["sdpa_dense"], outs["flashmask"], atol=1e-4, rtol=1e-4)
    with pytest.raises(SystemExit):
        bench_kernels.parse_args(["--heads", "4", "--kv-heads", "3"])
    assert "--kv-heads must divide --heads (4), got 3" in capsys.readouterr().err


def test_bench_scaling_end_to_end_on_cpu(tmp_path, capsys):
    rows = bench_scaling.run(bench_scaling.parse_args([
        "--device", "cpu", "--flashmask-backend", "reference", "--seqlen", "128", "--docs", "1,4", "--heads", "2",
        "--head-dim", "16", "--warmup", "0", "--rep", "0", "--out", str(tmp_path), "--plot"]))
    assert [(r["docs"], r["mode"]) for r in rows] == [(1, "fwd"), (1, "fwdbwd"), (4, "fwd"), (4, "fwdbwd")]
    assert all(r["status"] == "ok" and r["ms_per_density"] > 0 for r in rows)
    assert rows[2]["density"] < rows[0]["density"] and rows[2]["tile_density"] <= rows[0]["tile_density"]
    assert (tmp_path / "scaling.png").exists() and (tmp_path / "scaling.csv").exists()
    assert "ms/density" in capsys.readouterr().out


def test_bench_memory_flow_on_cpu(tmp_path, capsys):
    """Without CUDA the memory numbers are absent, but the whole flow and its tables run."""
    rows = bench_memory.run(bench_memory.parse_args([
        "--device", "cpu", "--flashmask-backend", "reference", "--methods", "flashmask,sdpa_dense,sdpa_flash",
        "--families", "causal,document", "--seqlens", "64", "--heads", "2", "--head-dim", "16",
        "--out", str(tmp_path)]))
    assert [(r["family"], r["method"]) for r in rows] == [
        ("causal", "flashmask"), ("causal", "sdpa_dense"), ("causal", "sdpa_flash"),
        ("document", "flashmask"), ("document", "sdpa_dense")]
    assert all(r["status"] == "ok" for r in rows), rows
    fm = rows[0]
    assert fm["mask_bytes"] == fm["startend_bytes"] + fm["bounds_bytes"] and rows[1]["mask_bytes"] == 64 * 64
    out = capsys.readouterr().out
    assert "Mask representation" in out and "One call" in out
    assert (tmp_path / "memory.csv").exists() and (tmp_path / "memory.json").exists()


def _c_tile(fn_name, head_dim):
    """(BlockM, BlockN) from csrc/sm80/tile_config.h, whose tables benchmarks/tiles.py mirrors."""
    src = open(os.path.join(ROOT, "csrc", "sm80", "tile_config.h")).read()
    body = re.search(rf"constexpr \w+ {fn_name}\(int head_dim\) \{{\s*return (.*?);\s*\}}", src, re.S).group(1)
    for limit, m, n, _ in re.findall(r"(?:head_dim <= (\d+) \? )?\w+Tile\{(\d+), (\d+), (\d+)\}", body):
        if not limit or head_dim <= int(limit):
            return int(m), int(n)
    raise AssertionError(f"could not read {fn_name} from tile_config.h")


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
def test_tile_tables_mirror_the_kernels(head_dim):
    assert tiles.fwd_tile(head_dim) == _c_tile("fwd_tile", head_dim)
    assert tiles.bwd_tile(head_dim) == _c_tile("bwd_tile", head_dim)


def test_host_bound_note_names_cells_whose_launch_path_is_as_long_as_the_call():
    assert timing.host_bound_note(0.100, None) == ""
    assert timing.host_bound_note(0.100, 0.060) == ""  # the GPU still runs ahead of the host
    note = timing.host_bound_note(0.288, 0.283)  # a slow host: the GPU waits for each launch
    assert note == "host-bound? 0.283 ms of host time a call against 0.288 ms measured"
    assert timing.host_bound_note(0.100, 0.081).startswith("host-bound?")  # past the share (0.8)
    assert timing.host_bound_note(0.100, 0.079) == ""


def test_host_ms_per_call_times_the_launches():
    import time
    assert timing.host_ms_per_call(lambda: time.sleep(0.002), torch.device("cpu"), calls=5) >= 1.9
    with pytest.raises(ValueError, match="calls must be at least 1, got 0"):
        timing.host_ms_per_call(lambda: None, torch.device("cpu"), calls=0)


def test_try_time_measures_no_host_time_off_cuda():
    p = methods.Problem(example("causal", 32)[0], True, 1, 2, 16, 32, torch.float32, torch.device("cpu"))
    prep = methods.prepare_method("flashmask", p, methods.Options(flashmask_backend="reference"))
    res = timing.try_time(prep, "fwd", timing.make_inputs(1, 32, 2, 16, torch.float32, torch.device("cpu")),
                          100, 16, 0, 0, torch.device("cpu"))
    assert res["status"] == "ok" and res["host_ms"] is None and "host-bound" not in res["notes"]


def test_bench_kernels_value_head_dim_on_cpu(tmp_path, capsys):
    """--head-dim-v: every method gets q, k [.., Dqk] and v [.., Dv]; TFLOP/s count 2*(Dqk + Dv) per
    pair; SDPA's flash backend, which refuses the pair, gets an n/a row; the methods agree."""
    rows = bench_kernels.run(bench_kernels.parse_args([
        "--device", "cpu", "--flashmask-backend", "reference", "--flex-no-compile", "--families",
        "causal,causal_document", "--seqlens", "64", "--heads", "4", "--kv-heads", "2", "--head-dims", "24",
        "--head-dim-v", "8", "--modes", "fwd,fwdbwd", "--methods", "flashmask,flex,sdpa_dense,sdpa_flash",
        "--warmup", "0", "--rep", "0", "--out", str(tmp_path)]))
    out = capsys.readouterr().out
    by = {(r["family"], r["mode"], r["method"]): r for r in rows}
    assert all(r["head_dim"] == 24 and r["head_dim_v"] == 8 for r in rows)
    for fam in ("causal", "causal_document"):
        for key in ((fam, "fwd", "flashmask"), (fam, "fwdbwd", "flashmask"), (fam, "fwd", "sdpa_dense"),
                    (fam, "fwdbwd", "sdpa_dense"), (fam, "fwd", "flex")):
            r = by[key]
            assert r["status"] == "ok", r
            tflops = flops.attn_flops(r["pairs"], 24, r["mode"], 8) / (r["ms"] * 1e-3) / 1e12
            assert r["tflops"] == pytest.approx(tflops)
    flash = by[("causal", "fwd", "sdpa_flash")]
    assert flash["status"] == "n/a" and "does not take q/k head dim 24 with v head dim 8" in flash["notes"], flash
    assert ("causal_document", "fwd", "sdpa_flash") not in by  # a mask it never takes: no row
    assert re.search(r"causal\s+64\s+24/8\s+fwd", out), out
    with open(tmp_path / "kernels.csv") as f:
        assert {r["head_dim_v"] for r in csv.DictReader(f)} == {"8"}
    with open(tmp_path / "kernels.json") as f:
        assert "(Dqk+Dv)" in json.load(f)["meta"]["flop_convention"]
    # the same tensors everywhere, and the same result
    mask, causal = example("causal_document", 64)
    p = methods.Problem(mask, causal, 1, 4, 24, 64, torch.float32, torch.device("cpu"), kv_heads=2, head_dim_v=8)
    q, k, v, dout = timing.make_inputs(1, 64, 4, 24, torch.float32, torch.device("cpu"), kv_heads=2, head_dim_v=8)
    assert (q.shape, k.shape, v.shape, dout.shape) == ((1, 64, 4, 24), (1, 64, 2, 24), (1, 64, 2, 8), (1, 64, 4, 8))
    opt = methods.Options(flashmask_backend="reference", flex_compile=False)
    q, k, v = q.detach(), k.detach(), v.detach()  # Flex has no CPU backward
    outs = {m: methods.prepare_method(m, p, opt).attn(q, k, v) for m in ("flashmask", "flex", "sdpa_dense")}
    assert outs["flashmask"].shape == (1, 64, 4, 8)
    torch.testing.assert_close(outs["flex"], outs["flashmask"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs["sdpa_dense"], outs["flashmask"], atol=1e-4, rtol=1e-4)
    with pytest.raises(SystemExit):
        bench_kernels.parse_args(["--head-dim-v", "0"])
    assert "--head-dim-v must be a positive int, got 0" in capsys.readouterr().err
