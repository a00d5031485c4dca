"""CPU checks of bench_kernels' ``--softcap`` and ``--sinks``: FlexAttention's soft-capping
``score_mod`` and its sink renormalisation give flashmask's result (the renormalisation also its
gradients, and without a graph break under ``torch.compile``), SDPA says why it cannot, the
option reaches flashmask, a CUDA backend refuses instead of falling back, the sinks' gradient is
timed with the others, and an end-to-end run records both options without changing the FLOPs."""
import csv
import json

import pytest
import torch

import flashmask
from benchmarks import bench_kernels, flex, flops, methods, timing
from masks.examples import example
from tests.attn_helpers import random_startend

CPU = torch.device("cpu")


def _problem(family, s=64, heads=4, kv_heads=2, d=16, softcap=0.0, sinks=False, dtype=torch.float32):
    mask, causal = example(family, s)
    sink = timing.make_sinks(heads, CPU, seed=3) if sinks else None
    return methods.Problem(mask, causal, 1, heads, d, s, dtype, CPU, kv_heads=kv_heads, softcap=softcap, sinks=sink)


def _inputs(p, scale=3.0):
    """Detached q, k, v (FlexAttention has no CPU backward) whose scores span several units, so
    that a cap of a few units bends them."""
    q, k, v, _ = timing.make_inputs(1, p.seqlen, p.heads, p.head_dim, p.dtype, CPU, kv_heads=p.kv_heads)
    return q.detach() * scale, k.detach(), v.detach()


def _outputs(p, names):
    opt = methods.Options(flashmask_backend="reference", flex_compile=False)
    q, k, v = _inputs(p)
    with torch.no_grad():
        return {m: methods.prepare_method(m, p, opt).attn(q, k, v) for m in names}


@pytest.mark.parametrize("family", ["causal_document", "global_sliding_window", "qk_sparse"])
@pytest.mark.parametrize("softcap, sinks", [(2.0, False), (0.0, True), (2.0, True)])
def test_flex_gives_flashmask_result_with_softcap_and_sinks(family, softcap, sinks):
    p = _problem(family, softcap=softcap, sinks=sinks)
    out = _outputs(p, ["flashmask", "flex"])
    torch.testing.assert_close(out["flex"], out["flashmask"], atol=2e-5, rtol=1e-4)
    plain = _outputs(_problem(family), ["flashmask"])["flashmask"]
    assert (plain - out["flashmask"]).abs().max() > 1e-2  # the options change the result here


def test_softcap_score_mod_caps_the_scaled_score():
    mod = flex.softcap_score_mod(30.0)
    s = torch.tensor([-200.0, -1.0, 0.0, 0.5, 90.0])
    torch.testing.assert_close(mod(s, 0, 0, 0, 0), 30.0 * torch.tanh(s / 30.0))
    assert flex.softcap_score_mod(30) is mod  # one function per value: compiled kernels are reused
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap must be a finite float > 0"):
            flex.softcap_score_mod(bad)


@pytest.mark.parametrize("causal, c", [(True, 1), (False, 4)])
def test_sink_renorm_is_exact_with_gradients(causal, c):
    """out * sigmoid(lse - sink) from attention without sinks equals attention with sinks, values and
    gradients (q, k, v and the sinks), in float64; rows no key may attend among them."""
    g = torch.Generator().manual_seed(5 + c)
    s, hq, hk, d = 24, 4, 2, 8
    mask = random_startend(2, 1, s, s, causal, c, generator=g)
    shapes = ((2, s, hq, d), (2, s, hk, d), (2, s, hk, d))
    q, k, v = (torch.randn(sh, generator=g, dtype=torch.float64).requires_grad_() for sh in shapes)
    sinks = (torch.randn(hq, generator=g, dtype=torch.float64) * 2).requires_grad_()
    dout = torch.randn(2, s, hq, d, generator=g, dtype=torch.float64)

    want = flashmask.flashmask_attention(q, k, v, mask, causal=causal, sinks=sinks, backend="reference")
    out, lse = flashmask.flashmask_attention(q, k, v, mask, causal=causal, return_lse=True, backend="reference")
    got = flex.sink_renorm(out.transpose(1, 2), lse, sinks).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    g_want = torch.autograd.grad(want, (q, k, v, sinks), dout)
    g_got = torch.autograd.grad(got, (q, k, v, sinks), dout)
    for a, b, name in zip(g_got, g_want, "qkvs"):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8, msg=name)


def test_sink_renorm_leaves_empty_rows_at_zero():
    """FlexAttention gives a row no key may attend output 0 and LSE -inf: it stays 0, no NaN in the
    gradients."""
    out = torch.zeros(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    lse = torch.full((1, 2, 3), float("-inf"), dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    res = flex.sink_renorm(out, lse, sinks)
    assert torch.equal(res, torch.zeros_like(res))
    grads = torch.autograd.grad(res.sum(), (out, lse, sinks))
    assert all(torch.isfinite(x).all() for x in grads)
    assert torch.equal(grads[2], torch.zeros_like(sinks))


def test_flex_with_sinks_compiles_without_graph_break():
    """The function bench_kernels compiles (flex_attention, its LSE, the renormalisation) traces as
    one graph; ``aot_eager`` since FlexAttention's CPU lowering returns no LSE."""
    p = _problem("causal_document", s=128, softcap=2.0, sinks=True)
    q, k, v = (x.transpose(1, 2) for x in _inputs(p))
    bm, _ = flex.build_block_mask(flex.flex_mask_mod(p.startend, p.causal), None, None, 128, 128, CPU, "eager")
    fn = torch.compile(flex.flex_attention_with_sinks, backend="aot_eager", fullgraph=True, dynamic=False)
    got = fn(q, k, v, p.sinks.detach(), block_mask=bm, score_mod=flex.softcap_score_mod(2.0), enable_gqa=True)
    want = flashmask.flashmask_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), p.startend,
                                         causal=True, softcap=2.0, sinks=p.sinks.detach(), backend="reference")
    torch.testing.assert_close(got.transpose(1, 2), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["sdpa_dense", "sdpa_flash", "sdpa_cudnn"])
def test_sdpa_says_it_cannot_express_the_options(method):
    opt = methods.Options()
    for softcap, sinks, what in ((2.0, False, "logit soft-capping"), (0.0, True, "attention sinks")):
        with pytest.raises(methods.Skip, match=f"SDPA cannot express {what}") as e:
            methods.prepare_method(method, _problem("causal", softcap=softcap, sinks=sinks), opt)
        assert e.value.report  # an n/a row with the reason, not a silent gap
    if method != "sdpa_dense":  # masks beyond causal: still no row at all, as without the options
        with pytest.raises(methods.Skip) as e:
            methods.prepare_method(method, _problem("causal_document", softcap=2.0), opt)
        assert not e.value.report


def test_options_reach_flashmask_and_the_sinks_gradient_is_timed(monkeypatch):
    p = _problem("causal_document", softcap=7.0, sinks=True)
    seen, real = [], flashmask.flashmask_attention

    def spy(*a, **k):
        seen.append((k["softcap"], k["sinks"]))
        return real(*a, **k)

    monkeypatch.setattr(flashmask, "flashmask_attention", spy)
    prep = methods.prepare_method("flashmask", p, methods.Options(flashmask_backend="reference"))
    assert prep.params == (p.sinks,)
    q, k, v, dout = timing.make_inputs(1, 64, 4, 16, torch.float32, CPU, kv_heads=2)
    for mode in ("bwd", "fwdbwd"):
        grads = timing.make_step(prep.attn, mode, q, k, v, dout, prep.params)()
        assert len(grads) == 4 and grads[3].shape == (4,)
        want = torch.autograd.grad(real(q, k, v, p.startend, causal=True, softcap=7.0, sinks=p.sinks,
                                        backend="reference"), p.sinks, dout)[0]
        torch.testing.assert_close(grads[3], want)
    assert len(timing.make_step(prep.attn, "fwdbwd", q, k, v, dout)()) == 3  # without params: q, k, v
    assert all(c == 7.0 and s is p.sinks for c, s in seen)
    assert methods.prepare_method("flashmask", _problem("causal"), methods.Options(flashmask_backend="reference")
                                  ).params == ()


def test_cuda_backend_takes_the_options(monkeypatch):
    monkeypatch.setattr(flashmask.cuda, "available", lambda: True)
    opt = methods.Options(flashmask_backend="cuda")
    assert methods.prepare_method("flashmask", _problem("causal", softcap=2.0, sinks=True), opt).attn is not None


def test_cli_options(capsys):
    a = bench_kernels.parse_args(["--softcap", "50", "--sinks"])
    assert (a.softcap, a.sinks) == (50.0, True)
    assert bench_kernels.options_label(a) == "softcap 50, sinks"
    b = bench_kernels.parse_args([])
    assert (b.softcap, b.sinks, bench_kernels.options_label(b)) == (0.0, False, "")
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            bench_kernels.parse_args(["--softcap", bad])
        assert f"--softcap must be a finite float >= 0 (0 = off), got {float(bad)}" in capsys.readouterr().err


def test_bench_kernels_with_softcap_and_sinks_on_cpu(tmp_path, capsys):
    rows = bench_kernels.run(bench_kernels.parse_args([
        "--device", "cpu", "--flashmask-backend", "reference", "--flex-no-compile", "--families",
        "causal,causal_document", "--seqlens", "64", "--heads", "4", "--kv-heads", "2", "--head-dims", "16",
        "--modes", "fwd,bwd", "--methods", "flashmask,flex,sdpa_dense,sdpa_flash,sdpa_cudnn", "--softcap", "30",
        "--sinks", "--warmup", "0", "--rep", "0", "--out", str(tmp_path)]))
    by = {(r["family"], r["mode"], r["method"]): r for r in rows}
    assert all(r["softcap"] == 30.0 and r["sinks"] is True for r in rows)
    for fam in ("causal", "causal_document"):
        for mode in ("fwd", "bwd"):
            fm = by[(fam, mode, "flashmask")]
            assert fm["status"] == "ok", fm
            # the FLOPs of the two GEMMs, as without the options
            assert fm["tflops"] == pytest.approx(flops.attn_flops(fm["pairs"], 16, mode) / (fm["ms"] * 1e-3) / 1e12)
            assert fm["pairs"] == flops.total_pairs(example(fam, 64)[0], True, batch=1, heads=4, seqlen_q=64,
                                                    seqlen_k=64)
            dense = by[(fam, mode, "sdpa_dense")]
            assert dense["status"] == "n/a" and "SDPA cannot express logit soft-capping" in dense["notes"]
        assert by[(fam, "fwd", "flex")]["status"] == "ok"
        assert "sinks as out * sigmoid(lse - sink)" in by[(fam, "fwd", "flex")]["notes"]
        assert by[(fam, "bwd", "flex")]["status"] == "error"  # FlexAttention has no backward on the CPU
    for m in ("sdpa_flash", "sdpa_cudnn"):  # plain causal: an n/a row with the reason; other masks: none
        assert by[("causal", "fwd", m)]["status"] == "n/a" and ("causal_document", "fwd", m) not in by
    with open(tmp_path / "kernels.csv") as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(rows) and {(r["softcap"], r["sinks"]) for r in got} == {("30", "True")}
    with open(tmp_path / "kernels.json") as f:
        meta = json.load(f)["meta"]
    assert meta["args"]["softcap"] == 30.0 and meta["args"]["sinks"] is True
    assert "softcap and sinks add none" in meta["flop_convention"]
    out = capsys.readouterr().out
    assert "every row: softcap 30, sinks" in out and "| softcap 30, sinks" in out
