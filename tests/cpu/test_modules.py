"""The nn.Modules on CPU: FlashMaskAttention layouts, FlashMaskSelfAttention (GQA, rotary, packed
documents) and RotaryEmbedding."""
from __future__ import annotations

import doctest

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import masks
from flashmask import FlashMaskAttention, FlashMaskSelfAttention, RotaryEmbedding
from tests.attn_helpers import dense_from_intervals, dense_window, naive_attention, random_startend

MODES = [(True, 1), (True, 2), (False, 2), (False, 4)]
TIGHT = dict(atol=1e-10, rtol=1e-10)
HYP = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- FlashMaskAttention -----------------------------------------------------------------------------

@pytest.mark.parametrize("causal,c", MODES)
def test_layouts_bshd_and_bhsd_agree(causal, c):
    b, hq, hk, sq, sk, d = 2, 4, 2, 9, 12, 8
    qh, kh, vh = (torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True)
                  for h, s in ((hq, sq), (hk, sk), (hk, sk)))
    se = random_startend(b, hk, sq, sk, causal, c)
    out_h = FlashMaskAttention(causal=causal, layout="bhsd")(qh, kh, vh, se)
    assert out_h.shape == (b, hq, sq, d)
    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (qh, kh, vh))
    out_s = FlashMaskAttention(causal=causal, layout="bshd")(q, k, v, se)
    assert out_s.shape == (b, sq, hq, d)
    torch.testing.assert_close(out_h.transpose(1, 2), out_s, atol=1e-12, rtol=1e-12)
    want, _ = naive_attention(q, k, v, dense_from_intervals(se, causal, sq, sk))
    torch.testing.assert_close(out_s, want, **TIGHT)
    g = torch.randn_like(out_s)
    (out_h * g.transpose(1, 2)).sum().backward()
    (out_s * g).sum().backward()
    for th, ts in ((qh, q), (kh, k), (vh, v)):
        torch.testing.assert_close(th.grad.transpose(1, 2), ts.grad, atol=1e-12, rtol=1e-12)


def test_default_layout_is_bshd():
    q = torch.randn(1, 5, 2, 4, dtype=torch.float64)
    out = FlashMaskAttention(causal=True)(q, q, q)
    want, _ = naive_attention(q, q, q, dense_from_intervals(None, True, 5, 5))
    torch.testing.assert_close(out, want, **TIGHT)


@pytest.mark.parametrize("layout", ["bsdh", "BSHD", "", None])
def test_invalid_layout_raises(layout):
    with pytest.raises(ValueError, match=r"layout must be one of \('bshd', 'bhsd'\)"):
        FlashMaskAttention(layout=layout)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_attention_module_passes_its_options(layout):
    b, hq, hk, sq, sk, d = 2, 2, 1, 10, 10, 4
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    se = masks.causal_document(10, [[3, 7], [10]])
    m = FlashMaskAttention(causal=True, softmax_scale=0.3, window_size=(2, 0), layout=layout,
                           deterministic=True, backend="reference")
    tr = (lambda t: t.transpose(1, 2)) if layout == "bhsd" else (lambda t: t)
    out = tr(m(tr(q), tr(k), tr(v), se))
    allowed = dense_from_intervals(se, True, sq, sk) & dense_window(sq, sk, (2, 0), True)
    torch.testing.assert_close(out, naive_attention(q, k, v, allowed, 0.3)[0], **TIGHT)
    assert "causal=True" in repr(m) and layout in repr(m)


def test_attention_module_cuda_backend_on_cpu_raises():
    q = torch.randn(1, 4, 2, 8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="backend='cuda' cannot run"):
        FlashMaskAttention(causal=True, backend="cuda")(q, q, q)


# --- FlashMaskSelfAttention ---------------------------------------------------------------------------

def _positions(lens):
    return torch.cat([torch.arange(n) for n in lens])


@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_self_attention_forward_backward(rotary, num_heads, num_kv_heads):
    lens = [[5, 4, 3], [7, 5]]
    s, e = 12, 32
    pos = torch.stack([_positions(x) for x in lens])  # restarting position ids, [2, 12]
    se = masks.from_position_ids(pos, causal=True)
    assert torch.equal(se, masks.causal_document(s, lens))
    m = FlashMaskSelfAttention(hidden_size=e, num_heads=num_heads, num_kv_heads=num_kv_heads, rotary=rotary,
                               bias=True)
    assert (m.rotary is not None) == rotary
    assert m.k_proj.out_features == num_kv_heads * (e // num_heads)
    x = torch.randn(2, s, e, requires_grad=True)
    y = m(x, se, position_ids=pos)
    assert y.shape == (2, s, e) and y.dtype == x.dtype and torch.isfinite(y).all()
    (y * torch.randn_like(y)).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, p in m.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"


@st.composite
def packings(draw, max_docs=3, max_len=7):
    """Per sample of a batch of 2: document lengths, all samples padded to one total length."""
    docs = [draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_docs)) for _ in range(2)]
    s = max(sum(x) for x in docs)
    return [x if sum(x) == s else x + [s - sum(x)] for x in docs], s


def _run_packed_vs_alone(m, lens, s, e, dtype, causal):
    pos = torch.stack([_positions(x) for x in lens])
    se = (masks.causal_document if causal else masks.document)(s, lens)
    x = torch.randn(len(lens), s, e, dtype=dtype, requires_grad=True)
    dy = torch.randn(len(lens), s, e, dtype=dtype)
    y = m(x, se, position_ids=pos)
    (y * dy).sum().backward()
    pieces = []
    for b, doc_lens in enumerate(lens):
        a = 0
        for n in doc_lens:
            xs = x.detach()[b:b + 1, a:a + n].clone().requires_grad_()
            ys = m(xs, None, position_ids=torch.arange(n).view(1, n))  # one document alone, no mask
            (ys * dy[b:b + 1, a:a + n]).sum().backward()
            pieces.append((b, a, n, ys.detach(), xs.grad))
            a += n
    return x, y.detach(), pieces


@pytest.mark.parametrize("causal", [True, False])
@settings(max_examples=8, **HYP)
@given(packings())
def test_packed_documents_equal_separate_runs(causal, packing):
    """The key property: documents packed into one row with a (causal_)document mask and restarting
    position ids give the same outputs and input gradients as each document run alone."""
    lens, s = packing
    e = 24
    m = FlashMaskSelfAttention(hidden_size=e, num_heads=4, num_kv_heads=2, rotary=True, causal=causal)
    x, y, pieces = _run_packed_vs_alone(m, lens, s, e, torch.float32, causal)
    for b, a, n, ys, gs in pieces:
        torch.testing.assert_close(y[b:b + 1, a:a + n], ys, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(x.grad[b:b + 1, a:a + n], gs, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents_equal_separate_runs_float64(causal):
    lens, s, e = [[4, 6, 2], [9, 3]], 12, 16
    m = FlashMaskSelfAttention(hidden_size=e, num_heads=4, num_kv_heads=1, rotary=False, causal=causal).double()
    x, y, pieces = _run_packed_vs_alone(m, lens, s, e, torch.float64, causal)
    for b, a, n, ys, gs in pieces:
        torch.testing.assert_close(y[b:b + 1, a:a + n], ys, **TIGHT)
        torch.testing.assert_close(x.grad[b:b + 1, a:a + n], gs, **TIGHT)


def test_packed_without_the_mask_differs():
    """Control for the property above: without the document mask the later documents see the earlier."""
    lens, s, e = [4, 5], 9, 16
    m = FlashMaskSelfAttention(hidden_size=e, num_heads=2, rotary=True).double()
    x = torch.randn(1, s, e, dtype=torch.float64)
    pos = _positions(lens).view(1, s)
    y_masked = m(x, masks.causal_document(s, lens), position_ids=pos)
    y_plain = m(x, None, position_ids=pos)
    torch.testing.assert_close(y_masked[:, :4], y_plain[:, :4], **TIGHT)  # the first document: same
    assert (y_masked[:, 4:] - y_plain[:, 4:]).abs().max() > 1e-3


def test_self_attention_default_positions_and_causality():
    """position_ids default to arange(S); causal=True: output row t does not depend on x[t+1:]."""
    m = FlashMaskSelfAttention(hidden_size=16, num_heads=2, num_kv_heads=1).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    y = m(x)
    torch.testing.assert_close(y, m(x, None, position_ids=torch.arange(7).expand(2, 7)), **TIGHT)
    x2 = x.clone()
    x2[:, 4:] = torch.randn(2, 3, 16, dtype=torch.float64)
    y2 = m(x2)
    torch.testing.assert_close(y2[:, :4], y[:, :4], **TIGHT)
    assert (y2[:, 4:] - y[:, 4:]).abs().max() > 1e-3


@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_self_attention_matches_manual_computation(rotary, causal):
    """projections -> rotary (from the definition) -> naive masked attention -> output projection."""
    b, s, e, nh, nkv = 2, 9, 24, 6, 2
    hd = e // nh
    m = FlashMaskSelfAttention(hidden_size=e, num_heads=nh, num_kv_heads=nkv, rotary=rotary, causal=causal,
                               bias=True, rope_base=500.0)
    x = torch.randn(b, s, e)
    pos = torch.randint(0, 40, (b, s))  # arbitrary positions: they must be used as given
    lens = [[4, 5], [2, 3, 4]]
    se = (masks.causal_document if causal else masks.document)(s, lens)
    y = m(x, se, position_ids=pos)
    with torch.no_grad():
        lin = lambda layer: (x.double() @ layer.weight.double().T + layer.bias.double())
        q = lin(m.q_proj).view(b, s, nh, hd)
        k = lin(m.k_proj).view(b, s, nkv, hd)
        v = lin(m.v_proj).view(b, s, nkv, hd)
        if rotary:
            q, k = _rotary_oracle(q, pos, 500.0), _rotary_oracle(k, pos, 500.0)
        o, _ = naive_attention(q, k, v, dense_from_intervals(se, causal, s, s))
        want = o.reshape(b, s, e) @ m.o_proj.weight.double().T + m.o_proj.bias.double()
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-4)


def test_self_attention_head_dim_override():
    m = FlashMaskSelfAttention(hidden_size=10, num_heads=3, num_kv_heads=1, head_dim=4)
    assert m.q_proj.out_features == 12 and m.k_proj.out_features == 4 and m.o_proj.in_features == 12
    x = torch.randn(2, 5, 10)
    assert m(x).shape == (2, 5, 10)


@pytest.mark.parametrize("rotary", [False, True])
def test_self_attention_gradcheck_float64(rotary):
    """A float64 module is differentiable to float64 precision (gradcheck), rotary included."""
    m = FlashMaskSelfAttention(hidden_size=8, num_heads=2, num_kv_heads=1, rotary=rotary).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    se = masks.causal_document(5, [[2, 3], [5]])
    pos = torch.stack([_positions([2, 3]), _positions([5])])
    assert torch.autograd.gradcheck(lambda x: m(x, se, position_ids=pos), (x,), eps=1e-6, atol=1e-7)


# --- RotaryEmbedding ---------------------------------------------------------------------------------

def _rotary_oracle(x, pos, base=10000.0):
    """Rotate-half RoPE in float64: dims i and i + D/2 form a pair rotated by pos * base**(-2i/D)."""
    d = x.shape[-1]
    freq = base ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    ang = pos.double()[..., None, None] * freq  # [B, S, 1, D/2]
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_rotary_matches_definition(dtype, tol):
    r = RotaryEmbedding(8)
    x = torch.randn(2, 6, 3, 8, dtype=dtype)
    pos = torch.randint(0, 50, (2, 6))
    out = r(x, pos)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), _rotary_oracle(x, pos), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_survives_module_dtype_cast(dtype):
    """model.to(bf16/fp16) is how models are trained: the rotary frequencies must keep their precision
    (at position 4000 a bf16-rounded frequency is off by whole radians)."""
    m = FlashMaskSelfAttention(hidden_size=128, num_heads=2, rotary=True).to(dtype)
    x = torch.randn(1, 4, 2, 64).to(dtype)
    pos = torch.tensor([[0, 17, 1000, 4000]])
    out = m.rotary(x, pos)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), _rotary_oracle(x, pos), atol=3e-2, rtol=2e-2)


def test_rotary_scores_depend_on_relative_position_only():
    r = RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16)
    at = lambda t, p: r(t, torch.tensor([[p]]))
    s1 = (at(q, 7) * at(k, 3)).sum(-1)
    s2 = (at(q, 24) * at(k, 20)).sum(-1)
    s3 = (at(q, 8) * at(k, 3)).sum(-1)
    torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)
    assert (s1 - s3).abs().max() > 1e-4


# --- errors ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden_size=32, num_heads=4, num_kv_heads=3), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    (dict(hidden_size=32, num_heads=2, num_kv_heads=4), r"num_heads \(2\) must be a multiple of num_kv_heads \(4\)"),
    (dict(hidden_size=30, num_heads=4), r"hidden_size \(30\) must be a multiple of num_heads \(4\)"),
    (dict(hidden_size=6, num_heads=2, rotary=True), r"rotary embedding needs an even head dim, got 3"),
    (dict(hidden_size=8, num_heads=2, head_dim=5, rotary=True), r"even head dim, got 5"),
])
def test_self_attention_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlashMaskSelfAttention(**kwargs)


def test_odd_head_dim_without_rotary_is_fine():
    m = FlashMaskSelfAttention(hidden_size=6, num_heads=2, rotary=False)
    assert m(torch.randn(1, 4, 6)).shape == (1, 4, 6)


def test_rotary_odd_head_dim_raises():
    with pytest.raises(ValueError, match=r"even head dim, got 7"):
        RotaryEmbedding(7)


@pytest.mark.parametrize("shape", [(5, 16), (1, 2, 5, 16), (16,)])
def test_self_attention_wrong_x_rank(shape):
    m = FlashMaskSelfAttention(hidden_size=16, num_heads=2)
    with pytest.raises(ValueError, match=r"x must be \[B, S, hidden_size\], got shape " + re_shape(shape)):
        m(torch.randn(*shape))


def re_shape(shape):
    return r"\(" + ", ".join(str(n) for n in shape) + (r",\)" if len(shape) == 1 else r"\)")


@pytest.mark.parametrize("pos_shape", [(2, 6), (1, 5), (5,), (2, 5, 1)])
def test_self_attention_wrong_position_ids_shape(pos_shape):
    m = FlashMaskSelfAttention(hidden_size=16, num_heads=2, rotary=True)
    with pytest.raises(ValueError, match=r"position_ids must be \[B, S\] = \(2, 5\), got " + re_shape(pos_shape)):
        m(torch.randn(2, 5, 16), position_ids=torch.zeros(pos_shape, dtype=torch.long))


def test_self_attention_bad_mask_is_reported():
    m = FlashMaskSelfAttention(hidden_size=16, num_heads=2, causal=True)
    with pytest.raises(ValueError, match=r"C=4 columns .* causal=True"):
        m(torch.randn(1, 6, 16), torch.zeros(1, 1, 6, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"Sk=5 columns but the keys have length 6"):
        m(torch.randn(1, 6, 16), masks.causal_document(5, [2, 3]))
    bidir = FlashMaskSelfAttention(hidden_size=16, num_heads=2, causal=False)
    with pytest.raises(ValueError, match=r"C=1 columns .* causal=False"):  # a causal mask, non-causal module
        bidir(torch.randn(1, 6, 16), masks.causal_document(6, [2, 4]))


# --- docs ----------------------------------------------------------------------------------------------

def test_docstring_examples_of_modules():
    """The examples in flashmask/modules.py run as written."""
    import flashmask.modules as mod
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert res.attempted > 0
    assert res.failed == 0, f"{res.failed} docstring example(s) of flashmask/modules.py fail"
