"""``flashmask_attention`` on CPU: backends, every input check, window_size, strides, defaults."""
from __future__ import annotations

import doctest
import math
import re
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashmask
import masks
from flashmask import flashmask_attention, reference_attention
from tests.attn_helpers import (
    TIGHT,
    check_matches,
    dense_from_intervals,
    dense_window,
    naive_attention,
    random_startend,
)

MODES = [(True, 1), (True, 2), (False, 2), (False, 4)]
HYP = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _qkv(b=1, sq=8, sk=8, hq=2, hk=1, d=4, dtype=torch.float64, requires_grad=False):
    ts = [torch.randn(b, s, h, d, dtype=torch.float64).to(dtype) for s, h in ((sq, hq), (sk, hk), (sk, hk))]
    return [t.requires_grad_(requires_grad) for t in ts]


# --- backends -----------------------------------------------------------------------------------

@settings(max_examples=30, **HYP)
@given(st.sampled_from(MODES), st.integers(1, 2), st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
       st.integers(1, 20), st.integers(1, 20), st.sampled_from(["auto", "reference"]), st.data())
def test_cpu_matches_reference_and_oracle(mode, b, heads, sq, sk, backend, data):
    causal, c = mode
    hq, hk = heads
    hm = data.draw(st.sampled_from(sorted({1, hk, hq})))
    se = random_startend(b, hm, sq, sk, causal, c)
    q, k, v = _qkv(b, sq, sk, hq, hk, 8)
    out, lse = flashmask_attention(q, k, v, se, causal=causal, return_lse=True, backend=backend, validate=True)
    ref = reference_attention(q, k, v, se, causal=causal)
    check_matches(out, lse, *ref, atol=0, rtol=0)
    check_matches(out, lse, *naive_attention(q, k, v, dense_from_intervals(se, causal, sq, sk)))


def test_cpu_auto_does_not_warn():
    q, k, v = _qkv(dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flashmask_attention(q, k, v, causal=True)


def test_backend_cuda_on_cpu_raises():
    q, k, v = _qkv(dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"backend='cuda' cannot run: .*(CUDA|cuda)"):
        flashmask_attention(q, k, v, causal=True, backend="cuda")


@pytest.mark.parametrize("backend", ["sm80", "sm90"])
def test_forced_architecture_on_cpu_raises(backend):
    """Forcing a kernel family is a CUDA backend: it never falls back to the reference path."""
    q, k, v = _qkv(dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=rf"backend='{backend}' cannot run"):
        flashmask_attention(q, k, v, causal=True, backend=backend)


def test_selected_arch_rejects_unknown_slot():
    from flashmask import _cuda
    with pytest.raises(ValueError, match="slot must be 'fwd', 'bwd' or 'bwd_deterministic', got 'bwd_dq'"):
        _cuda.selected_arch(torch.empty(1, 4, 2, 64), 0, "bwd_dq")


@pytest.mark.parametrize("dims, dtypes, d, dtype, expect", [
    ((64, 128), (torch.bfloat16,), 128, torch.bfloat16, None),
    ((64, 128), (torch.bfloat16,), 40, torch.bfloat16, None),  # served by the 64 kernel
    ((64,), (torch.bfloat16,), 128, torch.bfloat16, r"compiled head dims \(64,\), none of which holds 128"),
    ((), (), 64, torch.float16, r"compiled head dims \(\), none of which holds 64"),
    ((64, 128), (torch.bfloat16,), 64, torch.float16, r"not torch.float16 .*FLASHMASK_DTYPES"),
])
def test_build_subset_reason(monkeypatch, dims, dtypes, d, dtype, expect):
    """A build with a subset of head dims or dtypes says so (the kernels are never called)."""
    from flashmask import _cuda
    monkeypatch.setattr(_cuda, "compiled_head_dims", lambda: dims)
    monkeypatch.setattr(_cuda, "compiled_head_dim_pairs", lambda: tuple((d, d) for d in dims))
    monkeypatch.setattr(_cuda, "compiled_dtypes", lambda: dtypes)
    reason = _cuda.build_unsupported_reason(torch.empty(1, 4, 2, d, dtype=dtype))
    if expect is None:
        assert reason is None
    else:
        assert reason is not None and re.search(expect, reason), reason


@pytest.mark.parametrize("backend", ["bogus", "CUDA", "", None])
def test_unknown_backend_raises(backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"backend must be one of .*'auto'.*got"):
        flashmask_attention(q, k, v, backend=backend)


def test_gradients_through_the_api_match_oracle():
    se = masks.causal_document(9, [[4, 5], [2, 7]])
    q, k, v = _qkv(2, 9, 9, 4, 2, 5, requires_grad=True)
    dout, dlse = torch.randn(2, 9, 4, 5, dtype=torch.float64), torch.randn(2, 4, 9, dtype=torch.float64)
    out, lse = flashmask_attention(q, k, v, se, causal=True, return_lse=True, deterministic=True)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))
    ro, rl = naive_attention(q, k, v, dense_from_intervals(se, True, 9, 9))
    want = torch.autograd.grad((ro * dout).sum() + (rl * dlse).sum(), (q, k, v))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, **TIGHT)


def test_zero_length_keys():
    """Sk = 0: either a clear error from the checks, or every row empty (out 0, LSE +inf)."""
    q, k, v = _qkv(1, 4, 0, 2, 1, 4)
    try:
        out, lse = flashmask_attention(q, k, v, return_lse=True)
    except ValueError as e:
        assert "k" in str(e) and ("length" in str(e) or "empty" in str(e) or "Sk" in str(e)), str(e)
    else:
        assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()


# --- return values and defaults -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_return_lse_shape_and_dtype(dtype):
    q, k, v = _qkv(2, 7, 5, 6, 3, 8, dtype=dtype)
    out = flashmask_attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 7, 6, 8) and out.dtype == dtype
    res = flashmask_attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(res, tuple) and len(res) == 2
    out2, lse = res
    assert torch.equal(out2, out)
    assert lse.shape == (2, 6, 7) and lse.dtype == torch.float32
    assert torch.isposinf(lse[:, :, :2]).all() and torch.isfinite(lse[:, :, 2:]).all()  # Sq > Sk causal


def test_softmax_scale_default_is_inverse_sqrt_d():
    d = 9
    q, k, v = _qkv(1, 6, 6, 2, 2, d)
    q = q * 3  # make the scale matter
    default = flashmask_attention(q, k, v, causal=True, return_lse=True)
    explicit = flashmask_attention(q, k, v, causal=True, return_lse=True, softmax_scale=1 / math.sqrt(d))
    check_matches(*default, *explicit, atol=0, rtol=0)
    allowed = dense_from_intervals(None, True, 6, 6)
    check_matches(*default, *naive_attention(q, k, v, allowed, 1 / math.sqrt(d)))
    other = flashmask_attention(q, k, v, causal=True, softmax_scale=1.0)
    assert not torch.allclose(other, default[0])
    torch.testing.assert_close(other, naive_attention(q, k, v, allowed, 1.0)[0], **TIGHT)


def test_deterministic_flag_on_cpu():
    q, k, v = _qkv(1, 6, 6, 2, 1, 4)
    a = flashmask_attention(q, k, v, causal=True, deterministic=True)
    b = flashmask_attention(q, k, v, causal=True, deterministic=False)
    assert torch.equal(a, b)


# --- strides --------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal,c", MODES)
def test_transposed_bhsd_views(causal, c):
    b, hq, hk, sq, sk, d = 2, 4, 2, 11, 13, 8
    qh, kh, vh = (torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True)
                  for h, s in ((hq, sq), (hk, sk), (hk, sk)))
    q, k, v = (t.transpose(1, 2) for t in (qh, kh, vh))  # [B, S, H, D] views, no copy
    assert not any(t.is_contiguous() for t in (q, k, v)) and all(t.stride(-1) == 1 for t in (q, k, v))
    assert q.data_ptr() == qh.data_ptr()
    se = random_startend(b, hk, sq, sk, causal, c)
    out, lse = flashmask_attention(q, k, v, se, causal=causal, return_lse=True)
    qc, kc, vc = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    out_c, lse_c = flashmask_attention(qc, kc, vc, se, causal=causal, return_lse=True)
    check_matches(out, lse, out_c.detach(), lse_c.detach(), atol=1e-12, rtol=1e-12)
    check_matches(out, lse, *naive_attention(qc, kc, vc, dense_from_intervals(se, causal, sq, sk)))
    g = torch.randn_like(out_c)
    (out * g).sum().backward()
    (out_c * g).sum().backward()
    for th, tc in ((qh, qc), (kh, kc), (vh, vc)):
        assert th.grad.shape == th.shape
        torch.testing.assert_close(th.grad.transpose(1, 2), tc.grad, atol=1e-12, rtol=1e-12)


def test_other_strided_views():
    """Strides are free apart from the last dimension: a slice of a wider tensor works."""
    big = torch.randn(2, 10, 3, 12, dtype=torch.float64)
    q, k, v = big[..., :4], big[:, :, :1, 4:8], big[:, :, :1, 8:]
    out = flashmask_attention(q, k, v, causal=True)
    want = naive_attention(q.contiguous(), k.contiguous(), v.contiguous(), dense_from_intervals(None, True, 10, 10))
    torch.testing.assert_close(out, want[0], **TIGHT)


# --- window_size ----------------------------------------------------------------------------------

@settings(max_examples=40, **HYP)
@given(st.integers(1, 24), st.integers(1, 24), st.integers(-1, 8), st.integers(-1, 8), st.booleans(),
       st.sampled_from([(1, 1), (2, 1), (2, 2)]))
def test_window_size_matches_dense_definition(sq, sk, left, right, causal, heads):
    hq, hk = heads
    q, k, v = _qkv(2, sq, sk, hq, hk, 4)
    out, lse = flashmask_attention(q, k, v, causal=causal, window_size=(left, right), return_lse=True)
    check_matches(out, lse, *naive_attention(q, k, v, dense_window(sq, sk, (left, right), causal)))


def test_window_size_unbounded_is_no_window():
    q, k, v = _qkv(1, 7, 9, 2, 1, 4)
    for causal in (True, False):
        a = flashmask_attention(q, k, v, causal=causal, window_size=(-1, -1), return_lse=True)
        b = flashmask_attention(q, k, v, causal=causal, return_lse=True)
        check_matches(*a, *b, atol=0, rtol=0)


@settings(max_examples=30, **HYP)
@given(st.integers(2, 24), st.integers(-1, 6), st.integers(-1, 6), st.booleans(), st.data())
def test_window_size_merged_with_document_masks(s, left, right, causal, data):
    """window_size on top of a causal_document (causal) / document (non-causal) mask: the intersection."""
    lens = [[data.draw(st.integers(1, s))] for _ in range(2)]
    lens = [x if x[0] == s else x + [s - x[0]] for x in lens]
    se = (masks.causal_document if causal else masks.document)(s, lens)
    q, k, v = _qkv(2, s, s, 2, 1, 4)
    out, lse = flashmask_attention(q, k, v, se, causal=causal, window_size=(left, right), return_lse=True)
    allowed = dense_from_intervals(se, causal, s, s) & dense_window(s, s, (left, right), causal)
    check_matches(out, lse, *naive_attention(q, k, v, allowed))


@settings(max_examples=40, **HYP)
@given(st.sampled_from(MODES), st.integers(1, 16), st.integers(1, 16), st.integers(-1, 5), st.integers(-1, 5),
       st.sampled_from([1, 2]))
def test_window_size_merged_with_random_masks(mode, sq, sk, left, right, hm):
    """Any mask + window: the intersection, or (C=2 causal / C=4 only) a ValueError when the union of
    masked rows does not fit the format."""
    causal, c = mode
    se = random_startend(2, hm, sq, sk, causal, c)
    q, k, v = _qkv(2, sq, sk, 2, 2, 4)
    try:
        out, lse = flashmask_attention(q, k, v, se, causal=causal, window_size=(left, right), return_lse=True)
    except ValueError as e:
        assert (causal, c) in ((True, 2), (False, 4)), f"C={c} causal={causal} always fits: {e}"
        assert "window" in str(e), str(e)
        return
    allowed = dense_from_intervals(se, causal, sq, sk) & dense_window(sq, sk, (left, right), causal)
    check_matches(out, lse, *naive_attention(q, k, v, allowed))


@pytest.mark.parametrize("window", [(-2, 0), (0, -3), (1,), (1, 2, 3), (1.5, 0), "ab"])
def test_bad_window_size_raises(window):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"window_size must be a pair"):
        flashmask_attention(q, k, v, causal=True, window_size=window)


# --- input checks ---------------------------------------------------------------------------------

def _good(**over):
    """Valid arguments (B=2, Sq=6, Sk=5, Hq=4, Hk=2, D=8, causal C=1 mask) with some replaced."""
    args = dict(q=torch.randn(2, 6, 4, 8), k=torch.randn(2, 5, 2, 8), v=torch.randn(2, 5, 2, 8),
                startend_row_indices=torch.full((2, 1, 5, 1), 6, dtype=torch.int32), causal=True)
    args.update(over)
    return args


def _call(args, **kw):
    a = dict(args)
    return flashmask_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("startend_row_indices"), **a, **kw)


def test_good_arguments_pass():
    out = _call(_good(), validate=True)
    assert out.shape == (2, 6, 4, 8)


QKV_ERRORS = [
    ("q 3-d", dict(q=torch.randn(2, 6, 32)), ValueError,
     r"q must have 4 dimensions \[B, S, H, D\], got shape \(2, 6, 32\)"),
    ("k 5-d", dict(k=torch.randn(2, 5, 2, 8, 1)), ValueError, r"k must have 4 dimensions"),
    ("v 3-d", dict(v=torch.randn(5, 2, 8)), ValueError, r"v must have 4 dimensions"),
    ("q int", dict(q=torch.ones(2, 6, 4, 8, dtype=torch.int32)), TypeError,
     r"q must be a floating-point tensor, got torch.int32"),
    ("v bool", dict(v=torch.ones(2, 5, 2, 8, dtype=torch.bool)), TypeError, r"v must be a floating-point"),
    ("q not tensor", dict(q=[[1.0]]), TypeError, r"q must be a torch.Tensor, got list"),
    ("mixed dtypes", dict(k=torch.randn(2, 5, 2, 8, dtype=torch.float64)), TypeError,
     r"q, k and v must share a dtype, got torch.float32, torch.float64, torch.float32"),
    ("mixed half", dict(q=torch.randn(2, 6, 4, 8, dtype=torch.float16), k=torch.randn(2, 5, 2, 8, dtype=torch.float16)),
     TypeError, r"share a dtype"),
    ("k/v heads", dict(v=torch.randn(2, 5, 1, 16)), ValueError,
     r"k and v must have the same shape \[B, Sk, Hk\] .*got k \(2, 5, 2, 8\) and v \(2, 5, 1, 16\)"),
    ("k/v length", dict(v=torch.randn(2, 4, 2, 8)), ValueError, r"k and v must have the same shape"),
    ("k/v batch", dict(v=torch.randn(1, 5, 2, 8)), ValueError, r"k and v must have the same shape"),
    ("batch", dict(q=torch.randn(3, 6, 4, 8)), ValueError, r"q has batch 3 but k and v have batch 2"),
    ("head dim", dict(q=torch.randn(2, 6, 4, 16)), ValueError,
     r"q and k must share the head dim Dqk: q has head dim 16 but k has head dim 8"),
    ("head ratio", dict(q=torch.randn(2, 6, 3, 8)), ValueError,
     r"number of query heads \(3\) must be a multiple of the number of key/value heads \(2\)"),
    ("device", dict(k=torch.randn(2, 5, 2, 8, device="meta"), v=torch.randn(2, 5, 2, 8, device="meta")),
     ValueError, r"q, k and v must be on one device"),
]


@pytest.mark.parametrize("over,exc,match", [e[1:] for e in QKV_ERRORS], ids=[e[0] for e in QKV_ERRORS])
def test_qkv_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        _call(_good(**over))


def _se(shape, fill=0, dtype=torch.int32):
    return torch.full(shape, fill, dtype=dtype)


MASK_ERRORS = [
    ("int64", dict(startend_row_indices=_se((2, 1, 5, 1), 6, torch.int64)),
     r"startend_row_indices must be torch.int32, got torch.int64"),
    ("float", dict(startend_row_indices=_se((2, 1, 5, 1), 6, torch.float32)),
     r"must be torch.int32, got torch.float32"),
    ("rank 3", dict(startend_row_indices=_se((2, 5, 1), 6)),
     r"startend_row_indices must have 4 dimensions \[B, Hm, Sk, C\], got shape \(2, 5, 1\)"),
    ("rank 5", dict(startend_row_indices=_se((2, 1, 5, 1, 1), 6)), r"must have 4 dimensions"),
    ("C=4 causal", dict(startend_row_indices=_se((2, 1, 5, 4), 6)), r"C=4 columns .* causal=True needs C=1 or 2"),
    ("C=1 non-causal", dict(startend_row_indices=_se((2, 1, 5, 1), 6), causal=False),
     r"C=1 columns .* causal=False needs C=2 or 4"),
    ("C=3 causal", dict(startend_row_indices=_se((2, 1, 5, 3), 6)), r"C=3 columns .* causal=True needs C=1 or 2"),
    ("C=3 non-causal", dict(startend_row_indices=_se((2, 1, 5, 3), 6), causal=False),
     r"C=3 columns .* causal=False needs C=2 or 4"),
    ("mask batch", dict(startend_row_indices=_se((3, 1, 5, 1), 6)),
     r"startend_row_indices has batch 3 but the inputs have batch 2"),
    ("mask heads 3", dict(startend_row_indices=_se((2, 3, 5, 1), 6)),
     r"has 3 mask heads; it must be one of \[1, 2, 4\]"),
    ("mask heads 8", dict(startend_row_indices=_se((2, 8, 5, 1), 6)), r"has 8 mask heads"),
    ("mask Sk", dict(startend_row_indices=_se((2, 1, 6, 1), 6)),
     r"startend_row_indices has Sk=6 columns but the keys have length 5"),
]


@pytest.mark.parametrize("over,match", [e[1:] for e in MASK_ERRORS], ids=[e[0] for e in MASK_ERRORS])
@pytest.mark.parametrize("validate", [False, True])
def test_mask_errors(over, match, validate):
    """Shape, dtype and mode errors are raised whether or not values are validated."""
    with pytest.raises(ValueError, match=match):
        _call(_good(**over), validate=validate)


def test_mask_device_mismatch():
    # A meta tensor stands in for a mask on another device (validate=False: a meta tensor has no values).
    with pytest.raises(ValueError, match=r"startend_row_indices is on meta but q is on cpu"):
        _call(_good(startend_row_indices=_se((2, 1, 5, 1), 6).to("meta")))


def _bad_value(c, causal, b, h, j, col, value, hm=2):
    """A valid mask (B=2, Hm=hm, Sk=5, Sq=6) with startend[b, h, j, col] = value."""
    if causal:
        base = [6] if c == 1 else [6, 6]
    else:
        base = [6, 0] if c == 2 else [6, 6, 0, 0]
    se = torch.tensor(base, dtype=torch.int32).expand(2, hm, 5, c).clone()
    se[b, h, j, col] = value
    return _good(startend_row_indices=se, causal=causal)


VALUE_ERRORS = [
    # (C, causal, b, h, j, col, value, message)
    (1, True, 1, 0, 3, 0, 7, r"batch 1, head 0, column 3 \(LTS=7\): values must lie in \[0, Sq=6\]"),
    (1, True, 0, 1, 0, 0, -1, r"batch 0, head 1, column 0 \(LTS=-1\): values must lie in \[0, Sq=6\]"),
    (2, True, 1, 1, 4, 1, 100, r"batch 1, head 1, column 4 \(LTS=6, LTE=100\): values must lie in \[0, Sq=6\]"),
    (2, False, 0, 0, 2, 1, -5, r"batch 0, head 0, column 2 \(LTS=6, UTE=-5\): values must lie in \[0, Sq=6\]"),
    (4, False, 1, 0, 1, 3, 9, r"batch 1, head 0, column 1 \(LTS=6, LTE=6, UTS=0, UTE=9\): values must lie"),
    (2, True, 0, 1, 2, 1, 3, r"batch 0, head 1, column 2 \(LTS=6, LTE=3\): each column needs LTS <= LTE"),
    (4, False, 1, 1, 3, 1, 2,
     r"batch 1, head 1, column 3 \(LTS=6, LTE=2, UTS=0, UTE=0\): each column needs LTS <= LTE"),
    (4, False, 0, 0, 4, 2, 5,
     r"batch 0, head 0, column 4 \(LTS=6, LTE=6, UTS=5, UTE=0\): each column needs UTS <= UTE"),
]


@pytest.mark.parametrize("c,causal,b,h,j,col,value,match", VALUE_ERRORS)
def test_validate_value_errors(c, causal, b, h, j, col, value, match):
    args = _bad_value(c, causal, b, h, j, col, value)
    with pytest.raises(ValueError, match=r"startend_row_indices is invalid at " + match):
        _call(args, validate=True)


def test_validate_names_the_first_bad_column():
    args = _bad_value(1, True, 1, 1, 2, 0, 8)
    args["startend_row_indices"][1, 1, 4, 0] = -3
    args["startend_row_indices"][0, 1, 3, 0] = 99  # the first one in (batch, head, column) order
    with pytest.raises(ValueError, match=r"at batch 0, head 1, column 3 \(LTS=99\)"):
        _call(args, validate=True)


@pytest.mark.parametrize("causal,c", MODES)
def test_out_of_range_values_without_validate_act_as_clamped(c, causal):
    """validate=False (the default) never reads out of bounds: values outside [0, Sq] behave as the
    nearest bound would (rows >= -3 are all rows, rows < 99 are all rows)."""
    sq, sk = 6, 5
    se = random_startend(2, 2, sq, sk, causal, c)
    while not ((se == 0) | (se == sq)).any():  # about 1 draw in 250 (causal, C=1) has no value to push out
        se = random_startend(2, 2, sq, sk, causal, c)
    noise = torch.randint(-20, 21, se.shape, dtype=torch.int32)
    wild = torch.where(se == 0, se - noise.abs(), torch.where(se == sq, se + noise.abs(), se))
    assert (wild < 0).any() or (wild > sq).any()
    q, k, v = _qkv(2, sq, sk, 4, 2, 8)
    out, lse = flashmask_attention(q, k, v, wild, causal=causal, return_lse=True)
    check_matches(out, lse, *naive_attention(q, k, v, dense_from_intervals(se, causal, sq, sk)))
    with pytest.raises(ValueError, match="values must lie in"):
        flashmask_attention(q, k, v, wild, causal=causal, validate=True)


def test_checks_run_before_window_merge():
    """A bad mask is reported as such even when a window is given."""
    q, k, v = _qkv(1, 6, 5, 2, 1, 4)
    with pytest.raises(ValueError, match=r"C=4 columns"):
        flashmask_attention(q, k, v, _se((1, 1, 5, 4), 6), causal=True, window_size=(2, 0))


# --- docs -------------------------------------------------------------------------------------------

def test_docstring_examples_of_attention_module():
    """The examples in flashmask/attention.py run as written."""
    import flashmask.attention as mod
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert res.attempted > 0
    assert res.failed == 0, f"{res.failed} docstring example(s) of flashmask/attention.py fail"


def test_public_api_exports():
    assert flashmask.flashmask_attention is flashmask_attention
    assert flashmask.reference_attention is reference_attention
    for name in flashmask.__all__:
        assert hasattr(flashmask, name), name


def test_window_mask_has_one_row_per_sample(monkeypatch):
    # The kernels index the mask by batch without broadcasting, so a mask built from window_size
    # alone must have B rows, not 1.
    import flashmask.attention as attention
    seen = {}

    def spy(q, k, v, startend_row_indices=None, **kw):
        seen["mask"] = startend_row_indices
        return reference_attention(q, k, v, startend_row_indices, **kw)

    monkeypatch.setattr(attention, "reference_attention", spy)
    q, k, v = (torch.randn(3, 20, 2, 8) for _ in range(3))
    attention.flashmask_attention(q, k, v, causal=True, window_size=(4, 0))
    assert seen["mask"].shape[0] == 3


@pytest.mark.parametrize("scale, exc, match", [
    (float("nan"), ValueError,
     r"softmax_scale must be a finite float > 0 \(or None for 1 / sqrt\(head dim\)\), got nan"),
    (float("inf"), ValueError, r"softmax_scale must be a finite float > 0 .*got inf"),
    (0.0, ValueError, r"softmax_scale must be a finite float > 0 .*got 0\.0"),
    (-0.5, ValueError, r"softmax_scale must be a finite float > 0 .*got -0\.5"),
    ("abc", TypeError, r"softmax_scale must be a finite float > 0 .*got str 'abc'"),
    (True, TypeError, r"softmax_scale must be a finite float > 0 .*got bool True"),
    (torch.ones(2), TypeError, r"softmax_scale must be a finite float > 0 .*got Tensor"),
])
def test_softmax_scale_must_be_finite_and_positive(scale, exc, match):
    with pytest.raises(exc, match=match):
        _call(_good(), softmax_scale=scale)


def test_softmax_scale_takes_ints_and_one_element_tensors():
    args = _good()
    want = _call(args, softmax_scale=2.0)
    assert torch.equal(_call(args, softmax_scale=2), want)
    assert torch.equal(_call(args, softmax_scale=torch.tensor(2.0)), want)


def test_head_dim_zero_is_an_error_not_a_division_by_zero():
    q, k, v = torch.randn(1, 4, 2, 0), torch.randn(1, 4, 2, 0), torch.randn(1, 4, 2, 0)
    with pytest.raises(ValueError, match=r"the head dim D of q, k and v must be >= 1, got D=0"):
        flashmask_attention(q, k, v, causal=True)
