"""Logit soft-capping (``softcap``, Gemma 2) and attention sinks (``sinks``, GPT-OSS) on the CPU.

The reference path against an oracle written from the definitions (tanh of the scaled scores; the
sink as one more softmax column that is dropped after the softmax, as GPT-OSS's eager attention
does), in float64 with gradients (the sinks' included); the sinks' gradient against its closed
form; fully masked rows; the input checks; the choice of backend while the kernels lack both
options; the custom ops' fake shapes and autograd under torch.compile; the GPU tests' half-precision
baseline and checks with both options (tests/attn_helpers.py), and the kernels' sink gradient.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashmask
import masks
from flashmask import _cuda, flashmask_attention
from flashmask.reference import reference_attention
from tests.attn_helpers import (
    TIGHT,
    assert_close_to_reference,
    dense_from_intervals,
    error_bound,
    hidden_rows,
    hide_rows,
    low_precision_attention,
    random_startend,
)
from tests.cpu_kernels import registered

MODES = [(True, 1), (True, 2), (False, 2), (False, 4)]


def oracle(q, k, v, allowed, scale=None, softcap=0.0, sinks=None):
    """float64 ``(out, lse)`` from the definitions: scores, tanh cap, mask, then a softmax over the
    keys and (with sinks) one more column holding the head's sink, dropped before the product with V."""
    q, k, v = q.double(), k.double(), v.double()
    b, sq, hq, d = q.shape
    hk, hm = k.shape[2], allowed.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kv_head = torch.arange(hq) // (hq // hk)
    a = allowed[:, torch.arange(hq) // (hq // hm)]  # [B or 1, Hq, Sq, Sk]
    s = torch.einsum("bihd,bjhd->bhij", q, k[:, :, kv_head]) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~a, float("-inf"))
    if sinks is None:
        empty = ~a.any(-1, keepdim=True)
        s = torch.where(empty, 0.0, s)
        p = torch.where(empty, 0.0, torch.softmax(s, -1))
        lse = torch.where(empty, float("inf"), torch.logsumexp(s, -1, keepdim=True)).squeeze(-1)
    else:
        col = sinks.double().view(1, hq, 1, 1).expand(b, hq, sq, 1)
        full = torch.cat([s, col], -1)
        p = torch.softmax(full, -1)[..., :-1]
        lse = torch.logsumexp(full, -1)
    return torch.einsum("bhij,bjhd->bihd", p, v[:, :, kv_head]), lse


def inputs(b, sq, sk, hq, hk, d, dv, seed, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv))
    q, k, v = ((torch.randn(s, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_() for s in shapes)
    sinks = (torch.randn(hq, generator=g, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    return q, k, v, sinks


def grads_of(out, lse, tensors, seed):
    """Gradients of a random linear function of out and of the finite LSE entries."""
    g = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    loss = (out.double() * w_out).sum() + (torch.where(torch.isfinite(lse), lse.double(), 0.0) * w_lse).sum()
    return torch.autograd.grad(loss, tensors)


# --- the reference path against the oracle ---------------------------------------------------------------

@pytest.mark.parametrize("causal,c", MODES)
@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 1)])
@pytest.mark.parametrize("sq,sk", [(13, 13), (9, 17), (17, 9)])
@pytest.mark.parametrize("softcap,use_sinks", [(5.0, False), (0.0, True), (3.0, True)])
def test_reference_matches_the_oracle_with_gradients(causal, c, hq, hk, sq, sk, softcap, use_sinks):
    seed = sq * 31 + sk + hk * 7 + c + int(softcap) + use_sinks
    g = torch.Generator().manual_seed(seed)
    hm = [1, hk, hq][seed % 3]
    mask = random_startend(2, hm, sq, sk, causal, c, generator=g)
    q, k, v, sinks = inputs(2, sq, sk, hq, hk, 16, 8, seed, scale=2.0)  # scores of several units: the cap matters
    sinks = sinks if use_sinks else None
    out, lse = flashmask_attention(q, k, v, mask, causal=causal, return_lse=True, softcap=softcap, sinks=sinks)
    want_out, want_lse = oracle(q, k, v, dense_from_intervals(mask, causal, sq, sk), softcap=softcap, sinks=sinks)
    assert out.shape == (2, sq, hq, 8) and lse.shape == (2, hq, sq)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(lse, want_lse, **TIGHT)
    tensors = (q, k, v) + ((sinks,) if use_sinks else ())
    got = grads_of(out, lse, tensors, seed)
    want = grads_of(want_out, want_lse, tensors, seed)
    for name, x, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(x, w, **TIGHT, msg=lambda m: f"{name}: {m}")


def test_softcap_changes_the_result_and_a_large_cap_is_no_cap():
    q, k, v, _ = inputs(1, 12, 12, 2, 2, 16, 16, seed=1, scale=3.0)
    plain = flashmask_attention(q, k, v, causal=True)
    capped = flashmask_attention(q, k, v, causal=True, softcap=2.0)
    assert (capped - plain).abs().max() > 1e-2
    torch.testing.assert_close(flashmask_attention(q, k, v, causal=True, softcap=1e9), plain, rtol=1e-9, atol=1e-9)


def test_gradcheck_float64():
    q, k, v, sinks = inputs(1, 7, 9, 4, 2, 8, 4, seed=2)
    mask = random_startend(1, 2, 7, 9, False, 4, generator=torch.Generator().manual_seed(2))

    def f(q, k, v, sinks):
        return flashmask_attention(q, k, v, mask, softcap=1.5, sinks=sinks, return_lse=True)

    # (the LSE of rows no key may attend is the sink itself: differentiable too)
    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def test_sink_gradient_is_minus_p_sink_times_rowsum_of_do_o():
    q, k, v, sinks = inputs(2, 11, 11, 4, 2, 16, 8, seed=3)
    mask = masks.causal_document(11, [[4, 7], [11]])
    out, lse = flashmask_attention(q, k, v, mask, causal=True, sinks=sinks, return_lse=True)
    dout = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, sinks, dout, retain_graph=True)
    p_sink = torch.exp(sinks.detach().view(1, -1, 1) - lse.detach())  # [B, Hq, Sq]
    rowsum = (dout * out.detach()).sum(-1).transpose(1, 2)  # rowsum(dO * O), [B, Hq, Sq]
    torch.testing.assert_close(got, -(p_sink * rowsum).sum((0, 2)), **TIGHT)
    # the helper the kernels' backward uses, from their row term D = rowsum(dO * O) - dlse: the same,
    # plus the LSE's own gradient where it has one
    torch.testing.assert_close(_cuda.sink_grad(lse.detach(), rowsum, sinks).double(), got, rtol=1e-5, atol=1e-6)
    dlse = torch.randn_like(lse)
    (with_lse,) = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), sinks)
    torch.testing.assert_close(_cuda.sink_grad(lse.detach(), rowsum - dlse, sinks).double(), with_lse,
                               rtol=1e-5, atol=1e-6)


def test_fully_masked_rows_give_zero_output_and_the_sink_as_lse():
    # causal C=1 with LTS = 0 on every column of batch 1: its rows see no key
    sq = sk = 8
    q, k, v, sinks = inputs(2, sq, sk, 2, 2, 8, 8, seed=4)
    mask = torch.stack([masks.causal(sq)[0], torch.zeros(1, sk, 1, dtype=torch.int32)])
    out, lse = flashmask_attention(q, k, v, mask, causal=True, sinks=sinks, softcap=4.0, return_lse=True)
    assert (out[1] == 0).all()
    torch.testing.assert_close(lse[1], sinks.detach().view(2, 1).expand(2, sq), **TIGHT)
    dout = torch.zeros_like(out)
    dout[1] = torch.randn_like(out[1])  # only the hidden rows reach the loss
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout, retain_graph=True)
    for name, g in zip(("dq", "dk", "dv", "dsinks"), grads):
        assert (g == 0).all(), name  # p_sink = 1, O = 0: d sink = -p_sink * rowsum(dO * O) = 0
    # through the LSE the sink of a hidden row has weight 1
    (dsinks,) = torch.autograd.grad(lse[1].sum(), sinks)
    torch.testing.assert_close(dsinks, torch.full_like(dsinks, sq), **TIGHT)


def test_no_keys_with_sinks():
    q, k, v, sinks = inputs(1, 5, 0, 2, 1, 8, 4, seed=5)
    out, lse = flashmask_attention(q, k, v, sinks=sinks, return_lse=True)
    assert out.shape == (1, 5, 2, 4) and (out == 0).all()
    torch.testing.assert_close(lse, sinks.detach().view(1, 2, 1).expand(1, 2, 5))
    (dsinks,) = torch.autograd.grad(lse.sum(), sinks)
    torch.testing.assert_close(dsinks, torch.full_like(dsinks, 5.0))


@pytest.mark.parametrize("value", [1e4, -1e4, 80.0, -80.0])
def test_large_sinks_stay_finite(value):
    q, k, v, _ = inputs(1, 9, 9, 2, 2, 8, 8, seed=6, dtype=torch.float32)
    sinks = torch.full((2,), value, requires_grad=True)
    mask = masks.causal_document(9, [3, 6])
    out, lse = flashmask_attention(q, k, v, mask, causal=True, sinks=sinks, return_lse=True)
    want_out, want_lse = oracle(q, k, v, dense_from_intervals(mask, True, 9, 9), sinks=sinks)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.sum(), (q, k, v, sinks))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sinks_of_another_dtype_get_a_gradient_of_their_dtype(dtype):
    q, k, v, _ = inputs(1, 6, 6, 2, 2, 8, 8, seed=7, dtype=torch.float32)
    sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0], dtype=dtype))
    out = flashmask_attention(q, k, v, causal=True, sinks=sinks)
    out.sum().backward()
    assert sinks.grad.dtype == dtype and sinks.grad.shape == (2,)
    half = flashmask_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, sinks=sinks)
    assert half.dtype == torch.bfloat16


def test_non_finite_visible_scores_still_propagate_nan():
    q, k, v, sinks = inputs(1, 4, 4, 1, 1, 4, 4, seed=8)
    q = q.detach().clone()
    q[0, 2, 0, 0] = float("nan")
    out = flashmask_attention(q, k, v, causal=True, sinks=sinks, softcap=2.0)
    assert torch.isnan(out[0, 2]).all() and not torch.isnan(out[0, [0, 1, 3]]).any()
    # tanh caps an infinite score (as Gemma 2's eager attention does): finite, the key takes it all
    q[0, 2, 0, 0] = float("inf")
    kk = k.detach().clone()
    kk[0, :, 0, 0] = 1.0
    out = flashmask_attention(q, kk, v, causal=True, softcap=2.0)
    assert torch.isfinite(out).all()


# --- the input checks ---------------------------------------------------------------------------------------

def _good():
    return inputs(1, 6, 6, 4, 2, 8, 8, seed=9, dtype=torch.float32)


@pytest.mark.parametrize("softcap,exc,match", [
    (-1.0, ValueError, r"softcap must be a finite float >= 0 \(0 turns soft-capping off\), got -1\.0"),
    (float("nan"), ValueError, r"softcap must be a finite float >= 0 .*got nan"),
    (float("inf"), ValueError, r"softcap must be a finite float >= 0 .*got inf"),
    (True, TypeError, r"softcap must be a finite float >= 0 .*got bool True"),
    ("50", TypeError, r"softcap must be a finite float >= 0 .*got str '50'"),
    (None, TypeError, r"softcap must be a finite float >= 0 .*got NoneType None"),
    (torch.ones(2), TypeError, r"softcap must be a finite float >= 0 .*got Tensor"),
])
def test_bad_softcap_raises(softcap, exc, match):
    q, k, v, _ = _good()
    with pytest.raises(exc, match=match):
        flashmask_attention(q, k, v, softcap=softcap)


def test_softcap_takes_ints_and_one_element_tensors():
    q, k, v, _ = _good()
    want = flashmask_attention(q, k, v, softcap=3.0)
    assert torch.equal(flashmask_attention(q, k, v, softcap=3), want)
    assert torch.equal(flashmask_attention(q, k, v, softcap=torch.tensor(3.0)), want)
    assert torch.equal(flashmask_attention(q, k, v, softcap=0), flashmask_attention(q, k, v))


@pytest.mark.parametrize("sinks,exc,match", [
    (torch.zeros(3), ValueError, r"sinks must have shape \[Hq\] = \[4\] .*got \(3,\)"),
    (torch.zeros(1, 4), ValueError, r"sinks must have shape \[Hq\] = \[4\] .*got \(1, 4\)"),
    (torch.zeros(4, dtype=torch.long), TypeError, r"sinks must be a floating-point tensor, got torch.int64"),
    (torch.zeros(4, dtype=torch.bool), TypeError, r"sinks must be a floating-point tensor, got torch.bool"),
    ([0.0] * 4, TypeError, r"sinks must be a torch.Tensor \[Hq\] .*got list"),
    (torch.zeros(4, device="meta"), ValueError, r"sinks is on meta but q is on cpu"),
])
def test_bad_sinks_raise(sinks, exc, match):
    q, k, v, _ = _good()
    with pytest.raises(exc, match=match):
        flashmask_attention(q, k, v, sinks=sinks)


# --- the kernels take both options ------------------------------------------------------------------------

def _fake_cuda(*shape):
    return torch.empty(shape, device="cuda", dtype=torch.bfloat16)


FAKE_ADDRESS = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")


@pytest.fixture
def kernels_built(monkeypatch):
    """As on a GPU with the kernels built for head dim 64 in bf16."""
    monkeypatch.setattr(_cuda, "available", lambda: True)
    monkeypatch.setattr(_cuda, "compiled_head_dims", lambda: (64,))
    monkeypatch.setattr(_cuda, "compiled_head_dim_pairs", lambda: ((64, 64),))
    monkeypatch.setattr(_cuda, "compiled_dtypes", lambda: (torch.bfloat16,))
    monkeypatch.setattr(flashmask.attention, "_warned", set())


@FAKE_ADDRESS
@pytest.mark.parametrize("option", ["softcap", "sinks"])
def test_kernel_backends_take_the_options(option, kernels_built, monkeypatch):
    """Both options reach the kernels' ops (here their fake implementations): no fallback, no warning."""
    seen = []
    real = _cuda.attention
    monkeypatch.setattr(_cuda, "attention", lambda *args: seen.append(args[-2:]) or real(*args))
    with FakeTensorMode():
        q = _fake_cuda(1, 8, 4, 64)
        kw = {"softcap": 30.0} if option == "softcap" else {"sinks": torch.zeros(4, device="cuda")}
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*reference path")
            for backend in ("sm80", "auto"):
                out = flashmask_attention(q, q, q, causal=True, backend=backend, **kw)
                assert out.shape == (1, 8, 4, 64)
    assert len(seen) == 2
    for softcap, sinks in seen:
        assert softcap == kw.get("softcap", 0.0) and (sinks is not None) == (option == "sinks")


# --- the custom ops: fake shapes, autograd glue, torch.compile ----------------------------------------------

def test_fake_shapes_with_sinks():
    with FakeTensorMode():
        q = torch.empty(2, 9, 8, 64, dtype=torch.bfloat16)
        k = v = torch.empty(2, 11, 2, 64, dtype=torch.bfloat16)
        sinks = torch.empty(8, dtype=torch.bfloat16)
        out, lse = torch.ops.flashmask.fwd(q, k, v, None, True, 0.1, False, 0, 0, 30.0, sinks)
        dq, dk, dv, dsinks = torch.ops.flashmask.bwd(out, q, k, v, out, lse, None, None, True, 0.1, False, 0, 30.0,
                                                     sinks)
    assert out.shape == (2, 9, 8, 64) and lse.shape == (2, 8, 9)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dsinks.shape == (8,) and dsinks.dtype == torch.float32


@pytest.fixture
def cpu_kernels_with_options():
    with registered():
        yield


def test_compiled_custom_ops_take_sinks_as_a_graph_input(cpu_kernels_with_options):
    """torch.compile(fullgraph=True) traces the ops with softcap and a sinks tensor (fake shapes) and
    their registered autograd: forward and every gradient, the sinks' included, equal the reference path."""
    q, k, v, sinks = inputs(2, 13, 13, 4, 2, 16, 8, seed=10)
    mask = masks.causal_document(13, [[5, 8], [13]])

    def f(q, k, v, sinks):
        return _cuda.attention(q, k, v, mask, True, 0.3, False, 0, 0, 2.0, sinks)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out, lse = compiled(q, k, v, sinks)
    torch.compile(f, fullgraph=True, backend=backend)(q, k, v, sinks)
    assert any("flashmask.fwd" in str(gm.code) for gm in graphs)
    want_out, want_lse = reference_attention(q, k, v, mask, causal=True, softmax_scale=0.3, softcap=2.0, sinks=sinks)
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(lse, want_lse, **TIGHT)
    got = grads_of(out, lse, (q, k, v, sinks), seed=10)
    want = grads_of(want_out, want_lse, (q, k, v, sinks), seed=10)
    for name, x, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(x, w, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_compiled_flashmask_attention_with_both_options_on_the_reference_path():
    q, k, v, _ = inputs(2, 16, 16, 4, 2, 16, 8, seed=11, dtype=torch.float32)
    sinks = torch.nn.Parameter(torch.randn(4))
    mask = masks.causal_document(16, [7, 9], batch_size=2)

    def f(q, k, v, sinks):
        return flashmask_attention(q, k, v, mask, causal=True, softcap=4.0, sinks=sinks)

    want = f(q, k, v, sinks)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
    torch.testing.assert_close(got, want)
    dout = torch.randn_like(got)
    tensors = (q, k, v, sinks)
    for x, w in zip(torch.autograd.grad(got, tensors, dout), torch.autograd.grad(want, tensors, dout)):
        torch.testing.assert_close(x, w)



# --- the modules --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_attention_module_with_softcap_and_learnable_sinks(layout):
    attn = flashmask.FlashMaskAttention(causal=True, layout=layout, softcap=3.0, sinks=True, num_heads=4)
    assert isinstance(attn.sinks, torch.nn.Parameter) and attn.sinks.shape == (4,) and (attn.sinks == 0).all()
    assert [n for n, _ in attn.named_parameters()] == ["sinks"] and "softcap=3.0, sinks=[4]" in repr(attn)
    with torch.no_grad():
        attn.sinks.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    q, k, v, _ = inputs(2, 10, 10, 4, 2, 16, 8, seed=12, dtype=torch.float32)
    mask = masks.causal_document(10, [[4, 6], [10]])
    args = (q, k, v) if layout == "bshd" else tuple(t.transpose(1, 2) for t in (q, k, v))
    out = attn(*args, mask)
    out = out if layout == "bshd" else out.transpose(1, 2)
    want = flashmask_attention(q, k, v, mask, causal=True, softcap=3.0, sinks=attn.sinks.detach())
    torch.testing.assert_close(out, want)
    out.sum().backward()
    assert attn.sinks.grad is not None and attn.sinks.grad.abs().sum() > 0


def test_attention_module_takes_initial_sink_values():
    init = torch.tensor([1.0, -2.0])
    attn = flashmask.FlashMaskAttention(sinks=init)
    assert isinstance(attn.sinks, torch.nn.Parameter) and torch.equal(attn.sinks.detach(), init)
    assert attn.sinks.data_ptr() != init.data_ptr()  # a copy: the argument is not trained in place
    assert flashmask.FlashMaskAttention(sinks=False).sinks is None
    assert flashmask.FlashMaskAttention().sinks is None and "sinks" not in repr(flashmask.FlashMaskAttention())


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(sinks=True), ValueError, r"sinks=True needs num_heads, the number of query heads \(a positive int\), "
                                   r"got None"),
    (dict(sinks=True, num_heads=0), ValueError, r"needs num_heads.*got 0"),
    (dict(sinks=torch.zeros(3), num_heads=4), ValueError, r"sinks has 3 values but num_heads is 4"),
    (dict(sinks=torch.zeros(2, 2)), TypeError, r"sinks must be None, a bool or a floating-point tensor "
                                               r"\[num_heads\], got Tensor\(2, 2\)"),
    (dict(sinks="yes"), TypeError, r"sinks must be None, a bool or .*got str"),
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite float >= 0"),
])
def test_attention_module_constructor_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        flashmask.FlashMaskAttention(**kwargs)


def test_self_attention_with_softcap_and_sinks_matches_manual_computation():
    torch.manual_seed(13)
    attn = flashmask.FlashMaskSelfAttention(hidden_size=32, num_heads=4, num_kv_heads=2, rotary=False, softcap=2.0,
                                            sinks=True, window_size=(3, 0)).double()
    assert attn.attn.sinks.shape == (4,) and attn.attn.sinks.dtype == torch.float64
    with torch.no_grad():
        attn.attn.sinks.normal_()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    out = attn(x)
    q = attn.q_proj(x).view(2, 9, 4, 8)
    k = attn.k_proj(x).view(2, 9, 2, 8)
    v = attn.v_proj(x).view(2, 9, 2, 8)
    i, j = torch.arange(9).view(-1, 1), torch.arange(9).view(1, -1)
    allowed = ((j <= i) & (j >= i - 3)).view(1, 1, 9, 9)
    o, _ = oracle(q, k, v, allowed, softcap=2.0, sinks=attn.attn.sinks)
    torch.testing.assert_close(out, attn.o_proj(o.reshape(2, 9, 32)), **TIGHT)
    out.sum().backward()
    assert attn.attn.sinks.grad.shape == (4,)


# --- the GPU tests' baseline and checks (tests/attn_helpers.py) ----------------------------------------------

def _mask_hiding_rows(seed, hm, sq, sk, causal, c):
    """Random intervals whose batch 0 hides rows [3, 6) (causal C=1: [3, Sq); non-causal C=2: [0, 6))."""
    mask = random_startend(2, hm, sq, sk, causal, c, generator=torch.Generator().manual_seed(seed))
    return hide_rows(mask, causal, 3, 6)


@pytest.mark.parametrize("causal,c", MODES)
def test_hidden_rows_are_the_rows_that_see_no_key(causal, c):
    mask = _mask_hiding_rows(20 + c, 2, 9, 13, causal, c)
    want = ~dense_from_intervals(mask, causal, 9, 13).any(-1).repeat_interleave(2, 1)  # [2, Hq = 4, Sq]
    got = hidden_rows(mask, causal, 9, 13, 2, 4)
    assert torch.equal(got, want)
    assert got[0, :, 3:6].all()
    assert torch.equal(hidden_rows(None, True, 7, 4, 1, 2), torch.arange(7).expand(1, 2, 7) < 3)


@pytest.mark.parametrize("causal,c", MODES)
@pytest.mark.parametrize("softcap,use_sinks", [(3.0, False), (0.0, True), (3.0, True)])
def test_low_precision_baseline_is_the_oracle_when_nothing_rounds(causal, c, softcap, use_sinks):
    """low_precision_attention, the GPU tests' error baseline, computes the oracle's function with the
    options (rows that see no key included), gradients too, when its inputs are float64 (its softmax
    still runs in float32)."""
    seed = 30 + 7 * c + int(softcap) + use_sinks
    mask = _mask_hiding_rows(seed, 2, 9, 13, causal, c)
    q, k, v, sinks = inputs(2, 9, 13, 4, 2, 16, 8, seed, scale=2.0)
    sinks = sinks if use_sinks else None
    out, lse = low_precision_attention(q, k, v, mask, causal, None, softcap, sinks)
    want_out, want_lse = oracle(q, k, v, dense_from_intervals(mask, causal, 9, 13), softcap=softcap, sinks=sinks)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    seen = torch.isfinite(want_lse)  # without sinks the baseline's LSE of a row that sees no key is -inf
    assert use_sinks or not seen.all()
    assert not torch.isfinite(lse[~seen]).any()
    torch.testing.assert_close(lse.double()[seen], want_lse[seen], rtol=1e-5, atol=1e-6)
    tensors = (q, k, v) + ((sinks,) if use_sinks else ())
    got = grads_of(out, lse, tensors, seed)
    want = grads_of(want_out, want_lse, tensors, seed)
    for name, x, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(x, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_assert_close_to_reference_with_sinks_checks_the_rows_that_see_no_key():
    """The GPU tests' forward check takes the reference's own result and fails one whose rows that see
    no key are off: LSE +inf or another value than the sink, an output not exactly 0; or one without sinks."""
    mask = _mask_hiding_rows(40, 1, 12, 10, True, 2)
    q, k, v, sinks = (t.detach() for t in inputs(2, 12, 10, 4, 2, 16, 16, seed=40, dtype=torch.bfloat16))
    hidden = hidden_rows(mask, True, 12, 10, 2, 4)
    assert hidden.any() and not hidden.all()
    out, lse = reference_attention(q, k, v, mask, causal=True, softcap=4.0, sinks=sinks)
    assert_close_to_reference(out, lse, q, k, v, mask, True, softcap=4.0, sinks=sinks)
    off = out.clone()
    off.transpose(1, 2)[hidden] = 1e-30  # representable in bf16
    wrong = {
        "LSE +inf": (out, torch.where(hidden, float("inf"), lse)),
        "LSE off the sink": (out, torch.where(hidden, lse * (1 + 2 ** -18), lse)),
        "output not 0": (off, lse),
        "without sinks": reference_attention(q, k, v, mask, causal=True, softcap=4.0),
        "without softcap": reference_attention(q, k, v, mask, causal=True, sinks=sinks),
    }
    for what, (o, ls) in wrong.items():
        with pytest.raises(AssertionError):
            assert_close_to_reference(o, ls, q, k, v, mask, True, softcap=4.0, sinks=sinks)
            pytest.fail(f"{what} passed")


def test_error_bound_takes_the_unit_of_another_dtype():
    ref = torch.tensor([3.0, -1.0], dtype=torch.float64)
    low = ref + torch.tensor([1e-4, 0.0], dtype=torch.float64)
    assert error_bound(low, ref) == pytest.approx(2e-4 + 1e-3 * 3.0)
    assert error_bound(low, ref, ulp=2.0 ** -7) == pytest.approx(2e-4 + 2.0 ** -7 * 3.0)
    assert error_bound(low, ref, ulp=1e-5) == pytest.approx(2e-4 + 1e-3 * 3.0)  # never below the 1e-3 epsilon


@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("sink_dtype", [torch.float64, torch.bfloat16])
def test_sink_grad_matches_autograd_on_rows_that_see_no_key(with_dlse, sink_dtype):
    """_cuda.sink_grad (the kernels' dsinks, from their LSE and row term D) against autograd through the
    reference path, with a cap, GQA, mask heads = Hk and rows that see no key (p_sink = 1, O = 0: they
    give their dLSE alone); the sinks in bf16 are read as the float32 of their values."""
    mask = _mask_hiding_rows(50, 2, 11, 14, False, 4)
    q, k, v, sinks = inputs(2, 11, 14, 4, 2, 16, 8, seed=50, scale=2.0)
    sinks = sinks.detach().to(sink_dtype).double().requires_grad_()  # values a bf16 tensor holds
    out, lse = reference_attention(q, k, v, mask, causal=False, softcap=3.0, sinks=sinks)
    assert hidden_rows(mask, False, 11, 14, 2, 4).any()
    g = torch.Generator().manual_seed(51)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64) if with_dlse else None
    loss = (out * dout).sum() + ((lse * dlse).sum() if with_dlse else 0)
    (want,) = torch.autograd.grad(loss, sinks)
    dsum = (dout * out.detach()).sum(-1).transpose(1, 2)  # the kernels' row term D = rowsum(dO * O) - dlse
    if with_dlse:
        dsum = dsum - dlse
    got = _cuda.sink_grad(lse.detach(), dsum, sinks.detach().to(sink_dtype))
    assert got.dtype == torch.float32 and got.shape == (4,)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
