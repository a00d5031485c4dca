"""flash-attn's ``flash_attn_varlen_func`` / ``flash_attn_func`` on the kernels (GPU only): packed
documents of their own query and key lengths (the non-causal C=2 mask of ``masks.from_cu_seqlens_qk``,
whose rule the CPU tests check document by document), equal documents (the causal C=1 mask), windows,
GQA; output, LSE and gradients against the float32 reference within the tolerance rule of
tests/attn_helpers.py. ``backend="cuda"``: a fallback to the reference path raises."""
import pytest
import torch

import masks
from flashmask import _cuda
from flashmask.flash_attn import flash_attn_func, flash_attn_varlen_func
from flashmask.reference import reference_attention
from tests.attn_helpers import assert_close_to_reference, error_bound, low_precision_attention, max_err
from tests.gpu.cases import DTYPES, main_head_dim, pick

pytestmark = pytest.mark.skipif(not _cuda.available(), reason="needs a CUDA device and the built extension")

# (query lengths, key lengths): equal documents off the tiles, keys past the queries (a cache),
# queries past the keys, an empty document of each kind
CASES = [([700, 333, 990], [700, 333, 990]), ([100, 517, 1], [900, 517, 300]), ([640, 129], [200, 129]),
         ([300, 0, 257], [300, 211, 0])]


def grads(fn, leaves, dout):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    return torch.autograd.grad((fn(*leaves).float() * dout.float()).sum(), leaves)


@pytest.mark.parametrize("window", [(-1, -1), (96, 0), (200, 50)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lens", CASES)
def test_varlen_on_the_kernels(lens, causal, window):
    i = CASES.index(lens)
    dtype, d = pick(DTYPES, i), main_head_dim()
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for x in lens)
    q = torch.randn(int(cu_q[-1]), 6, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(int(cu_k[-1]), 2, d, device="cuda", dtype=dtype) for _ in range(2))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens[0]), max(lens[1]), causal=causal,
                                         window_size=window, return_attn_probs=True, backend="cuda")
    mask = masks.from_cu_seqlens_qk(cu_q, cu_k, causal, window)  # the rule; flash_attn may take a compact form
    assert_close_to_reference(out[None], lse[None], q[None], k[None], v[None], mask, False)
    dout = torch.randn_like(out)
    got = grads(lambda a, b, c: flash_attn_varlen_func(a, b, c, cu_q, cu_k, 990, 990, causal=causal,
                                                       window_size=window, backend="cuda"), (q, k, v), dout)
    ref = grads(lambda a, b, c: reference_attention(a[None].float(), b[None].float(), c[None].float(), mask,
                                                    causal=False)[0][0], (q, k, v), dout)
    low = grads(lambda a, b, c: low_precision_attention(a[None], b[None], c[None], mask, False)[0][0], (q, k, v), dout)
    for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
        assert max_err(g, r) <= error_bound(lo, r), f"{name} error {max_err(g, r):.3e} > {error_bound(lo, r):.3e}"


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_func_on_the_kernels(causal):
    dtype, d = pick(DTYPES, int(causal)), main_head_dim()
    q = torch.randn(2, 500, 4, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 777, 2, d, device="cuda", dtype=dtype) for _ in range(2))
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=(128, 16), return_attn_probs=True,
                                  backend="cuda")
    mask = masks.window_to_startend((128, 16), 500, 777, causal, batch_size=2, device="cuda")
    assert_close_to_reference(out, lse, q, k, v, mask, causal)
