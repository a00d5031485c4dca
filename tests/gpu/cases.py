"""Parameters and input makers shared by the GPU tests."""
import pytest
import torch

import flashmask
from flashmask import _cuda

DTYPES = [t for t in (torch.float16, torch.bfloat16) if _cuda.available() and t in _cuda.compiled_dtypes()]
HEAD_DIMS = [d for d in (32, 40, 64, 80, 96, 128, 160, 192, 256)
             if _cuda.available() and d <= max(_cuda.compiled_head_dims() or (0,))]
MODES = [(True, 1), (True, 2), (False, 2), (False, 4)]
# One head dim per SM90 tile shape, those the build has: 64, 96 and 128, 192, 256 tile the forward and
# the backward differently (test_fwd.py and test_bwd.py say how).
TILE_SHAPE_HEAD_DIMS = [d for d in (64, 96, 128, 192, 256) if d in _cuda.compiled_head_dims()]


def pick(seq, i):
    """The i-th of seq, cyclically: the parameters a test does not sweep turn with its index."""
    return seq[i % len(seq)]


def main_head_dim():
    """128, the head dim most models use, where the build has it; else its largest."""
    return 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1]


def _kernel_backends():
    """Every kernel family this build runs on the device, as a backend= value ("sm80", "sm90"). A
    build for sm_80 and sm_90 runs the SM90 kernels alone on Hopper (it compiles the SM80 ones for
    sm_80 only, instantiations.skips_sm90); FLASHMASK_ARCHS=90 runs both there."""
    if not _cuda.available():
        return ["cuda"]
    major, minor = torch.cuda.get_device_capability()
    cc = major * 10 + minor
    archs = {a for d in _cuda.compiled_head_dims() for t in DTYPES for a in _cuda.device_archs(d, t, cc)}
    return [f"sm{a}" for a in sorted(archs)]


# The GPU tests run once per kernel family (conftest.py's every_kernel_family sets BACKEND), so that the
# SM80 kernels stay tested on a Hopper GPU next to the SM90 ones. Always a CUDA backend: a silent
# fallback to the reference path would raise.
KERNEL_BACKENDS = _kernel_backends()
BACKEND = KERNEL_BACKENDS[-1]


def arch_of(backend):
    return _cuda.ARCHS[backend]


def kernel_head_dim(d):
    """The compiled head dim that serves d (the smallest that holds it)."""
    return min((k for k in _cuda.compiled_head_dims() if k >= d), default=d)


def skip_unless_backend_serves(q, backward=False):
    """A forced family runs only the head dims it compiled: the SM90 kernels have fewer. With
    ``backward``, also skip where its backward would run on a newer family (skip_unless_backward_on)."""
    arch = _cuda.ARCHS.get(BACKEND, 0)
    if arch and arch not in _cuda.compiled_archs(kernel_head_dim(q.shape[-1]), q.dtype):
        pytest.skip(f"{BACKEND} has no kernel for head dim {q.shape[-1]}, {q.dtype}")
    if arch and _cuda.selected_arch(q, arch) != arch:
        pytest.skip(f"this build runs the {BACKEND} forward of head dim {q.shape[-1]} on the "
                    f"sm{_cuda.selected_arch(q, arch)} kernels here")
    if backward:
        skip_unless_backward_on(arch, q)


def skip_unless_backward_on(arch, q, head_dim_v=None):
    """A backward forced onto family ``arch`` (0: none) that this device does not run it for goes to
    the newest family that has it: where that is a newer family (a build for sm_80 and sm_90 leaves
    the SM80 backward out of sm_90 at the head dims the SM90 backward serves), the test would only
    repeat that family's own run, so it skips. An older one (a forced family without the backward
    here) is the pairing a Hopper GPU runs, and is tested."""
    if not arch:
        return
    for slot in ("bwd", "bwd_deterministic"):
        runs_on = _cuda.selected_arch(q, arch, slot, head_dim_v)
        if runs_on > arch:
            pytest.skip(f"this build runs the sm{arch} {slot} of head dims ({q.shape[-1]}, "
                        f"{q.shape[-1] if head_dim_v is None else head_dim_v}) on the sm{runs_on} kernels here "
                        "(FLASHMASK_ARCHS=90 keeps the SM80 backward for sm_90)")


def poison_allocator(numel):
    """Fill the caching allocator's free blocks with NaN so that outputs a kernel fails to write show."""
    junk = torch.full((numel * 4 + (1 << 20),), float("nan"), device="cuda")
    del junk


def run_kernel(q, k, v, startend, causal, **kw):
    skip_unless_backend_serves(q)
    poison_allocator(q.numel())
    out, lse = flashmask.flashmask_attention(q, k, v, startend, causal=causal, return_lse=True, backend=BACKEND, **kw)
    torch.cuda.synchronize()
    return out, lse


def make_qkv(b, sq, sk, hq, hk, d, dtype, layout="bshd"):
    if layout == "bhsd":  # a transposed [B, H, S, D] tensor, passed without a copy
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype).transpose(1, 2)
        k = torch.randn(b, hk, sk, d, device="cuda", dtype=dtype).transpose(1, 2)
        v = torch.randn(b, hk, sk, d, device="cuda", dtype=dtype).transpose(1, 2)
        return q, k, v
    return tuple(torch.randn(b, s, h, d, device="cuda", dtype=dtype)
                 for s, h in ((sq, hq), (sk, hk), (sk, hk)))


