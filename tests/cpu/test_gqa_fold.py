"""flashmask_attention folds a GQA group's query heads into query rows where no mask, causal bound
or sink tells the rows apart (flashmask.attention.gqa_fold): the kernels' CPU stand-ins see the
folded call, and output, LSE and gradients equal the reference path's on the unfolded one."""
import pytest
import torch

import flashmask.attention as fa
from flashmask import _cuda, flashmask_attention, reference_attention
from tests.cpu_kernels import in_place_of_the_kernels


def qkv(b, sq, sk, hq, hk, d=16, dv=16):
    g = torch.Generator().manual_seed(sq * 131 + hq)
    shapes = ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv))
    return tuple(torch.randn(s, generator=g, dtype=torch.float64).requires_grad_(True) for s in shapes)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The q shapes and causal flags the kernels' op was called with, the stand-ins running it."""
    seen = []
    op = _cuda.attention

    def spy(q, k, v, mask, causal, *rest):
        seen.append((tuple(q.shape), causal))
        return op(q, k, v, mask, causal, *rest)

    monkeypatch.setattr(_cuda, "attention", spy)
    with in_place_of_the_kernels():
        yield seen


@pytest.mark.parametrize("sq,causal,softcap", [(1, True, 0.0), (1, False, 5.0), (3, False, 0.0), (32, False, 0.0)])
def test_folded_call_equals_the_reference(kernel_calls, sq, causal, softcap):
    q, k, v = qkv(2, sq, 37, 8, 2, dv=24)
    out, lse = flashmask_attention(q, k, v, causal=causal, softcap=softcap, return_lse=True)
    assert kernel_calls == [((2, sq * 4, 2, 16), False)]
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal, softcap=softcap)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    assert out.shape == (2, sq, 8, 24) and lse.shape == (2, 8, sq)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))
    ref = torch.autograd.grad((ref_out * dout).sum() + (ref_lse * dlse).sum(), (q, k, v))
    for name, got, want in zip("qkv", grads, ref):
        torch.testing.assert_close(got, want, msg=f"d{name}")


def test_a_transposed_query_folds_too(kernel_calls):
    """The transformers backend hands q as a [B, H, S, D] tensor viewed as BSHD."""
    q, k, v = qkv(1, 1, 20, 6, 2)
    qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2)
    out = flashmask_attention(qt, k, v, causal=True)
    assert kernel_calls == [((1, 3, 2, 16), False)]
    torch.testing.assert_close(out, reference_attention(q, k, v, causal=True)[0])


def test_compiled_folded_call(kernel_calls):
    q, k, v = qkv(1, 1, 20, 4, 1)
    fn = torch.compile(lambda a, b, c: flashmask_attention(a, b, c, causal=True), backend="aot_eager", fullgraph=True)
    out = fn(q, k, v)
    torch.testing.assert_close(out, reference_attention(q, k, v, causal=True)[0])
    out.sum().backward()
    assert q.grad is not None and k.grad is not None


def test_rows_that_differ_are_not_folded(kernel_calls):
    mask = torch.zeros(1, 1, 20, 2, dtype=torch.int32)
    mask[..., 0] = 20
    sinks = torch.zeros(4, dtype=torch.float64)
    q, k, v = qkv(1, 2, 20, 4, 1)
    flashmask_attention(q, k, v, causal=True)  # the causal bound differs between rows
    flashmask_attention(q, k, v, mask, causal=False)  # so may the mask
    flashmask_attention(q, k, v, causal=False, sinks=sinks)  # a sink per head
    flashmask_attention(*qkv(1, 2, 20, 4, 4), causal=False)  # no group
    flashmask_attention(*qkv(1, fa.GQA_FOLD_ROWS // 4 + 1, 20, 4, 1), causal=False)  # past one query tile
    assert [s for s, _ in kernel_calls] == [(1, 2, 4, 16)] * 4 + [(1, fa.GQA_FOLD_ROWS // 4 + 1, 4, 16)]


def test_gqa_fold_choice():
    q1, k = torch.empty(1, 1, 8, 16), torch.empty(1, 50, 2, 16)
    assert fa.gqa_fold(q1, k, None, True, None) == 4
    assert fa.gqa_fold(torch.empty(1, 32, 8, 16), k, None, False, None) == 4
    assert fa.gqa_fold(torch.empty(1, 33, 8, 16), k, None, False, None) == 1
    assert fa.gqa_fold(torch.empty(1, 2, 8, 16), k, None, True, None) == 1
    assert fa.gqa_fold(q1, torch.empty(1, 50, 8, 16), None, True, None) == 1
