"""Forward kernel against the reference path (GPU only; skipped without CUDA or without the build)."""
import os
import random
import subprocess
import sys

import pytest
import torch

import flashmask
import masks
from flashmask import _cuda
from masks.examples import example
from tests import ROOT
from tests.attn_helpers import assert_close_to_reference, random_startend
from tests.gpu import cases as cuda_cases
from tests.gpu.cases import (
    DTYPES,
    HEAD_DIMS,
    MODES,
    TILE_SHAPE_HEAD_DIMS,
    arch_of,
    main_head_dim,
    make_qkv,
    poison_allocator,
    run_kernel,
)

pytestmark = [
    pytest.mark.skipif(not _cuda.available(), reason="needs a CUDA device and the built extension"),
    pytest.mark.usefixtures("every_kernel_family"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal,c", MODES)
def test_head_dims_random_masks(dtype, d, causal, c):
    q, k, v = make_qkv(2, 300, 300, 4, 2, d, dtype)
    mask = random_startend(2, 2, 300, 300, causal, c, device="cuda")
    out, lse = run_kernel(q, k, v, mask, causal)
    assert_close_to_reference(out, lse, q, k, v, mask, causal)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("sq,sk,hm", [(333, 517, 1), (517, 333, 2), (700, 700, 6)])
def test_head_dims_odd_shapes_gqa_mask_heads(d, sq, sk, hm):
    """Every head dim (each on its own tiles: 96-key blocks at 192, 64-key at 256) off the tiles, Sq != Sk, GQA 6/2
    and mask heads 1, Hk and Hq, with every C form."""
    causal, c = MODES[(sq + hm + d) % len(MODES)]
    q, k, v = make_qkv(2, sq, sk, 6, 2, d, DTYPES[-1])
    mask = random_startend(2, hm, sq, sk, causal, c, device="cuda")
    out, lse = run_kernel(q, k, v, mask, causal)
    assert_close_to_reference(out, lse, q, k, v, mask, causal)


SIZES = [1, 17, 127, 1000, 4097]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk", [(s, s) for s in SIZES]
                         + [(17, 1000), (1000, 17), (127, 4097), (4097, 127), (1, 4097)])
@pytest.mark.parametrize("causal,c", MODES + [(True, None), (False, None)])
def test_odd_shapes(dtype, sq, sk, causal, c):
    d = max(HEAD_DIMS, key=lambda x: x == 128)
    q, k, v = make_qkv(1, sq, sk, 2, 1, d, dtype)
    mask = None if c is None else random_startend(1, 1, sq, sk, causal, c, device="cuda")
    out, lse = run_kernel(q, k, v, mask, causal)
    assert_close_to_reference(out, lse, q, k, v, mask, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,hm", [(8, 8, 1), (8, 2, 1), (8, 2, 2), (8, 2, 8), (6, 1, 6), (6, 1, 1)])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_gqa_mask_heads_layouts(dtype, hq, hk, hm, layout):
    causal, c = random.choice(MODES)
    q, k, v = make_qkv(3, 513, 700, hq, hk, 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1], dtype, layout)
    mask = random_startend(3, hm, 513, 700, causal, c, device="cuda")
    out, lse = run_kernel(q, k, v, mask, causal)
    assert_close_to_reference(out, lse, q, k, v, mask, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(getattr(masks, "FAMILIES", {})))
def test_mask_families(dtype, family):
    startend, causal = example(family, 1500, batch_size=2, device="cuda")
    q, k, v = make_qkv(2, 1500, 1500, 4, 2, 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1], dtype)
    out, lse = run_kernel(q, k, v, startend, causal)
    assert_close_to_reference(out, lse, q, k, v, startend, causal)


# The forward's tile shapes at TILE_SHAPE_HEAD_DIMS: 64, 192-row tiles, three warpgroups; 96 and
# 128, pingpong on 128 x 128; 192, 96-key blocks; 256, 64-key blocks.
@pytest.mark.parametrize("d", TILE_SHAPE_HEAD_DIMS)
@pytest.mark.parametrize("family", sorted(masks.FAMILIES))
def test_mask_families_repeatable(family, d):
    """Every family at each forward tile shape, off the tiles with GQA: right, and bitwise equal
    across runs (no block's mask columns or K/V stage may be overwritten while still read). Back to
    back forwards hid a producer race that the runs with a backward between them show."""
    mask, causal = example(family, 2900, batch_size=2, device="cuda")
    q, k, v = make_qkv(2, 2900, 2900, 6, 2, d, DTYPES[-1])
    out, lse = run_kernel(q, k, v, mask, causal)
    assert_close_to_reference(out, lse, q, k, v, mask, causal)
    for backward in (False, False, True, True, True):
        leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
        again, again_lse = flashmask.flashmask_attention(*leaves, mask, causal=causal, return_lse=True,
                                                         backend=cuda_cases.BACKEND)
        if backward:
            again.float().sum().backward()
        torch.cuda.synchronize()
        assert torch.equal(out, again.detach()) and torch.equal(lse, again_lse.detach()), \
            "the forward differs between runs"


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_and_blocks(dtype):
    # Rows 0..299 see nothing (every key masked for them); whole tiles are skipped.
    sq = sk = 700
    lts = torch.full((1, 1, sk), sq, dtype=torch.int32)
    ute = torch.full((1, 1, sk), 300, dtype=torch.int32)
    mask = torch.stack([lts, ute], -1).cuda()
    q, k, v = make_qkv(1, sq, sk, 2, 2, cuda_cases.main_head_dim(), dtype)
    out, lse = run_kernel(q, k, v, mask, False)
    assert torch.isinf(lse[:, :, :300]).all() and (lse[:, :, :300] > 0).all()
    assert (out[:, :300] == 0).all()
    assert_close_to_reference(out, lse, q, k, v, mask, False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_more_queries_than_keys(dtype):
    # Bottom-right alignment: the first Sq - Sk rows see no key.
    q, k, v = make_qkv(1, 333, 100, 2, 2, 64 if 64 in HEAD_DIMS else HEAD_DIMS[0], dtype)
    out, lse = run_kernel(q, k, v, None, True)
    assert torch.isinf(lse[:, :, :233]).all()
    assert_close_to_reference(out, lse, q, k, v, None, True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_of_range_values_are_clamped_semantics(dtype):
    # Values outside [0, Sq] never make the kernel read out of bounds; they mean what the
    # comparisons say, exactly as on the reference path.
    sq = sk = 257
    mask = torch.randint(-50, sq + 50, (1, 1, sk, 4), dtype=torch.int32, device="cuda")
    q, k, v = make_qkv(1, sq, sk, 2, 2, HEAD_DIMS[0], dtype)
    out, lse = run_kernel(q, k, v, mask, False)
    assert_close_to_reference(out, lse, q, k, v, mask, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("rising", [True, False])
@pytest.mark.parametrize("causal,c", [(True, None), (False, 2), (True, 1)])
def test_row_max_moving_across_key_blocks(dtype, d, rising, causal, c):
    """Keys scaled by a ramp over their positions: each row's running max grows block after block,
    by small and by large factors (around 2^7 a block), in both walk directions, with the rows of one warp
    moving at different blocks: the online softmax's rescaling of O and of the row sums, and its lazy
    rescale (a row keeps its max while a block's rises above it by at most 2^8)."""
    sq, sk = 700, 1500
    q, k, v = make_qkv(1, sq, sk, 4, 2, d, dtype)
    ramp = torch.linspace(1.0, 12.0, sk, device="cuda")
    ramp = ramp if rising else ramp.flip(0)
    k = (k.float() * ramp[None, :, None, None]).to(dtype)
    q = (q.float() * torch.rand(1, sq, 4, 1, device="cuda") * 2).to(dtype)
    mask = None if c is None else random_startend(1, 2, sq, sk, causal, c, device="cuda")
    out, lse = run_kernel(q, k, v, mask, causal)
    assert_close_to_reference(out, lse, q, k, v, mask, causal)


def test_softmax_scale_and_determinism():
    dtype = DTYPES[0]
    q, k, v = make_qkv(1, 600, 600, 2, 2, HEAD_DIMS[0], dtype)
    mask = random_startend(1, 1, 600, 600, True, 2, device="cuda")
    out1, lse1 = run_kernel(q, k, v, mask, True, softmax_scale=0.3)
    out2, lse2 = run_kernel(q, k, v, mask, True, softmax_scale=0.3)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    assert_close_to_reference(out1, lse1, q, k, v, mask, True, scale=0.3)


@pytest.mark.parametrize("causal,c", MODES + [(True, None), (False, None)])
@pytest.mark.parametrize("sq,sk", [(1, 4097), (17, 3000), (300, 4097), (129, 640)])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16])
def test_split_kv(causal, c, sq, sk, num_splits):
    # Flash-Decoding: each query tile's key blocks shared among num_splits CTAs, merged by LSE.
    q, k, v = make_qkv(2, sq, sk, 4, 2, 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1], DTYPES[-1])
    mask = None if c is None else random_startend(2, 2, sq, sk, causal, c, device="cuda")
    cuda_cases.skip_unless_backend_serves(q)
    poison_allocator(q.numel() * 64)
    out, lse = _cuda.fwd(q, k, v, mask, causal, q.shape[-1] ** -0.5, False, num_splits,
                         arch_of(cuda_cases.BACKEND))
    torch.cuda.synchronize()
    assert_close_to_reference(out, lse, q, k, v, mask, causal)


@pytest.mark.parametrize("sq,splits", [(4, True), (4096, False)])
def test_the_binding_splits_short_queries_only(sq, splits):
    """num_splits=0, the binding's choice: 4 queries against 8192 keys split the keys (the merge kernel
    runs after the forward of the family under test), 4096 queries fill the GPU unsplit."""
    q, k, v = make_qkv(1, sq, 8192, 16, 4, main_head_dim(), DTYPES[-1])
    cuda_cases.skip_unless_backend_serves(q)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, lse = _cuda.fwd(q, k, v, None, True, q.shape[-1] ** -0.5, False, 0, arch_of(cuda_cases.BACKEND))
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any(f"{cuda_cases.BACKEND}::fwd_kernel<" in n for n in names), sorted(set(names))
    assert any("fwd_combine_kernel" in n for n in names) == splits, sorted(set(names))
    assert_close_to_reference(out, lse, q, k, v, None, True)


@pytest.mark.parametrize("family", ["sliding_window", "causal_document", "prefix_lm_document", "global_sliding_window"])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_mask_families(family, num_splits):
    # The splits share out a tile's key blocks from the lowest one it sees (the mask metadata's
    # floor) up: a window's or a document's tile splits only the blocks around it.
    startend, causal = example(family, 1500, batch_size=2, device="cuda")
    q, k, v = make_qkv(2, 1500, 1500, 4, 2, 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1], DTYPES[-1])
    cuda_cases.skip_unless_backend_serves(q)
    out, lse = _cuda.fwd(q, k, v, startend, causal, q.shape[-1] ** -0.5, False, num_splits,
                         arch_of(cuda_cases.BACKEND))
    torch.cuda.synchronize()
    assert_close_to_reference(out, lse, q, k, v, startend, causal)


def test_partial_build_names_missing_head_dims():
    """A build without the larger head dims (FLASHMASK_HEAD_DIMS) raises from the binding itself,
    not only from flashmask_attention's check, and the process survives to run a supported call."""
    dims = _cuda.compiled_head_dims()
    if max(dims) == 256:
        pytest.skip("this build has every head dim; run it on a FLASHMASK_HEAD_DIMS build without 256")
    d = max(dims) + 8
    q = torch.randn(1, 64, 2, d, device="cuda", dtype=_cuda.compiled_dtypes()[0])
    with pytest.raises(RuntimeError, match=rf"head dim {d} is larger than every head dim this build compiled"):
        _cuda._C.fwd(q, q, q, None, True, d ** -0.5, 0)
    q = q[..., :max(dims)].contiguous()
    out, lse = run_kernel(q, q, q, None, True)
    assert_close_to_reference(out, lse, q, q, q, None, True)


def test_binding_errors_with_numbers_raise():
    """The binding's own checks raise (not crash) when their message holds numbers."""
    dtype = _cuda.compiled_dtypes()[0]
    q = torch.randn(1, 64, 2, 24, device="cuda", dtype=dtype)[..., :20]
    with pytest.raises(RuntimeError, match="head dim must be a multiple of 8 up to 256, got 20"):
        _cuda._C.fwd(q, q, q, None, False, 1.0, 0)
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=dtype)
    mask = torch.zeros(1, 1, 64, 4, device="cuda", dtype=torch.int32)
    with pytest.raises(RuntimeError, match="C=4 is invalid for causal=True"):
        _cuda._C.fwd(q, q, q, mask, True, 1.0, 0)


def test_layouts_the_kernels_cannot_take_raise_or_fall_back(monkeypatch):
    """Each layout requirement flashmask_attention checks before a launch: backend="cuda" raises with
    it, backend="auto" warns with it and computes on the reference path."""
    monkeypatch.setattr(flashmask.attention, "_warned", set())  # it warns once per reason and process
    dtype, d = DTYPES[0], HEAD_DIMS[0]
    k = torch.randn(1, 64, 2, d, device="cuda", dtype=dtype)
    bad = {
        r"last dimension of q contiguous \(stride 1\), got stride 2":
            torch.randn(1, 64, d, 2, device="cuda", dtype=dtype).transpose(2, 3),
        r"q to start at a 16-byte aligned address":
            torch.randn(64 * 2 * d + 1, device="cuda", dtype=dtype)[1:].view(1, 64, 2, d),
        r"strides of q to be multiples of 8 elements":
            torch.randn(1, 64, 2, d + 4, device="cuda", dtype=dtype)[..., :d],
    }
    for why, q in bad.items():
        with pytest.raises(RuntimeError, match=why):
            flashmask.flashmask_attention(q, k, k, causal=True, backend="cuda")
        with pytest.warns(UserWarning, match=why):
            out, lse = flashmask.flashmask_attention(q, k, k, causal=True, return_lse=True)
        assert_close_to_reference(out, lse, q, k, k, None, True)
    out, lse = flashmask.flashmask_attention(k, k, k, causal=True, return_lse=True, backend="cuda")  # the control
    assert_close_to_reference(out, lse, k, k, k, None, True)


def test_arch_selection():
    """backend="sm80" and FLASHMASK_ARCH=80 run the SM80 kernels on any GPU whose code the build
    carries for them (on Hopper, a build for sm_80 and sm_90 runs the SM90 ones instead); an unknown
    family raises before any kernel runs; "cuda" takes the newest family the device runs."""
    dtype = DTYPES[0]
    d = 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1]
    q = torch.randn(1, 64, 2, d, device="cuda", dtype=dtype)
    major, minor = torch.cuda.get_device_capability()
    cc = major * 10 + minor
    sm80_here = 80 in _cuda.device_archs(cuda_cases.kernel_head_dim(d), dtype, cc)
    assert _cuda.selected_arch(q, 80) == (80 if sm80_here else 90)
    newest = max(_cuda.compiled_archs(cuda_cases.kernel_head_dim(d), dtype))
    assert _cuda.selected_arch(q, 0) == newest
    with pytest.raises(RuntimeError, match="unknown kernel architecture 70"):
        _cuda.selected_arch(q, 70)
    out, lse = flashmask.flashmask_attention(q, q, q, causal=True, return_lse=True, backend="sm80")
    assert_close_to_reference(out, lse, q, q, q, None, True)
    if 90 in _cuda.compiled_archs(cuda_cases.kernel_head_dim(d), dtype) and newest == 90:
        # The SM90 backward runs asked for or not, deterministic too (its dQ additions in key order).
        assert _cuda.selected_arch(q, 90, "bwd") == 90
        assert _cuda.selected_arch(q, 0, "bwd") == 90
        assert _cuda.selected_arch(q, 0, "bwd_deterministic") == 90
        # A forced SM80 backward runs on its own kernels where the build compiled them for sm_90
        # (FLASHMASK_ARCHS=90), else on the SM90 ones (a build for sm_80 and sm_90 leaves them out).
        for slot in ("bwd", "bwd_deterministic"):
            assert _cuda.selected_arch(q, 80, slot) == (80 if sm80_here else 90)
        assert 90 in _cuda.device_archs(cuda_cases.kernel_head_dim(d), dtype, cc)
    if "sm90" not in cuda_cases.KERNEL_BACKENDS:
        with pytest.raises(RuntimeError, match="sm90"):
            flashmask.flashmask_attention(q, q, q, causal=True, backend="sm90")


def test_small_head_dims_run_on_the_newest_family():
    """On Hopper head dims 32 and 40 round up to the SM90 head dim 64 (zero-padded: measured faster
    than the SM80 kernels at 32), forward and backward; a forced sm80 keeps its own head dim 32 where
    the build carries its sm_90 code (FLASHMASK_ARCHS=90)."""
    dtype = DTYPES[-1]
    if torch.cuda.get_device_capability() != (9, 0) or 90 not in _cuda.compiled_archs(64, dtype):
        pytest.skip("needs a Hopper GPU and the SM90 head dim 64")
    if not _cuda.compiled_archs(32, dtype):
        pytest.skip("needs a build with head dim 32")
    for d in (32, 40):
        q = torch.randn(1, 300, 2, d, device="cuda", dtype=dtype)
        assert _cuda.selected_arch(q, 0) == 90 and _cuda.selected_arch(q, 0, "bwd") == 90
        assert _cuda.selected_arch(q, 80) == (80 if 80 in _cuda.device_archs(32, dtype, 90) else 90)
        out, lse = flashmask.flashmask_attention(q, q, q, causal=True, return_lse=True, backend="cuda")
        assert_close_to_reference(out, lse, q, q, q, None, True)


_ENV_ARCH_SCRIPT = """
import torch, flashmask
from flashmask import _cuda
q = torch.randn(1, 64, 2, {d}, device="cuda", dtype=torch.{dtype})
for step in (lambda: _cuda.selected_arch(q),
             lambda: flashmask.flashmask_attention(q, q, q, causal=True, backend="cuda").dtype):
    try:
        print("ok", step())
    except RuntimeError as e:
        print("error", " ".join(str(e).split()))  # one line
"""


def test_arch_environment_variable():
    """FLASHMASK_ARCH is read once per process (at its first kernel selection), so each value gets
    a fresh interpreter."""
    script = _ENV_ARCH_SCRIPT.format(d=HEAD_DIMS[0], dtype=str(DTYPES[0]).replace("torch.", ""))

    def run(value):
        root = ROOT
        env = dict(os.environ, FLASHMASK_ARCH=value, PYTHONPATH=root)
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                           cwd=root)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout

    major, minor = torch.cuda.get_device_capability()
    sm80_here = 80 in _cuda.device_archs(cuda_cases.kernel_head_dim(HEAD_DIMS[0]), DTYPES[0], major * 10 + minor)
    selected, attention = run("80").splitlines()[-2:]
    assert selected == ("ok 80" if sm80_here else "ok 90") and attention.startswith("ok"), (selected, attention)
    selected, attention = run("75").splitlines()[-2:]
    assert "unknown kernel architecture 75" in selected and "unknown kernel architecture 75" in attention
