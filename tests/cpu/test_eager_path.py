"""_cuda.attention: plain eager calls reach the extension through _EagerAttention, with the custom
ops' gradients; tracing (FakeTensorMode) gets the custom ops. The extension is replaced here by the
reference path, so this runs on CPU."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flashmask import _cuda
from flashmask.reference import reference_attention
from tests.attn_helpers import random_startend


class FakeExtension:
    """_C's fwd and bwd computed by the reference path; records what the backward received."""

    def __init__(self):
        self.calls, self.dlse = [], "unset"

    def fwd(self, q, k, v, mask, causal, scale, num_splits, arch, softcap, sinks):
        self.calls.append("fwd")
        with torch.no_grad():
            out, lse = reference_attention(q, k, v, mask, causal=causal, softmax_scale=scale)
        return [out, lse]

    def bwd(self, dout, q, k, v, out, lse, dlse, mask, causal, scale, deterministic, arch, softcap):
        self.calls.append("bwd")
        self.dlse = dlse
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():  # backward functions run under no_grad
            o, ref_lse = reference_attention(*leaves, mask, causal=causal, softmax_scale=scale)
            loss = (o * dout).sum()
            if dlse is not None:
                loss = loss + (torch.where(torch.isfinite(ref_lse), ref_lse, 0) * dlse).sum()
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        dsum = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # D = rowsum(dO * O) - dlse
        if dlse is not None:
            dsum = dsum - dlse
        return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)] + [dsum]


@pytest.fixture
def ext(monkeypatch):
    e = FakeExtension()
    monkeypatch.setattr(_cuda, "_C", e)
    return e


def inputs(causal=True):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 37, 4, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    return q, k, v, random_startend(2, 1, 37, 37, causal, 2)


def test_eager_gradients_match_the_reference_and_an_unused_lse_sends_none(ext):
    q, k, v, mask = inputs()
    dout = torch.randn(2, 37, 4, 16, dtype=torch.float64)
    out, _ = _cuda.attention(q, k, v, mask, True, 0.25, False)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(reference_attention(q, k, v, mask, causal=True, softmax_scale=0.25)[0], (q, k, v), dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert ext.calls == ["fwd", "bwd"] and ext.dlse is None


def test_a_loss_through_the_lse_alone_gets_a_zero_dout(ext):
    q, k, v, mask = inputs(causal=False)
    _, lse = _cuda.attention(q, k, v, mask, False, 0.25, False)
    got = torch.autograd.grad(lse.sum(), (q, k, v))
    _, ref_lse = reference_attention(q, k, v, mask, causal=False, softmax_scale=0.25)
    want = torch.autograd.grad(ref_lse.sum(), (q, k))
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert torch.count_nonzero(got[2]) == 0 and ext.dlse is not None


def test_no_grad_calls_only_the_forward(ext):
    q, k, v, mask = inputs()
    with torch.no_grad():
        out, lse = _cuda.attention(q, k, v, mask, True, 0.25, False)
    assert ext.calls == ["fwd"] and out.grad_fn is None and lse.shape == (2, 4, 37)


def test_calls_with_nothing_to_differentiate_skip_the_autograd_function(ext, monkeypatch):
    q, k, v, mask = inputs()
    applied = []
    apply = _cuda._EagerAttention.apply
    monkeypatch.setattr(_cuda._EagerAttention, "apply", lambda *args: applied.append(1) or apply(*args))
    with torch.no_grad():
        _cuda.attention(q, k, v, mask, True, 0.25, False)
    out, _ = _cuda.attention(q.detach(), k.detach(), v.detach(), mask, True, 0.25, False)
    assert applied == [] and out.grad_fn is None
    out, _ = _cuda.attention(q.detach(), k, v.detach(), mask, True, 0.25, False)  # one input needs a gradient
    assert applied == [1] and out.grad_fn is not None
    assert ext.calls == ["fwd"] * 3


def test_double_backward_raises(ext):
    q, k, v, mask = inputs()
    out, _ = _cuda.attention(q, k, v, mask, True, 0.25, False)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    torch.testing.assert_close(dq, torch.autograd.grad(out.sum(), q, retain_graph=True)[0], rtol=0, atol=0)
    penalty = dq.pow(2).sum() + q.sum()  # a gradient penalty must not drop the attention silently
    with pytest.raises(RuntimeError, match="no double backward"):
        penalty.backward()


def test_tracing_gets_the_custom_ops(ext):
    q, k, v, mask = inputs()
    with FakeTensorMode() as mode:
        fq, fk, fv, fm = (mode.from_tensor(t) for t in (q, k, v, mask))
        out, lse = _cuda.attention(fq, fk, fv, fm, True, 0.25, False)
    assert ext.calls == []  # the fake implementation answered, not the extension
    assert out.shape == (2, 37, 4, 16) and lse.shape == (2, 4, 37)
