"""Backward kernels against the reference path, deterministic mode and torch.compile (GPU only)."""
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
from tests.gpu.cases import DTYPES, HEAD_DIMS, MODES, TILE_SHAPE_HEAD_DIMS, make_qkv, poison_allocator, run_kernel

pytestmark = [
    pytest.mark.skipif(not _cuda.available(), reason="needs a CUDA device and the built extension with its backward"),
    pytest.mark.usefixtures("every_kernel_family"),
]


def grads(fn, q, k, v, dout, dlse=None):
    """Gradients of <out, dout> (+ <finite lse, dlse>) with respect to q, k, v under fn."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    loss = (out.float() * dout.float()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0).float() * dlse).sum()
    return torch.autograd.grad(loss, leaves)


def assert_deterministic_matches_atomic(q, k, v, mask, causal):
    """Two deterministic backwards are bitwise equal, and equal to the atomic one up to the order of
    the fp32 additions."""
    dout = torch.randn_like(q)

    def run(deterministic):
        return grads(lambda a, b, c: flashmask.flashmask_attention(
            a, b, c, mask, causal=causal, return_lse=True, backend=cuda_cases.BACKEND,
            deterministic=deterministic), q, k, v, dout)

    first, second, atomic = run(True), run(True), run(False)
    for a, b, c in zip(first, second, atomic):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.float(), c.float(), atol=2e-2, rtol=2e-2)


def check_backward(q, k, v, mask, causal, dlse=False, deterministic=False, scale=None, dout=None):
    cuda_cases.skip_unless_backend_serves(q, backward=True)
    dout = torch.randn_like(q) if dout is None else dout
    dl = torch.randn(q.shape[0], q.shape[2], q.shape[1], device="cuda") if dlse else None
    poison_allocator(q.numel() * 3)
    got = grads(lambda a, b, c: flashmask.flashmask_attention(
        a, b, c, mask, causal=causal, softmax_scale=scale, return_lse=True, backend=cuda_cases.BACKEND,
        deterministic=deterministic), q, k, v, dout, dl)
    # float32 reference on the same half-precision inputs, and the half-precision baseline.
    ref = grads(lambda a, b, c: reference_attention(a.float(), b.float(), c.float(), mask, causal=causal,
                                                    softmax_scale=scale), q, k, v, dout, dl)
    low = grads(lambda a, b, c: low_precision_attention(a, b, c, mask, causal, scale), q, k, v, dout, dl)
    for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
        assert not torch.isnan(g).any(), f"NaN in {name}"
        # The scale under the epsilon is floored at 1e-2 for degenerate cases whose exact gradient
        # is 0 (e.g. a single key: dS = P (dP - D) = 0 up to fp32 rounding).
        bound = error_bound(lo, r)
        err = max_err(g, r)
        assert err <= bound, f"{name} error {err:.3e} > bound {bound:.3e}"
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal,c", MODES)
def test_head_dims_random_masks(dtype, d, causal, c):
    q, k, v = make_qkv(2, 300, 300, 4, 2, d, dtype)
    check_backward(q, k, v, random_startend(2, 2, 300, 300, causal, c, device="cuda"), causal)


@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (127, 127), (1000, 1000), (4097, 4097), (17, 1000), (1000, 17),
                                   (127, 4097), (4097, 127)])
@pytest.mark.parametrize("causal,c", MODES + [(True, None), (False, None)])
def test_odd_shapes(sq, sk, causal, c):
    q, k, v = make_qkv(1, sq, sk, 2, 1, 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1], DTYPES[-1])
    mask = None if c is None else random_startend(1, 1, sq, sk, causal, c, device="cuda")
    check_backward(q, k, v, mask, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,hm", [(8, 2, 1), (8, 2, 2), (8, 2, 8), (6, 1, 6), (4, 4, 4)])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_gqa_mask_heads_layouts(dtype, hq, hk, hm, layout):
    causal, c = random.choice(MODES)
    q, k, v = make_qkv(2, 513, 700, hq, hk, 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1], dtype, layout)
    check_backward(q, k, v, random_startend(2, hm, 513, 700, causal, c, device="cuda"), causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(masks.FAMILIES))
def test_mask_families(dtype, family):
    mask, causal = example(family, 1500, batch_size=2, device="cuda")
    q, k, v = make_qkv(2, 1500, 1500, 4, 2, 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1], dtype)
    check_backward(q, k, v, mask, causal)


@pytest.mark.parametrize("causal,c", MODES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_key_blocks_no_interval_reaches(causal, c, deterministic):
    """Key blocks whose columns hold only empty intervals run in the mask-free instantiation and
    the others in the masked one (two launches); every second block of 128 keys is such a block."""
    sq, sk = 700, 1000
    mask = random_startend(1, 2, sq, sk, causal, c, device="cuda")
    empty = {1: [sq], 2: [sq, sq] if causal else [sq, 0], 4: [sq, sq, 0, 0]}[c]
    unreached = (torch.arange(sk, device="cuda") // 128) % 2 == 1
    mask[:, :, unreached] = torch.tensor(empty, dtype=torch.int32, device="cuda")
    q, k, v = make_qkv(1, sq, sk, 4, 2, 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1], DTYPES[-1])
    check_backward(q, k, v, mask, causal, deterministic=deterministic)


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("causal,c", [(True, None), (False, None), (True, 1), (False, 4)])
def test_launch_head_groups(group, causal, c):
    """Launch orders that interleave fewer heads (chosen for long unmasked inputs) compute the same."""
    q, k, v = make_qkv(2, 1000, 1100, 8, 2, 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1], DTYPES[-1])
    mask = None if c is None else random_startend(2, 2, 1000, 1100, causal, c, device="cuda")
    with _cuda._overrides(head_group=group):
        out, lse = run_kernel(q, k, v, mask, causal)
        assert_close_to_reference(out, lse, q, k, v, mask, causal)
        check_backward(q, k, v, mask, causal)


def test_lse_gradient_and_scale():
    q, k, v = make_qkv(1, 400, 333, 4, 2, HEAD_DIMS[0], DTYPES[0])
    check_backward(q, k, v, random_startend(1, 1, 400, 333, False, 4, device="cuda"), False, dlse=True, scale=0.2)


def test_gradient_through_the_lse_alone():
    """A loss that reads only the LSE gives the backward no dO (autograd passes None, not zeros)."""
    q, k, v = make_qkv(1, 300, 257, 4, 2, HEAD_DIMS[-1], DTYPES[-1])
    cuda_cases.skip_unless_backend_serves(q, backward=True)
    mask, dl = random_startend(1, 2, 300, 257, True, 2, device="cuda"), torch.randn(1, 4, 300, device="cuda")

    def lse_grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        lse = fn(*leaves)[1]
        gs = torch.autograd.grad((torch.where(torch.isfinite(lse), lse, 0).float() * dl).sum(), leaves,
                                 allow_unused=True)  # the reference's LSE does not depend on V
        return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, gs)]

    got = lse_grads(lambda a, b, c: flashmask.flashmask_attention(a, b, c, mask, causal=True, return_lse=True,
                                                                  backend=cuda_cases.BACKEND))
    ref = lse_grads(lambda a, b, c: reference_attention(a.float(), b.float(), c.float(), mask, causal=True))
    low = lse_grads(lambda a, b, c: low_precision_attention(a, b, c, mask, True, None))
    for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
        assert max_err(g, r) <= error_bound(lo, r), name
    assert got[2].abs().max() == 0  # dV = P^T dO with dO = 0


@pytest.mark.parametrize("d", [64, 40])
def test_output_at_any_alignment(d):
    """The D kernel reads dO and O in 16-byte pieces where every row allows it and element by
    element otherwise: an O that starts 2 bytes off (a view the backward may be handed) gives the
    gradients of the aligned O, and both agree with the reference."""
    if d not in HEAD_DIMS:
        pytest.skip(f"head dim {d} not built")
    q, k, v = make_qkv(2, 333, 300, 4, 2, d, DTYPES[-1])
    cuda_cases.skip_unless_backend_serves(q, backward=True)
    mask = random_startend(2, 1, 333, 300, True, 2, device="cuda")
    out, lse = flashmask.flashmask_attention(q, k, v, mask, causal=True, return_lse=True, backend=cuda_cases.BACKEND)
    shifted = torch.empty(out.numel() + 1, dtype=out.dtype, device="cuda")[1:].view(out.shape)
    shifted.copy_(out)
    assert shifted.data_ptr() % 16 != 0
    dout = torch.randn_like(q)
    arch = cuda_cases.arch_of(cuda_cases.BACKEND)
    scale = d ** -0.5
    aligned = _cuda.bwd(dout, q, k, v, out, lse, None, mask, True, scale, False, arch)
    off = _cuda.bwd(dout, q, k, v, shifted, lse, None, mask, True, scale, False, arch)
    ref = grads(lambda a, b, c: reference_attention(a.float(), b.float(), c.float(), mask, causal=True), q, k, v, dout)
    low = grads(lambda a, b, c: low_precision_attention(a, b, c, mask, True, None), q, k, v, dout)
    for name, g_al, g_off, r, lo in zip(("dq", "dk", "dv"), aligned, off, ref, low):
        bound = error_bound(lo, r)
        assert max_err(g_al, r) <= bound, f"{name} (aligned O)"
        assert max_err(g_off, r) <= bound, f"{name} (O 2 bytes off)"
        torch.testing.assert_close(g_off.float(), g_al.float(), atol=2e-2 * r.abs().max().item(), rtol=0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_forced_sm80_without_sm90_code_runs_on_sm90(deterministic):
    """A build for sm_80 and sm_90 compiles the SM80 kernels for sm_80 only at the head dims the SM90
    kernels serve: forced onto sm80 there, the forward and the backward run the SM90 kernels (never
    the empty sm_90 bodies of the SM80 ones), and give the reference's gradients."""
    if cuda_cases.BACKEND != cuda_cases.KERNEL_BACKENDS[-1]:
        pytest.skip("runs once, with the last backend")
    major, minor = torch.cuda.get_device_capability()
    cc, dtype = major * 10 + minor, DTYPES[-1]
    dims = [d for d in _cuda.compiled_head_dims() if 80 not in _cuda.device_archs(d, dtype, cc)]
    if not dims:
        pytest.skip("this build runs the SM80 kernels at every head dim on this device")
    slot = "bwd_deterministic" if deterministic else "bwd"
    for d in dims:
        q, k, v = make_qkv(1, 300, 257, 4, 2, d, dtype)
        assert _cuda.selected_arch(q, 80, slot) == _cuda.selected_arch(q, 0, slot) != 80, d
        assert _cuda.selected_arch(q, 80) == _cuda.selected_arch(q, 0) != 80, d
        mask, dout = random_startend(1, 2, 300, 257, True, 2, device="cuda"), torch.randn_like(q)
        poison_allocator(q.numel() * 3)
        got = grads(lambda a, b, c: flashmask.flashmask_attention(
            a, b, c, mask, causal=True, return_lse=True, backend="sm80", deterministic=deterministic), q, k, v, dout)
        ref = grads(lambda a, b, c: reference_attention(a.float(), b.float(), c.float(), mask, causal=True),
                    q, k, v, dout)
        low = grads(lambda a, b, c: low_precision_attention(a, b, c, mask, True, None), q, k, v, dout)
        for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
            assert max_err(g, r) <= error_bound(lo, r), f"{name} at head dim {d}"


def test_fully_masked_rows_have_zero_gradients():
    sq = sk = 700
    mask = torch.stack([torch.full((1, 1, sk), sq), torch.full((1, 1, sk), 300)], -1).int().cuda()
    q, k, v = make_qkv(1, sq, sk, 2, 2, HEAD_DIMS[-1], DTYPES[-1])
    dq, dk, dv = check_backward(q, k, v, mask, False)
    assert (dq[:, :300] == 0).all()


@pytest.mark.parametrize("causal,c", MODES)
def test_deterministic_is_bitwise_stable(causal, c):
    q, k, v = make_qkv(2, 1111, 1111, 4, 2, 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1], DTYPES[-1])
    mask = random_startend(2, 2, 1111, 1111, causal, c, device="cuda")
    dout = torch.randn_like(q)
    runs = [check_backward(q, k, v, mask, causal, deterministic=True, dout=dout) for _ in range(3)]
    for later in runs[1:]:
        for a, b in zip(runs[0], later):
            assert torch.equal(a, b)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("sq,sk,hm", [(333, 517, 1), (517, 333, 2), (700, 700, 6)])
def test_head_dims_odd_shapes_gqa_mask_heads(d, sq, sk, hm):
    """Every head dim off the tiles, Sq != Sk, GQA 6/2 and mask heads 1, Hk and Hq, with every C
    form; the deterministic backward bitwise equal across two runs at each head dim."""
    causal, c = MODES[(sq + hm + d) % len(MODES)]
    q, k, v = make_qkv(2, sq, sk, 6, 2, d, DTYPES[-1])
    cuda_cases.skip_unless_backend_serves(q, backward=True)
    mask = random_startend(2, hm, sq, sk, causal, c, device="cuda")
    check_backward(q, k, v, mask, causal)
    dout = torch.randn_like(q)
    first, second = (check_backward(q, k, v, mask, causal, deterministic=True, dout=dout) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# The backward's tile shapes at TILE_SHAPE_HEAD_DIMS: 64, three dQ warps; 96 and 128, two, each
# warpgroup 64 keys; 192 and 256, the warpgroups share 64 keys and split the head dim.
@pytest.mark.parametrize("d", TILE_SHAPE_HEAD_DIMS)
@pytest.mark.parametrize("family", sorted(masks.FAMILIES))
def test_deterministic_every_family(family, d):
    """Each query block's dQ additions follow the key blocks that see it (the SM90 kernel hands the
    turn from one such key block to the next, skipping the others): right, and bitwise equal across
    three runs, on every family and head dim at a length off the tiles with GQA."""
    mask, causal = example(family, 2900, batch_size=2, device="cuda")
    q, k, v = make_qkv(2, 2900, 2900, 6, 2, d, DTYPES[-1])
    dout = torch.randn_like(q)
    first = check_backward(q, k, v, mask, causal, deterministic=True, dout=dout)
    for _ in range(2):
        again = grads(lambda a, b, c: flashmask.flashmask_attention(
            a, b, c, mask, causal=causal, return_lse=True, backend=cuda_cases.BACKEND, deterministic=True),
            q, k, v, dout)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"


def test_deterministic_across_waves_of_ctas():
    """Many more key-block CTAs than SMs per head (the SM90 deterministic dQ hands each query block
    from key block to key block): bitwise equal across runs, and equal to the atomic backward up to
    the order of the fp32 additions."""
    d = 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1]
    q, k, v = make_qkv(1, 8192, 8192, 8, 4, d, DTYPES[-1])
    cuda_cases.skip_unless_backend_serves(q, backward=True)
    mask, causal = example("causal_document", 8192, device="cuda")
    assert_deterministic_matches_atomic(q, k, v, mask, causal)


@pytest.mark.parametrize("family", ["full", "global_sliding_window", "causal_document"])
def test_deterministic_long_keys_job_list(family):
    """From 32768 keys (kTurnListKeys) the SM90 deterministic backward takes its jobs from a list
    whose head grouping the mask decides on the device (long walks: few heads at a time; short ones:
    all heads): each head's key blocks must still start in ascending order, or a dQ turn would wait
    for a job not yet drawn. Bitwise equal across runs, equal to the atomic backward up to the order
    of the fp32 additions, off the tiles and with GQA."""
    s = 65536 + 77
    q, k, v = make_qkv(1, s, s, 8, 2, 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1], DTYPES[-1])
    cuda_cases.skip_unless_backend_serves(q, backward=True)
    mask, causal = example(family, s, device="cuda")
    assert_deterministic_matches_atomic(q, k, v, mask, causal)


def test_torch_compile_fullgraph():
    q, k, v = make_qkv(2, 600, 600, 4, 2, 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1], DTYPES[-1])
    mask, causal = example("causal_document", 600, batch_size=2, device="cuda")

    def f(a, b, c):
        return flashmask.flashmask_attention(a, b, c, mask, causal=causal, backend="cuda").float().square().sum()

    compiled = torch.compile(f, fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    loss = compiled(*leaves)
    loss.backward()
    eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    loss_e = f(*eager)
    loss_e.backward()
    torch.testing.assert_close(loss, loss_e)
    for a, b in zip(leaves, eager):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("sq,causal,softcap", [(1, True, 0.0), (1, False, 30.0), (7, False, 0.0), (32, False, 0.0)])
def test_gqa_group_folded_into_rows(sq, causal, softcap):
    """Short queries without a mask (decoding): flashmask_attention runs a GQA group's heads as query
    rows of one head (flashmask.attention.gqa_fold), forward and backward against the reference."""
    q, k, v = make_qkv(2, sq, 3000, 8, 2, cuda_cases.main_head_dim(), DTYPES[-1])
    cuda_cases.skip_unless_backend_serves(q, backward=True)
    assert flashmask.attention.gqa_fold(q, k, None, causal, None) == 4
    dout = torch.randn_like(q)
    poison_allocator(q.numel() * 64)
    out, lse = flashmask.flashmask_attention(q, k, v, causal=causal, softcap=softcap, return_lse=True,
                                             backend=cuda_cases.BACKEND)
    assert_close_to_reference(out, lse, q, k, v, None, causal, softcap=softcap)
    got = grads(lambda a, b, c: flashmask.flashmask_attention(
        a, b, c, causal=causal, softcap=softcap, return_lse=True, backend=cuda_cases.BACKEND), q, k, v, dout)
    ref = grads(lambda a, b, c: reference_attention(a.float(), b.float(), c.float(), None, causal=causal,
                                                    softcap=softcap), q, k, v, dout)
    low = grads(lambda a, b, c: low_precision_attention(a, b, c, None, causal, None, softcap=softcap), q, k, v, dout)
    for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
        assert max_err(g, r) <= error_bound(lo, r), name
