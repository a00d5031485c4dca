"""The kernels read out-of-range mask values as the reference path does (GPU only).

docs/format.md: values outside [0, Sq] act as if clamped to it, and an interval whose start is past
its end is empty; the kernels must agree with the reference path on such values and never read out
of bounds. tests/cpu/test_mask_values.py checks the reference path itself against a clamped oracle on
the CPU. Every call here forces ``backend="cuda"``, so a fallback to the reference path raises.
"""
import pytest
import torch

import flashmask
from flashmask import _cuda
from flashmask.reference import reference_attention
from tests.attn_helpers import assert_close_to_reference, error_bound, low_precision_attention, max_err

pytestmark = pytest.mark.skipif(not _cuda.available(),
                                reason="needs a CUDA device and the built extension with its backward")

MODES = [(True, 1), (True, 2), (False, 2), (False, 4)]
# Lengths that are not multiples of any tile size, with Sq < Sk, Sq = Sk and Sq > Sk.
SHAPES = [(257, 257), (200, 333), (333, 190)]
INT32 = torch.iinfo(torch.int32)


def _dtype():
    return next((t for t in (torch.bfloat16, torch.float16) if t in _cuda.compiled_dtypes()), torch.bfloat16)


def _head_dims():
    dims = _cuda.compiled_head_dims()
    return [d for d in (64, 128) if dims and d <= max(dims)] or [max(dims or (64,))]


def wild_startend(b, hm, sq, sk, c, kind, generator):
    """int32 ``[b, hm, sk, c]`` with values outside [0, Sq] and starts past their ends.

    ``scattered``: every value drawn from [-2 Sq, 2 Sq] or an int32 extreme, in any order.
    ``blocky``: one value per 64 keys and vector, from {INT32_MIN, -5, 0, Sq, Sq + 7, INT32_MAX}, so
    that whole tiles are classified (skipped, partial, unmasked) from out-of-range bounds.
    """
    shape = (b, hm, sk, c)
    if kind == "scattered":
        t = torch.randint(-2 * sq, 2 * sq + 1, shape, generator=generator, dtype=torch.int64)
        extreme = torch.rand(shape, generator=generator) < 0.1
        ends = torch.where(torch.rand(shape, generator=generator) < 0.5, INT32.min, INT32.max)
        return torch.where(extreme, ends, t).to(torch.int32)
    choices = torch.tensor([INT32.min, -5, 0, sq, sq + 7, INT32.max], dtype=torch.int64)
    nblocks = (sk + 63) // 64
    pick = torch.randint(0, len(choices), (b, hm, nblocks, c), generator=generator)
    return choices[pick].repeat_interleave(64, dim=2)[:, :, :sk].to(torch.int32)


def _poison(numel):
    # NaN in the caching allocator's free blocks: an output element the kernel fails to write shows.
    junk = torch.full((numel * 4 + (1 << 20),), float("nan"), device="cuda")
    del junk


def _grads(fn, q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = fn(*leaves)
    return torch.autograd.grad((out.float() * dout.float()).sum(), leaves)


@pytest.mark.parametrize("kind", ["scattered", "blocky"])
@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("causal,c", MODES)
@pytest.mark.parametrize("d", _head_dims())
def test_forward_matches_reference_on_out_of_range_values(d, causal, c, sq, sk, kind):
    g = torch.Generator().manual_seed(sq * 7 + sk + c + 100 * causal + d)
    mask = wild_startend(2, 2, sq, sk, c, kind, g).cuda()
    q, k, v = (torch.randn(2, s, h, d, device="cuda", dtype=_dtype()) for s, h in ((sq, 4), (sk, 2), (sk, 2)))
    _poison(q.numel())
    out, lse = flashmask.flashmask_attention(q, k, v, mask, causal=causal, return_lse=True, backend="cuda")
    torch.cuda.synchronize()
    assert_close_to_reference(out, lse, q, k, v, mask, causal)
    # Clamping the values first changes nothing (up to the order of the kernels' rounding).
    out2 = flashmask.flashmask_attention(q, k, v, mask.clamp(0, sq), causal=causal, backend="cuda")
    torch.testing.assert_close(out, out2, atol=2e-2, rtol=0)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kind", ["scattered", "blocky"])
@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("causal,c", MODES)
def test_backward_matches_reference_on_out_of_range_values(causal, c, sq, sk, kind, deterministic):
    d = _head_dims()[-1]
    g = torch.Generator().manual_seed(sq * 5 + sk + c + 10 * causal)
    mask = wild_startend(2, 2, sq, sk, c, kind, g).cuda()
    q, k, v = (torch.randn(2, s, h, d, device="cuda", dtype=_dtype()) for s, h in ((sq, 4), (sk, 2), (sk, 2)))
    dout = torch.randn_like(q)
    _poison(q.numel() * 3)
    got = _grads(lambda a, b, e: flashmask.flashmask_attention(
        a, b, e, mask, causal=causal, return_lse=True, backend="cuda", deterministic=deterministic), q, k, v, dout)
    ref = _grads(lambda a, b, e: reference_attention(a.float(), b.float(), e.float(), mask, causal=causal),
                 q, k, v, dout)
    low = _grads(lambda a, b, e: low_precision_attention(a, b, e, mask, causal), q, k, v, dout)
    for name, x, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
        assert not torch.isnan(x).any(), f"NaN in {name}"
        bound = error_bound(lo, r)
        err = max_err(x, r)
        assert err <= bound, f"{name} error {err:.3e} > bound {bound:.3e}"
