"""Unequal head dims (GPU only): q and k of head dim Dqk, v of Dv != Dqk, the output [B, Sq, Hq, Dv]
(DeepSeek's multi-head latent attention: (192, 128)).

Every compiled pair with Dqk != Dv runs, and pairs that only fit a larger compiled pair ((96, 64) on
head dim 96's kernels, (160, 128) on (192, 128)'s, (128, 64) on head dim 128's, where the SM90
kernels take equal head dims only), on the SM80 kernels and on whatever family the device picks:
forward output and LSE, and dQ, dK, dV, against the reference path within the tolerance of
tests/attn_helpers.py. The kernels are called through ``flashmask._cuda.attention`` (the custom
ops' autograd, with the arguments of ``flashmask::fwd``); ``test_public_api`` goes through
``flashmask_attention``.
"""
import random

import pytest
import torch

import flashmask
import masks
from flashmask import _cuda
from flashmask.reference import reference_attention
from masks.examples import example
from tests.attn_helpers import assert_close_to_reference, error_bound, low_precision_attention, max_err, random_startend
from tests.gpu import cases as cuda_cases

pytestmark = pytest.mark.skipif(not _cuda.available() or not hasattr(_cuda._C, "head_dim_pairs"),
                                reason="needs a CUDA device and the built extension with unequal head dims")

MODES = [(True, 1), (True, 2), (False, 2), (False, 4)]
BACKENDS = {"sm80": 80, "cuda": 0}
# Pairs that no instantiation names but a larger compiled pair holds.
FITTING = [(96, 64), (160, 128), (128, 64)]


def _compiled_pairs():
    if not _cuda.available() or not hasattr(_cuda._C, "head_dim_pairs"):
        return []
    return [tuple(p) for p in _cuda._C.head_dim_pairs()]


def _dtypes():
    return [t for t in (torch.float16, torch.bfloat16) if _cuda.available() and t in _cuda.compiled_dtypes()]


def _pairs():
    """Every compiled unequal pair, and each fitting pair that some compiled pair holds."""
    compiled = _compiled_pairs()
    unequal = [p for p in compiled if p[0] != p[1]]
    fitting = [(d, dv) for d, dv in FITTING if any(d <= a and dv <= b for a, b in compiled)]
    return unequal + [p for p in fitting if p not in unequal]


PAIRS = _pairs()
DTYPES = _dtypes()
# The pair the single-pair tests use: (192, 128) where compiled.
MAIN = [p for p in PAIRS if p == (192, 128)][:1] or PAIRS[:1]


def _ids(pair):
    return f"{pair[0]}x{pair[1]}"


def make_qkv(b, sq, sk, hq, hk, d, dv, dtype):
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, dv, device="cuda", dtype=dtype)
    return q, k, v


def poison_allocator(numel):
    """NaN in the caching allocator's free blocks, so that outputs a kernel fails to write show."""
    junk = torch.full((numel * 4 + (1 << 20),), float("nan"), device="cuda")
    del junk


def run(q, k, v, mask, causal, backend, deterministic=False, num_splits=0):
    return _cuda.attention(q, k, v, mask, causal, q.shape[-1] ** -0.5, deterministic, num_splits, BACKENDS[backend])


def grads(fn, q, k, v, dout):
    """Gradients of <out, dout> with respect to q, k, v under fn."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = fn(*leaves)
    return torch.autograd.grad((out.float() * dout.float()).sum(), leaves)


def check_forward(q, k, v, mask, causal, backend, **kw):
    poison_allocator(q.numel() + v.numel())
    out, lse = run(q, k, v, mask, causal, backend, **kw)
    torch.cuda.synchronize()
    assert out.shape == (*q.shape[:3], v.shape[-1])
    assert_close_to_reference(out, lse, q, k, v, mask, causal)
    return out, lse


def check_backward(q, k, v, mask, causal, backend, deterministic=False, dout=None, fn=None):
    """dQ, dK, dV of the kernels (through fn(q, k, v) -> (out, lse) where given) against the reference."""
    cuda_cases.skip_unless_backward_on(BACKENDS[backend], q, v.shape[-1])
    dout = torch.randn(*q.shape[:3], v.shape[-1], device="cuda", dtype=q.dtype) if dout is None else dout
    poison_allocator(q.numel() * 3 + v.numel())
    fn = fn or (lambda a, b, c: run(a, b, c, mask, causal, backend, deterministic))
    got = grads(fn, q, k, v, dout)
    ref = grads(lambda a, b, c: reference_attention(a.float(), b.float(), c.float(), mask, causal=causal),
                q, k, v, dout)
    low = grads(lambda a, b, c: low_precision_attention(a, b, c, mask, causal), q, k, v, dout)
    for name, g, r, lo, t in zip(("dq", "dk", "dv"), got, ref, low, (q, k, v)):
        assert g.shape == t.shape, f"{name} shape {tuple(g.shape)} != {tuple(t.shape)}"
        assert not torch.isnan(g).any(), f"NaN in {name}"
        bound = error_bound(lo, r)
        err = max_err(g, r)
        assert err <= bound, f"{name} error {err:.3e} > bound {bound:.3e}"
    return got


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("causal,c", MODES)
def test_random_masks(backend, dtype, pair, causal, c):
    """Random column intervals, lengths off the tiles with Sq != Sk, GQA, mask heads = Hk."""
    d, dv = pair
    q, k, v = make_qkv(2, 301, 427, 4, 2, d, dv, dtype)
    mask = random_startend(2, 2, 301, 427, causal, c, device="cuda")
    check_forward(q, k, v, mask, causal, backend)
    check_backward(q, k, v, mask, causal, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 300), (300, 17), (129, 1000), (1000, 129)])
def test_no_mask_odd_shapes(backend, pair, causal, sq, sk):
    d, dv = pair
    q, k, v = make_qkv(1, sq, sk, 4, 1, d, dv, DTYPES[-1])
    check_forward(q, k, v, None, causal, backend)
    check_backward(q, k, v, None, causal, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pair", MAIN, ids=_ids)
@pytest.mark.parametrize("hq,hk,hm", [(4, 2, 1), (4, 2, 2), (4, 2, 4), (4, 1, 1), (4, 1, 4), (4, 4, 4)])
def test_gqa_and_mask_heads(backend, dtype, pair, hq, hk, hm):
    causal, c = random.choice(MODES)
    d, dv = pair
    q, k, v = make_qkv(2, 513, 700, hq, hk, d, dv, dtype)
    mask = random_startend(2, hm, 513, 700, causal, c, device="cuda")
    check_forward(q, k, v, mask, causal, backend)
    check_backward(q, k, v, mask, causal, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pair", MAIN, ids=_ids)
@pytest.mark.parametrize("family", sorted(masks.FAMILIES))
def test_mask_families(backend, dtype, pair, family):
    d, dv = pair
    mask, causal = example(family, 1111, batch_size=2, device="cuda")
    q, k, v = make_qkv(2, 1111, 1111, 4, 2, d, dv, dtype)
    check_forward(q, k, v, mask, causal, backend)
    check_backward(q, k, v, mask, causal, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("causal,c", MODES)
def test_deterministic_is_bitwise_stable(backend, pair, causal, c):
    d, dv = pair
    q, k, v = make_qkv(2, 777, 901, 4, 2, d, dv, DTYPES[-1])
    mask = random_startend(2, 2, 777, 901, causal, c, device="cuda")
    dout = torch.randn(2, 777, 4, dv, device="cuda", dtype=q.dtype)
    first = check_backward(q, k, v, mask, causal, backend, deterministic=True, dout=dout)
    second = check_backward(q, k, v, mask, causal, backend, deterministic=True, dout=dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("causal,c", MODES + [(True, None)])
@pytest.mark.parametrize("sq,sk,num_splits", [(1, 4097, 7), (17, 3000, 3), (129, 640, 2), (300, 4097, 16)])
def test_split_kv(backend, pair, causal, c, sq, sk, num_splits):
    """The split-KV partial outputs and their combine run over the value head dim."""
    d, dv = pair
    q, k, v = make_qkv(2, sq, sk, 4, 2, d, dv, DTYPES[-1])
    mask = None if c is None else random_startend(2, 2, sq, sk, causal, c, device="cuda")
    poison_allocator(q.numel() * 64)
    check_forward(q, k, v, mask, causal, backend, num_splits=num_splits)


@pytest.mark.parametrize("pair", MAIN, ids=_ids)
def test_public_api(pair):
    """flashmask_attention with backend="sm80" takes v of another head dim, forward and backward."""
    d, dv = pair
    q, k, v = make_qkv(1, 333, 300, 4, 2, d, dv, DTYPES[-1])
    mask = random_startend(1, 1, 333, 300, True, 2, device="cuda")
    try:
        out, lse = flashmask.flashmask_attention(q, k, v, mask, causal=True, return_lse=True, backend="sm80")
    except ValueError as e:
        if "same shape" in str(e):
            pytest.skip(f"flashmask_attention does not take unequal head dims yet: {e}")
        raise
    assert out.shape == (1, 333, 4, dv)
    assert_close_to_reference(out, lse, q, k, v, mask, True)
    check_backward(q, k, v, mask, True, "sm80", fn=lambda a, b, c: flashmask.flashmask_attention(
        a, b, c, mask, causal=True, return_lse=True, backend="sm80"))


def test_binding_lists_and_selects_pairs():
    """head_dim_pairs() holds every equal head dim and every unequal pair (sorted); archs() and
    selected_arch() take the value head dim as an optional last argument."""
    pairs = _compiled_pairs()
    assert pairs == sorted(set(pairs))
    assert [d for d, dv in pairs if d == dv] == list(_cuda._C.head_dims())
    major, minor = torch.cuda.get_device_capability()
    cc = major * 10 + minor
    dtype = str(DTYPES[-1]).replace("torch.", "")
    for d, dv in pairs:
        assert list(_cuda._C.archs(d, dtype, dv)) == list(_cuda._C.archs(head_dim=d, dtype=dtype, head_dim_v=dv))
        if d == dv:
            assert list(_cuda._C.archs(d, dtype)) == list(_cuda._C.archs(d, dtype, d))
            assert _cuda._C.selected_arch(d, dtype, cc, 0, "fwd") == _cuda._C.selected_arch(d, dtype, cc, 0, "fwd", d)
        else:
            assert 80 in _cuda._C.archs(d, dtype, dv)
            # A build for sm_80 and sm_90 leaves the SM80 kernels out of sm_90 where SM90 ones hold
            # the pair: a call forced onto sm80 then runs there.
            sm80_here = 80 in _cuda._C.device_archs(d, dtype, cc, dv)
            for slot in ("fwd", "bwd_deterministic"):
                assert _cuda._C.selected_arch(d, dtype, cc, 80, slot, dv) == (80 if sm80_here else 90)


@pytest.mark.parametrize("pair", MAIN, ids=_ids)
def test_binding_shape_errors(pair):
    """The binding names the tensor, its shape and the shape expected."""
    d, dv = pair
    q, k, v = make_qkv(1, 64, 80, 2, 1, d, dv, DTYPES[-1])
    scale = d ** -0.5
    with pytest.raises(RuntimeError, match=r"v must be \[B, Sk, Hk, Dv\] with the B, Sk and Hk of k "
                                           rf"\[1, 80, 1, {d}\], got \[1, 79, 1, {dv}\]"):
        _cuda._C.fwd(q, k, v[:, :79].contiguous(), None, True, scale, 0, 80)
    with pytest.raises(RuntimeError, match=rf"k must be \[B, Sk, Hk, D\] with the B and D of q \[1, 64, 2, {d}\]"):
        _cuda._C.fwd(q, v, v, None, True, scale, 0, 80)
    with pytest.raises(RuntimeError, match=r"value head dim \(the last dim of v\) must be a multiple of 8"):
        _cuda._C.fwd(q, k, torch.randn(1, 80, 1, dv + 8, device="cuda", dtype=q.dtype)[..., :dv + 4], None, True,
                     scale, 0, 80)
    out, lse = _cuda._C.fwd(q, k, v, None, True, scale, 0, 80)
    assert out.shape == (1, 64, 2, dv)
    dout = torch.randn_like(out)
    with pytest.raises(RuntimeError, match=rf"dout must be \[B, Sq, Hq, Dv\] .* = \[1, 64, 2, {dv}\], got "
                                           rf"\[1, 64, 2, {d}\]"):
        _cuda._C.bwd(torch.randn_like(q), q, k, v, out, lse, None, None, True, scale, False, 80)
    with pytest.raises(RuntimeError, match=rf"out must be \[B, Sq, Hq, Dv\] .* = \[1, 64, 2, {dv}\]"):
        _cuda._C.bwd(dout, q, k, v, q, lse, None, None, True, scale, False, 80)
    dq, dk, dv_, _ = _cuda._C.bwd(dout, q, k, v, out, lse, None, None, True, scale, False, 80)
    assert dq.shape == q.shape and dk.shape == k.shape and dv_.shape == v.shape


def test_pair_larger_than_every_compiled_one_raises():
    """A value head dim no compiled pair holds raises, naming both dims and the compiled pairs."""
    pairs = _compiled_pairs()
    d = min(d for d, _ in pairs)
    dv = max(b for a, b in pairs if a >= d) + 8
    if dv > 256:
        pytest.skip("every value head dim up to 256 has kernels in this build")
    q, k, v = make_qkv(1, 64, 64, 2, 2, d, dv, DTYPES[-1])
    with pytest.raises(RuntimeError, match=rf"head dims \(q/k {d}, v {dv}\) fit no \(head dim, value head dim\) "
                                           r"pair this build compiled \(\("):
        _cuda._C.fwd(q, k, v, None, True, d ** -0.5, 0, 0)
