"""A value head dim of its own (MLA, DeepSeek-V2/V3: Dqk = 192, Dv = 128) on the CPU.

q and k ``[B, S, H, Dqk]``, v ``[B, Sk, Hk, Dv]``, out ``[B, Sq, Hq, Dv]``: the reference path
against the float64 oracle of tests/attn_helpers.py (outputs, LSE and gradients), the input
checks, the kernels' eligibility and the build's head-dim pairs, the custom ops (fake shapes,
autograd, torch.compile) and the modules.
"""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashmask
import masks
from flashmask import FlashMaskAttention, FlashMaskSelfAttention, _checks, _cuda, flashmask_attention
from flashmask.reference import reference_attention
from tests.attn_helpers import TIGHT, check_matches, dense_from_intervals, naive_attention, random_startend
from tests.cpu_kernels import CALLS, CpuExtension, registered

MODES = [(True, 1), (True, 2), (False, 2), (False, 4)]


def qkv(b, sq, sk, hq, hk, dqk, dv, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, sq, hq, dqk), (b, sk, hk, dqk), (b, sk, hk, dv))
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad) for s in shapes]


# --- the reference path against the float64 oracle ---------------------------------------------------

@pytest.mark.parametrize("causal,c", MODES)
@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("sq,sk", [(13, 13), (9, 17), (17, 9)])
@pytest.mark.parametrize("dqk,dv", [(24, 8), (8, 20)])
def test_reference_matches_the_oracle_with_gradients(causal, c, hq, hk, sq, sk, dqk, dv):
    g = torch.Generator().manual_seed(sq * 31 + sk + hk * 7 + c + dqk)
    hm = [1, hk, hq][int(torch.randint(0, 3, (1,), generator=g))]
    mask = random_startend(2, hm, sq, sk, causal, c, generator=g)
    q, k, v = qkv(2, sq, sk, hq, hk, dqk, dv, seed=sq + sk + dv, requires_grad=True)
    out, lse = flashmask_attention(q, k, v, mask, causal=causal, return_lse=True, validate=True)
    assert out.shape == (2, sq, hq, dv) and lse.shape == (2, hq, sq)
    want_out, want_lse = naive_attention(q, k, v, dense_from_intervals(mask, causal, sq, sk))
    check_matches(out, lse, want_out, want_lse)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(want_out, (q, k, v), dout)
    for name, x, w, t in zip("qkv", got, want, (q, k, v)):
        assert x.shape == t.shape, name
        torch.testing.assert_close(x, w, **TIGHT, msg=lambda m: f"d{name}: {m}")


def test_default_softmax_scale_is_one_over_sqrt_of_the_query_key_head_dim():
    q, k, v = qkv(1, 10, 10, 2, 2, 36, 4)
    mask = masks.causal_document(10, [4, 6])
    out = flashmask_attention(q, k, v, mask, causal=True)
    assert torch.equal(out, flashmask_attention(q, k, v, mask, causal=True, softmax_scale=1 / 6))
    assert not torch.allclose(out, flashmask_attention(q, k, v, mask, causal=True, softmax_scale=0.5))
    want, _ = naive_attention(q, k, v, dense_from_intervals(mask, True, 10, 10), scale=1 / math.sqrt(36))
    torch.testing.assert_close(out, want, **TIGHT)


def test_gradcheck_float64():
    q, k, v = qkv(1, 6, 7, 2, 1, 6, 3, requires_grad=True)
    mask = random_startend(1, 1, 6, 7, False, 4, generator=torch.Generator().manual_seed(5))
    assert torch.autograd.gradcheck(lambda q, k, v: flashmask_attention(q, k, v, mask), (q, k, v))


def test_window_and_transposed_views():
    """window_size merges into the mask as usual; BHSD tensors viewed as BSHD need no copy."""
    q, k, v = qkv(2, 12, 12, 4, 2, 16, 8)
    got = flashmask_attention(q, k, v, causal=True, window_size=(3, 0))
    i, j = torch.arange(12).view(-1, 1), torch.arange(12).view(1, -1)
    want, _ = naive_attention(q, k, v, ((j <= i) & (j >= i - 3)).view(1, 1, 12, 12))
    torch.testing.assert_close(got, want, **TIGHT)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert vt.stride()[-1] == 1 and not vt.is_contiguous()
    torch.testing.assert_close(flashmask_attention(qt, kt, vt, causal=True, window_size=(3, 0)), got, rtol=0, atol=0)


@pytest.mark.parametrize("sq,sk", [(0, 5), (5, 0)])
def test_no_rows_or_no_keys(sq, sk):
    q, k, v = qkv(2, sq, sk, 2, 1, 16, 4, requires_grad=True)
    out, lse = flashmask_attention(q, k, v, causal=False, return_lse=True)
    assert out.shape == (2, sq, 2, 4) and lse.shape == (2, 2, sq)
    assert (out == 0).all() and torch.isposinf(lse).all()
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()


def test_half_inputs_on_the_reference_path():
    q, k, v = qkv(1, 16, 16, 2, 2, 24, 8, dtype=torch.bfloat16)
    out = flashmask_attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 16, 2, 8)
    want, _ = naive_attention(q, k, v, dense_from_intervals(None, True, 16, 16))
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


# --- errors ---------------------------------------------------------------------------------------------

ERRORS = [
    ("v heads", (2, 5, 2, 8), (2, 5, 2, 8), (2, 5, 1, 16),
     r"k and v must have the same shape \[B, Sk, Hk\] in their first three dimensions \(v's head dim Dv may differ "
     r"from k's\), got k \(2, 5, 2, 8\) and v \(2, 5, 1, 16\)"),
    ("v length", (2, 5, 2, 8), (2, 5, 2, 8), (2, 4, 2, 16), r"got k \(2, 5, 2, 8\) and v \(2, 4, 2, 16\)"),
    ("v batch", (2, 5, 2, 8), (2, 5, 2, 8), (1, 5, 2, 16), r"got k \(2, 5, 2, 8\) and v \(1, 5, 2, 16\)"),
    ("q/k head dim", (2, 5, 2, 16), (2, 5, 2, 8), (2, 5, 2, 16),
     r"q and k must share the head dim Dqk: q has head dim 16 but k has head dim 8 \(q \(2, 5, 2, 16\), "
     r"k \(2, 5, 2, 8\)\)"),
    ("Dv 0", (2, 5, 2, 8), (2, 5, 2, 8), (2, 5, 2, 0),
     r"the head dim Dv of v must be >= 1, got Dv=0 \(v \(2, 5, 2, 0\)\)"),
]


@pytest.mark.parametrize("qs,ks,vs,match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_shape_errors_name_the_tensors(qs, ks, vs, match):
    with pytest.raises(ValueError, match=match):
        flashmask_attention(torch.randn(qs), torch.randn(ks), torch.randn(vs))


def _fake_cuda(*shape):
    return torch.empty(shape, device="cuda", dtype=torch.bfloat16)


# (FakeTensors give the kernels' address check a data pointer with a deprecation warning)
FAKE_ADDRESS = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")


@FAKE_ADDRESS
@pytest.mark.parametrize("dv,expect", [
    (128, None), (8, None), (256, None),
    (100, r"value head dims that are multiples of 8 up to 256, got Dv=100 \(q and k head dim 192\)"),
    (264, r"got Dv=264"),
])
def test_kernels_check_the_value_head_dim_like_the_query_key_one(dv, expect):
    with FakeTensorMode():  # CUDA tensors without a GPU: only their metadata is read
        reason = _checks.kernel_unsupported_reason(_fake_cuda(1, 8, 2, 192), _fake_cuda(1, 8, 2, 192),
                                                   _fake_cuda(1, 8, 2, dv))
    if expect is None:
        assert reason is None
    else:
        assert reason is not None and re.search(expect, reason), reason


# --- the build's head-dim pairs ---------------------------------------------------------------------------

def test_compiled_pairs_include_the_equal_head_dims():
    pairs = _cuda.compiled_head_dim_pairs()
    assert isinstance(pairs, tuple) and all(len(p) == 2 for p in pairs)
    assert {(d, d) for d in _cuda.compiled_head_dims()} <= set(pairs)
    if _cuda._C is None:
        assert pairs == ()


@pytest.mark.parametrize("dims, pairs, d, dv, expect", [
    ((64, 128), ((64, 64), (128, 128), (192, 128)), 192, 128, None),
    ((64, 128), ((64, 64), (128, 128), (192, 128)), 136, 72, None),  # served by (192, 128)
    ((64, 128, 256), ((64, 64), (128, 128), (256, 256)), 192, 128, None),  # by (256, 256)
    ((64, 128), ((64, 64), (128, 128)), 96, 40, None),
    ((64, 128), ((64, 64), (128, 128)), 192, 128,
     r"this build compiled the \(head_dim, head_dim_v\) pairs \(\(64, 64\), \(128, 128\)\), none of which holds "
     r"q and k head dim 192 with v head dim 128"),
    ((128,), ((128, 128), (192, 128)), 192, 192, r"compiled head dims \(128,\), none of which holds 192"),
    ((128,), ((128, 128), (192, 128)), 128, 192, r"none of which holds q and k head dim 128 with v head dim 192"),
    ((), (), 192, 128, r"pairs \(\), none of which holds"),
])
def test_build_pairs_reason(monkeypatch, dims, pairs, d, dv, expect):
    monkeypatch.setattr(_cuda, "compiled_head_dims", lambda: dims)
    monkeypatch.setattr(_cuda, "compiled_head_dim_pairs", lambda: pairs)
    monkeypatch.setattr(_cuda, "compiled_dtypes", lambda: (torch.bfloat16,))
    reason = _cuda.build_unsupported_reason(torch.empty(1, 4, 2, d, dtype=torch.bfloat16), dv)
    if expect is None:
        assert reason is None
    else:
        assert reason is not None and re.search(expect, reason), reason


@pytest.fixture
def build_without_the_pair(monkeypatch):
    """As on a GPU whose build has the equal pairs 64 and 128 only."""
    monkeypatch.setattr(_cuda, "available", lambda: True)
    monkeypatch.setattr(_cuda, "compiled_head_dims", lambda: (64, 128))
    monkeypatch.setattr(_cuda, "compiled_head_dim_pairs", lambda: ((64, 64), (128, 128)))
    monkeypatch.setattr(_cuda, "compiled_dtypes", lambda: (torch.bfloat16,))
    monkeypatch.setattr(flashmask.attention, "_warned", set())


@FAKE_ADDRESS
def test_backend_cuda_names_both_head_dims(build_without_the_pair):
    with FakeTensorMode():
        q, v = _fake_cuda(1, 8, 2, 192), _fake_cuda(1, 8, 2, 128)
        expect = r"backend='cuda' cannot run: .*q and k head dim 192 with v head dim 128"
        with pytest.raises(RuntimeError, match=expect):
            flashmask_attention(q, q, v, causal=True, backend="cuda")


@FAKE_ADDRESS
def test_auto_falls_back_to_the_reference_path_once_with_a_warning(build_without_the_pair, monkeypatch):
    ran = []

    def reference(q, k, v, mask, causal, softmax_scale):  # stands in for the reference path on fake tensors
        ran.append(softmax_scale)
        return q.new_zeros(*q.shape[:3], v.shape[-1]), q.new_zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(flashmask.attention, "reference_attention", reference)
    with FakeTensorMode():
        q, v = _fake_cuda(1, 8, 2, 192), _fake_cuda(1, 8, 2, 128)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = flashmask_attention(q, q, v, causal=True)
            flashmask_attention(q, q, v, causal=True)
    assert out.shape == (1, 8, 2, 128) and ran == [1 / math.sqrt(192)] * 2
    msgs = [str(w.message) for w in caught if "FakeTensor" not in str(w.message)]
    assert len(msgs) == 1 and "using the reference path" in msgs[0] and "v head dim 128" in msgs[0], msgs


class RecordingExtension:
    """Stands in for _C where only the arguments of the selection functions matter."""

    def __init__(self):
        self.calls = []

    def selected_arch(self, *args):
        self.calls.append(("selected_arch", args))
        return 90

    def archs(self, *args):
        self.calls.append(("archs", args))
        return [80, 90]


def test_selected_arch_and_compiled_archs_pass_the_value_head_dim(monkeypatch):
    ext = RecordingExtension()
    monkeypatch.setattr(_cuda, "_C", ext)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    q = torch.empty(1, 4, 2, 192, dtype=torch.bfloat16)
    assert _cuda.selected_arch(q, 0, "bwd", head_dim_v=128) == 90
    _cuda.selected_arch(q)
    assert _cuda.compiled_archs(192, torch.bfloat16, 128) == (80, 90)
    _cuda.compiled_archs(64, torch.float16)
    assert ext.calls == [("selected_arch", (192, "bfloat16", 90, 0, "bwd", 128)),
                         ("selected_arch", (192, "bfloat16", 90, 0, "fwd", 192)),
                         ("archs", (192, "bfloat16", 128)), ("archs", (64, "float16", 64))]


# --- the custom ops: fake shapes, autograd glue, torch.compile --------------------------------------------

def test_fake_shapes_of_fwd_and_bwd():
    with FakeTensorMode():
        q = torch.empty(2, 9, 8, 192, dtype=torch.bfloat16)
        k = torch.empty(2, 11, 2, 192, dtype=torch.bfloat16)
        v = torch.empty(2, 11, 2, 128, dtype=torch.bfloat16)
        out, lse = torch.ops.flashmask.fwd(q, k, v, None, True, 0.1, False)
        dq, dk, dv, dsinks = torch.ops.flashmask.bwd(out, q, k, v, out, lse, None, None, True, 0.1, False)
    assert out.shape == (2, 9, 8, 128) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 8, 9) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dsinks.shape == (0,)  # no sinks


def _check_kernel_path(attention, seed):
    q, k, v = qkv(2, 19, 23, 4, 2, 24, 8, seed=seed, requires_grad=True)
    mask = random_startend(2, 2, 19, 23, True, 2, generator=torch.Generator().manual_seed(seed))
    out, lse = attention(q, k, v, mask)
    want_out, want_lse = reference_attention(q, k, v, mask, causal=True, softmax_scale=0.3)
    assert out.shape == (2, 19, 4, 8)
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(lse, want_lse, **TIGHT)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(want_out, (q, k, v), dout)
    for name, x, w in zip("qkv", got, want):
        torch.testing.assert_close(x, w, **TIGHT, msg=lambda m: f"d{name}: {m}")


def test_eager_kernel_path_gradients(monkeypatch):
    monkeypatch.setattr(_cuda, "_C", CpuExtension())
    CALLS.clear()
    _check_kernel_path(lambda q, k, v, m: _cuda.attention(q, k, v, m, True, 0.3, False), seed=1)
    assert CALLS == ["fwd", "bwd"]


@pytest.fixture
def cpu_kernels():
    with registered():
        yield


def test_compiled_custom_ops_forward_and_backward(cpu_kernels):
    """torch.compile(fullgraph=True) traces the custom ops with Dqk != Dv (fake shapes) and their
    registered autograd: forward and backward equal the reference path."""
    def f(q, k, v, m):
        return _cuda.attention(q, k, v, m, True, 0.3, False)

    CALLS.clear()
    _check_kernel_path(torch.compile(f, fullgraph=True, backend="aot_eager"), seed=2)
    assert CALLS == ["fwd", "bwd"]  # the ops ran (their fake implementations only traced)


def test_compiled_flashmask_attention_on_the_reference_path():
    q, k, v = qkv(2, 16, 16, 4, 2, 24, 8, dtype=torch.float32, requires_grad=True)
    mask = masks.causal_document(16, [7, 9], batch_size=2)

    def f(q, k, v):
        return flashmask_attention(q, k, v, mask, causal=True)

    want = f(q, k, v)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert got.shape == (2, 16, 4, 8)
    torch.testing.assert_close(got, want)
    dout = torch.randn_like(got)
    for x, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(x, w)


# --- modules ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_attention_module_with_a_value_head_dim(layout):
    q, k, v = qkv(2, 10, 10, 4, 2, 16, 8)
    mask = masks.causal_document(10, [[3, 7], [10]])
    want = flashmask_attention(q, k, v, mask, causal=True)
    m = FlashMaskAttention(causal=True, layout=layout)
    if layout == "bhsd":
        got = m(*(t.transpose(1, 2) for t in (q, k, v)), mask)
        assert got.shape == (2, 4, 10, 8)
        got = got.transpose(1, 2)
    else:
        got = m(q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _rotary(x, pos, base=10000.0):
    d = x.shape[-1]
    freq = base ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    ang = pos.double()[..., None, None] * freq
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)


@pytest.mark.parametrize("rotary", [True, False])
def test_self_attention_with_a_value_head_dim_matches_manual_computation(rotary):
    b, s, e, nh, nkv, hd, hdv = 2, 9, 20, 4, 2, 12, 6
    m = FlashMaskSelfAttention(hidden_size=e, num_heads=nh, num_kv_heads=nkv, head_dim=hd, head_dim_v=hdv,
                               rotary=rotary, bias=True).double()
    assert (m.q_proj.out_features, m.k_proj.out_features, m.v_proj.out_features, m.o_proj.in_features) == \
        (nh * hd, nkv * hd, nkv * hdv, nh * hdv)
    assert m.head_dim_v == hdv
    x = torch.randn(b, s, e, dtype=torch.float64, requires_grad=True)
    pos = torch.stack([torch.cat([torch.arange(4), torch.arange(5)]), torch.arange(9)])
    se = masks.causal_document(s, [[4, 5], [9]])
    y = m(x, se, position_ids=pos)
    lin = lambda layer: x @ layer.weight.T + layer.bias  # noqa: E731
    q, k, v = lin(m.q_proj).view(b, s, nh, hd), lin(m.k_proj).view(b, s, nkv, hd), lin(m.v_proj).view(b, s, nkv, hdv)
    if rotary:
        q, k = _rotary(q, pos), _rotary(k, pos)
    o, _ = naive_attention(q, k, v, dense_from_intervals(se, True, s, s))
    want = o.reshape(b, s, nh * hdv) @ m.o_proj.weight.T + m.o_proj.bias
    torch.testing.assert_close(y, want, **TIGHT)
    dy = torch.randn_like(y)
    params = [x] + list(m.parameters())
    for got, w in zip(torch.autograd.grad(y, params, dy), torch.autograd.grad(want, params, dy)):
        torch.testing.assert_close(got, w, **TIGHT)


def test_self_attention_head_dim_v_defaults_to_head_dim():
    m = FlashMaskSelfAttention(hidden_size=16, num_heads=2)
    assert m.head_dim_v == m.head_dim == 8 and m.v_proj.out_features == 16 and m.o_proj.in_features == 16


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_self_attention_rejects_a_bad_head_dim_v(bad):
    with pytest.raises(ValueError, match=rf"head_dim_v must be a positive int, got {re.escape(repr(bad))}"):
        FlashMaskSelfAttention(hidden_size=16, num_heads=2, head_dim_v=bad)


@FAKE_ADDRESS
def test_context_parallel_step_chooses_as_flashmask_attention(build_without_the_pair):
    # flashmask.distributed's per-rank steps take the rule (and the one warning) of flashmask_attention.
    from flashmask.distributed import _local
    with FakeTensorMode():
        q, v, v64 = _fake_cuda(1, 8, 2, 192), _fake_cuda(1, 8, 2, 128), _fake_cuda(1, 8, 2, 64)
        with pytest.raises(RuntimeError, match=r"backend='sm90' cannot run: .*q and k head dim 192"):
            _local.use_kernels(q, q, v, "sm90")
        with pytest.raises(ValueError, match=r"backend must be one of .*got 'gpu'"):
            _local.use_kernels(q, q, v, "gpu")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _local.use_kernels(q, q, v, "auto") is None
            assert _local.use_kernels(q, q, v, "auto") is None
            assert _local.use_kernels(q, q, v, "reference") is None
        q64 = _fake_cuda(1, 8, 2, 64)
        assert _local.use_kernels(q64, q64, v64, "auto") == 0
        assert _local.use_kernels(q64, q64, v64, "sm90") == 90
    msgs = [str(w.message) for w in caught if "FakeTensor" not in str(w.message)]
    assert len(msgs) == 1 and "using the reference path" in msgs[0] and "v head dim 128" in msgs[0], msgs
