"""Mask values outside [0, Sq] and intervals whose start is past their end, on the reference path.

docs/format.md: values act as if clamped to [0, Sq]; an interval [start, end) with start > end is
empty. The oracle clamps the values first and expands them with the independent
``attn_helpers.dense_from_intervals``; tests/gpu/test_kernel_mask_values.py holds the kernels to the same.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import masks
from flashmask import flashmask_attention
from tests.attn_helpers import dense_from_intervals, naive_attention

MODES = [(True, 1), (True, 2), (False, 2), (False, 4)]
INT32 = torch.iinfo(torch.int32)


def wild_startend(b, hm, sq, sk, c, generator):
    """Values anywhere in [-2 Sq - 3, 2 Sq + 3], in any order, with some int32 extremes."""
    t = torch.randint(-2 * sq - 3, 2 * sq + 4, (b, hm, sk, c), generator=generator, dtype=torch.int32)
    extreme = torch.rand(t.shape, generator=generator) < 0.1
    ends = torch.where(torch.rand(t.shape, generator=generator) < 0.5, INT32.min, INT32.max).to(torch.int32)
    return torch.where(extreme, ends, t)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(MODES), st.integers(1, 12), st.integers(1, 12), st.sampled_from([(1, 1), (2, 1), (4, 2)]),
       st.integers(0, 2**31 - 1))
def test_reference_path_reads_values_as_clamped(mode, sq, sk, heads, seed):
    causal, c = mode
    hq, hk = heads
    g = torch.Generator().manual_seed(seed)
    se = wild_startend(2, hk, sq, sk, c, g)
    q, k, v = (torch.randn(2, s, h, 8, dtype=torch.float64, generator=g).requires_grad_()
               for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    out, lse = flashmask_attention(q, k, v, se, causal=causal, return_lse=True, backend="reference")
    allowed = dense_from_intervals(se.clamp(0, sq), causal, sq, sk)
    ref_out, ref_lse = naive_attention(q, k, v, allowed)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse))
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse.to(lse.dtype), atol=1e-10, rtol=1e-10)
    dout = torch.randn(out.shape, dtype=out.dtype, generator=g)
    got = torch.autograd.grad((out * dout).sum(), (q, k, v))
    want = torch.autograd.grad((ref_out * dout).sum(), (q, k, v))
    for x, y in zip(got, want):
        assert not x.isnan().any()
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("causal,c", MODES)
def test_to_dense_of_wild_values_equals_clamped(causal, c):
    g = torch.Generator().manual_seed(c + 10 * causal)
    se = wild_startend(3, 2, 9, 7, c, g)
    assert torch.equal(masks.to_dense(se, causal, seqlen_q=9), masks.to_dense(se.clamp(0, 9), causal, seqlen_q=9))


def test_start_past_end_is_empty():
    # Causal C=2, Sq = Sk = 4: key 0 has [2, 4); keys 1 and 3 have [3, 1) and [9, 2), both empty, so
    # only the causal triangle hides them; key 2 has [4, 4), empty too.
    se = torch.tensor([[2, 4], [3, 1], [4, 4], [9, 2]], dtype=torch.int32).view(1, 1, 4, 2)
    d = masks.to_dense(se, True)[0, 0]
    assert d.T.tolist() == [[True, True, False, False], [False, True, True, True],
                            [False, False, True, True], [False, False, False, True]]
    # Non-causal C=4: [UTS, UTE) = [5, 1) is empty, [LTS, LTE) = [-4, 2) masks rows 0-1.
    se4 = torch.tensor([[-4, 2, 5, 1]], dtype=torch.int32).view(1, 1, 1, 4)
    assert masks.to_dense(se4, False, seqlen_q=6)[0, 0, :, 0].tolist() == [False, False] + [True] * 4
    with pytest.raises(ValueError, match=r"column 1 \(LTS=3, LTE=1\): each column needs LTS <= LTE"):
        masks.validate(se[:, :, :3], True, 4)
