"""A value head dim of its own on the GPU, through the Python API: q and k ``[.., Dqk]``, v ``[.., Dv]``
(DeepSeek's MLA: 192 and 128) on the kernels of each family, against the float32 reference path
with the tolerance rule of tests/attn_helpers.py (outputs, LSE and gradients); torch.compile; the
modules; context parallelism on one process. Pairs that this build has no kernel for are skipped
(a build serves (Dqk, Dv) with the smallest compiled pair that holds both).
"""
import pytest
import torch

import flashmask
import masks
from flashmask import FlashMaskSelfAttention, _cuda
from flashmask import distributed as fmd
from flashmask.reference import reference_attention
from masks.examples import example
from tests.attn_helpers import assert_close_to_reference, error_bound, low_precision_attention, max_err, random_startend
from tests.gpu import cases as cuda_cases
from tests.gpu.cases import DTYPES, MODES, poison_allocator

pytestmark = [
    pytest.mark.skipif(not _cuda.available(), reason="needs a CUDA device and the built extension"),
    pytest.mark.usefixtures("every_kernel_family"),
]

# (Dqk, Dv): DeepSeek-V2/V3, one that rounds up to it, and value head dims below the query/key one
PAIRS = [(192, 128), (184, 120), (128, 64), (64, 32)]


def serving_pair(d, dv):
    """The compiled (head_dim, head_dim_v) pair that serves (d, dv), or None."""
    held = [p for p in _cuda.compiled_head_dim_pairs() if d <= p[0] and dv <= p[1]]
    return min(held, default=None)


def skip_unless_served(d, dv, dtype):
    pair = serving_pair(d, dv)
    if pair is None or dtype not in _cuda.compiled_dtypes():
        pytest.skip(f"this build has no kernel for head dims ({d}, {dv}), {dtype}: "
                    f"{_cuda.compiled_head_dim_pairs()}")
    arch = _cuda.ARCHS.get(cuda_cases.BACKEND, 0)
    if arch and arch not in _cuda.compiled_archs(pair[0], dtype, pair[1]):
        pytest.skip(f"{cuda_cases.BACKEND} has no kernel for head dims {pair}, {dtype}")


def make_qkv(b, sq, sk, hq, hk, d, dv, dtype):
    return tuple(torch.randn(b, s, h, x, device="cuda", dtype=dtype)
                 for s, h, x in ((sq, hq, d), (sk, hk, d), (sk, hk, dv)))


def grads(fn, q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = fn(*leaves)
    return torch.autograd.grad((out.float() * dout.float()).sum(), leaves)


def check_forward_backward(q, k, v, mask, causal, scale=None):
    d, dv = q.shape[-1], v.shape[-1]
    skip_unless_served(d, dv, q.dtype)
    cuda_cases.skip_unless_backward_on(_cuda.ARCHS.get(cuda_cases.BACKEND, 0), q, dv)
    poison_allocator(q.numel() * 3)

    def kernels(a, b, c):
        return flashmask.flashmask_attention(a, b, c, mask, causal=causal, softmax_scale=scale, return_lse=True,
                                             backend=cuda_cases.BACKEND)

    out, lse = kernels(q, k, v)
    torch.cuda.synchronize()
    assert out.shape == (*q.shape[:3], dv) and out.dtype == q.dtype
    assert_close_to_reference(out, lse, q, k, v, mask, causal, scale)
    dout = torch.randn_like(out)
    poison_allocator(q.numel() * 3)
    got = grads(kernels, q, k, v, dout)
    ref = grads(lambda a, b, c: reference_attention(a.float(), b.float(), c.float(), mask, causal=causal,
                                                    softmax_scale=scale), q, k, v, dout)
    low = grads(lambda a, b, c: low_precision_attention(a, b, c, mask, causal, scale), q, k, v, dout)
    for name, g, r, lo, t in zip(("dq", "dk", "dv"), got, ref, low, (q, k, v)):
        assert g.shape == t.shape, name
        assert not torch.isnan(g).any(), f"NaN in {name}"
        bound, err = error_bound(lo, r), max_err(g, r)
        assert err <= bound, f"{name} error {err:.3e} > bound {bound:.3e} (head dims {d}, {dv})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,dv", PAIRS)
@pytest.mark.parametrize("causal,c", MODES)
def test_random_masks_gqa(dtype, d, dv, causal, c):
    q, k, v = make_qkv(2, 300, 300, 4, 2, d, dv, dtype)
    check_forward_backward(q, k, v, random_startend(2, 2, 300, 300, causal, c, device="cuda"), causal)


@pytest.mark.parametrize("d,dv", PAIRS[:2])
@pytest.mark.parametrize("sq,sk", [(257, 513), (513, 257), (1, 300)])
def test_unequal_lengths_and_no_mask(d, dv, sq, sk):
    q, k, v = make_qkv(1, sq, sk, 4, 1, d, dv, DTYPES[-1])
    check_forward_backward(q, k, v, None, True, scale=0.07)
    check_forward_backward(q, k, v, random_startend(1, 4, sq, sk, False, 4, device="cuda"), False)


@pytest.mark.parametrize("family", ["causal_document", "share_question", "sliding_window", "global_sliding_window"])
def test_families(family):
    mask, causal = example(family, 1024, batch_size=1, device="cuda")
    q, k, v = make_qkv(1, 1024, 1024, 8, 8, 192, 128, DTYPES[-1])
    check_forward_backward(q, k, v, mask, causal)


def test_transposed_views():
    """[B, H, S, D] tensors viewed as BSHD, v with its own head dim: no copy, same result."""
    skip_unless_served(192, 128, DTYPES[-1])
    q, k, v = (torch.randn(2, h, 200, x, device="cuda", dtype=DTYPES[-1]).transpose(1, 2)
               for h, x in ((4, 192), (2, 192), (2, 128)))
    mask = masks.causal_document(200, [[80, 120], [200]], device="cuda")
    got = flashmask.flashmask_attention(q, k, v, mask, causal=True, backend=cuda_cases.BACKEND)
    want = flashmask.flashmask_attention(*(t.contiguous() for t in (q, k, v)), mask, causal=True,
                                         backend=cuda_cases.BACKEND)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_value_head_dim_the_kernels_cannot_take_raises_with_backend_cuda(monkeypatch):
    monkeypatch.setattr(flashmask.attention, "_warned", set())  # it warns once per reason and process
    q, k = (torch.randn(1, 16, 2, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, 16, 2, 264, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"backend='cuda' cannot run: .*value head dims .* got Dv=264"):
        flashmask.flashmask_attention(q, k, v, causal=True, backend="cuda")
    with pytest.warns(UserWarning, match="value head dims .* got Dv=264"):
        out = flashmask.flashmask_attention(q, k, v, causal=True)  # auto: the reference path
    assert out.shape == (1, 16, 2, 264)


def test_torch_compile_fullgraph():
    skip_unless_served(192, 128, DTYPES[-1])
    q, k, v = make_qkv(2, 600, 600, 4, 2, 192, 128, DTYPES[-1])
    mask, causal = example("causal_document", 600, batch_size=2, device="cuda")

    def f(a, b, c):
        out = flashmask.flashmask_attention(a, b, c, mask, causal=causal, backend=cuda_cases.BACKEND)
        return out, out.float().square().sum()

    compiled = torch.compile(f, fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, loss = compiled(*leaves)
    assert out.shape == (2, 600, 4, 128)
    loss.backward()
    eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out_e, loss_e = f(*eager)
    loss_e.backward()
    torch.testing.assert_close(out, out_e)
    torch.testing.assert_close(loss, loss_e)
    for a, b in zip(leaves, eager):
        assert a.grad.shape == a.shape
        torch.testing.assert_close(a.grad, b.grad, atol=2e-2, rtol=2e-2)


def test_self_attention_module():
    """FlashMaskSelfAttention(head_dim=192, head_dim_v=128) on the kernels against the same module on
    the reference path (float32 weights and inputs of the same bf16 values)."""
    dtype = DTYPES[-1]
    skip_unless_served(192, 128, dtype)
    torch.manual_seed(0)
    m = FlashMaskSelfAttention(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=192, head_dim_v=128,
                               backend=cuda_cases.BACKEND).to("cuda", dtype)
    ref = FlashMaskSelfAttention(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=192, head_dim_v=128,
                                 backend="reference").to("cuda")
    ref.load_state_dict({n: p.float() for n, p in m.state_dict().items()})
    x = torch.randn(2, 300, 256, device="cuda", dtype=dtype)
    mask = masks.causal_document(300, [[100, 200], [300]], device="cuda")
    pos = torch.stack([torch.cat([torch.arange(100), torch.arange(200)]), torch.arange(300)]).cuda()
    got, want = m(x, mask, position_ids=pos), ref(x.float(), mask, position_ids=pos)
    assert got.shape == (2, 300, 256)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("mode", ["allgather_kv", "ulysses"])
def test_context_parallel_one_process(mode):
    """Both context-parallel modes on one process: the kernels' forward and backward ops with Dv."""
    dtype = DTYPES[-1]
    skip_unless_served(192, 128, dtype)
    mask, causal = example("causal_document", 1024, batch_size=1, device="cuda")
    q, k, v = make_qkv(1, 1024, 1024, 4, 2, 192, 128, dtype)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = flashmask.flashmask_attention(*leaves, mask, causal=causal, backend=cuda_cases.BACKEND)
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, dout)
    plan = fmd.make_plan(mask, causal, mode=mode)
    local = [plan.shard(t).detach().requires_grad_() for t in (q, k, v)]
    got = fmd.context_parallel_attention(*local, plan, backend=cuda_cases.BACKEND)
    assert got.shape == (1, 1024, 4, 128)
    torch.testing.assert_close(got, plan.shard(want), atol=2e-2, rtol=2e-2)
    for name, g, w in zip("qkv", torch.autograd.grad(got, local, plan.shard(dout)), want_grads):
        torch.testing.assert_close(g.float(), plan.shard(w).float(), atol=5e-2, rtol=5e-2,
                                   msg=lambda m: f"d{name}: {m}")
