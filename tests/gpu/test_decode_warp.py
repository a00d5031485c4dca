"""GPU tests of the SM90 forward's decode-warp build (csrc/sm90/tile_config.h, FwdTile::decode_warp_keys):
a second producer warp draws and decodes each job one ahead of the load warp. The launch takes it
from a number of keys (64K at head dim 64) that the other GPU tests never reach, so here the private
override ``_cuda._overrides(decode_warp=1)`` forces it on small odd shapes, and the profiler's kernel
names show which build ran: a silent fall back to the other build fails the test."""
import pytest
import torch

import masks
from flashmask import _cuda
from masks.examples import example
from tests.attn_helpers import assert_close_to_reference, random_startend
from tests.gpu import cases as cuda_cases
from tests.gpu.cases import DTYPES, MODES, make_qkv, run_kernel

D = 64  # the head dim whose SM90 forward has the decode-warp build by default

pytestmark = [
    pytest.mark.skipif(not _cuda.available(), reason="needs a CUDA device and the built extension"),
    pytest.mark.skipif("sm90" not in cuda_cases.KERNEL_BACKENDS, reason="needs the SM90 kernels and a Hopper GPU"),
]


@pytest.fixture(autouse=True)
def sm90_backend(monkeypatch):
    monkeypatch.setattr(cuda_cases, "BACKEND", "sm90")
    for dtype in DTYPES:
        if 90 not in _cuda.compiled_archs(D, dtype):
            pytest.skip(f"no SM90 kernel for head dim {D}, {dtype}")


def decode_warp_builds(fn):
    """The set of decode-warp flags (the template argument before the last, kSoftcap) of the SM90
    forwards that fn runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "sm90::fwd_kernel<" in e.name]
    assert names, "no SM90 forward kernel ran"
    flags = {name.split(">(", 1)[0].rsplit(",", 2)[1].strip() for name in names}
    assert flags <= {"true", "false"}, names[0]
    return {flag == "true" for flag in flags}, result


def run_forced(q, k, v, mask, causal):
    with _cuda._overrides(decode_warp=1):
        builds, (out, lse) = decode_warp_builds(lambda: run_kernel(q, k, v, mask, causal))
    assert builds == {True}
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 1000), (1000, 17), (193, 385), (4097, 4097), (127, 4097)])
@pytest.mark.parametrize("causal,c", MODES + [(True, None), (False, None)])
def test_odd_shapes(dtype, sq, sk, causal, c):
    q, k, v = make_qkv(2, sq, sk, 3, 1, D, dtype)
    mask = None if c is None else random_startend(2, 1, sq, sk, causal, c, device="cuda")
    out, lse = run_forced(q, k, v, mask, causal)
    assert_close_to_reference(out, lse, q, k, v, mask, causal)


@pytest.mark.parametrize("hq,hk,hm", [(8, 2, 1), (8, 2, 2), (8, 2, 8)])
def test_gqa_mask_heads(hq, hk, hm):
    for causal, c in MODES:
        q, k, v = make_qkv(2, 513, 700, hq, hk, D, DTYPES[-1], "bhsd")
        mask = random_startend(2, hm, 513, 700, causal, c, device="cuda")
        out, lse = run_forced(q, k, v, mask, causal)
        assert_close_to_reference(out, lse, q, k, v, mask, causal)


@pytest.mark.parametrize("family", sorted(getattr(masks, "FAMILIES", {})))
def test_mask_families(family):
    startend, causal = example(family, 2000, batch_size=2, device="cuda")
    q, k, v = make_qkv(2, 2000, 2000, 4, 2, D, DTYPES[-1])
    out, lse = run_forced(q, k, v, startend, causal)
    assert_close_to_reference(out, lse, q, k, v, startend, causal)


def test_fully_masked_rows():
    # Rows 0..299 see no key, and a job of the first tile has no visible block at all.
    sq = sk = 700
    lts = torch.full((1, 1, sk), sq, dtype=torch.int32)
    ute = torch.full((1, 1, sk), 300, dtype=torch.int32)
    mask = torch.stack([lts, ute], -1).cuda()
    q, k, v = make_qkv(1, sq, sk, 2, 2, D, DTYPES[-1])
    out, lse = run_forced(q, k, v, mask, False)
    assert torch.isinf(lse[:, :, :300]).all() and (lse[:, :, :300] > 0).all()
    assert (out[:, :300] == 0).all()
    assert_close_to_reference(out, lse, q, k, v, mask, False)


@pytest.mark.parametrize("sk,pinned,expected", [(65536, -1, True), (65535, -1, False), (4096, -1, False),
                                                (65536, 0, False), (4096, 1, True)])
def test_launch_choice(sk, pinned, expected):
    """From 64K keys the launch takes the decode-warp build by itself; the override pins it."""
    q, k, v = make_qkv(1, 300, sk, 2, 1, D, DTYPES[-1])
    mask = random_startend(1, 1, 300, sk, False, 2, device="cuda")
    with _cuda._overrides(decode_warp=pinned):
        builds, (out, lse) = decode_warp_builds(lambda: run_kernel(q, k, v, mask, False))
    assert builds == {expected}
    assert_close_to_reference(out, lse, q, k, v, mask, False)


def test_override_restored_and_checked():
    """The override ends with its block, and a value other than -1, 0 or 1 is refused."""
    q, k, v = make_qkv(1, 300, 4096, 2, 1, D, DTYPES[-1])
    with _cuda._overrides(decode_warp=1):
        pass
    builds, _ = decode_warp_builds(lambda: run_kernel(q, k, v, None, False))
    assert builds == {False}
    with pytest.raises(RuntimeError, match=r"decode_warp must be -1 \(the library's choice\), 0 or 1, got 2"):
        with _cuda._overrides(decode_warp=2):
            pass
