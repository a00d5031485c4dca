"""Degenerate inputs: empty sequences keep autograd working; ``causal`` must be a bool."""
import pytest
import torch

from flashmask import FlashMaskAttention, flashmask_attention


@pytest.mark.parametrize("sq,sk", [(0, 5), (5, 0), (0, 0)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_sequences_backward_gives_zero_grads(sq, sk, causal, dtype):
    q = torch.randn(2, sq, 4, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(2, sk, 2, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(2, sk, 2, 8, dtype=dtype, requires_grad=True)
    out, lse = flashmask_attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (2, sq, 4, 8) and out.dtype == dtype and lse.shape == (2, 4, sq)
    assert out.requires_grad and lse.requires_grad
    assert (out == 0).all() and torch.isposinf(lse).all()
    (out.float().sum() + torch.where(torch.isinf(lse), 0, lse).sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all()


def test_empty_keys_with_a_mask_tensor():
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    k = v = torch.randn(1, 0, 2, 8, requires_grad=True)
    mask = torch.zeros(1, 1, 0, 1, dtype=torch.int32)
    flashmask_attention(q, k, v, mask, causal=True).sum().backward()
    assert (q.grad == 0).all()


@pytest.mark.parametrize("bad", ["yes", "False", 1, 0, None, torch.tensor(True)])
def test_causal_must_be_a_bool(bad):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flashmask_attention(q, q, q, causal=bad)
    with pytest.raises(TypeError, match="causal must be a bool"):
        FlashMaskAttention(causal=bad)
