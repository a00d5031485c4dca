"""Stand-ins for the CUDA kernels on the CPU, so that the custom ops' autograd, their fake
implementations and torch.compile can be tested without a GPU: the forward is the reference path,
the backward is written out as FlashAttention computes it from the saved LSE."""
from __future__ import annotations

import contextlib

import torch

from flashmask import _cuda
from flashmask.reference import reference_attention
from masks.format import to_dense

CALLS = []  # the stand-ins that ran, in order


def cpu_fwd(q, k, v, mask, causal, scale, deterministic=False, num_splits=0, arch=0, softcap=0.0, sinks=None):
    """The kernels' forward (both options) by the reference path, no autograd."""
    CALLS.append("fwd")
    with torch.no_grad():
        out, lse = reference_attention(q, k, v, mask, causal=causal, softmax_scale=scale, softcap=softcap,
                                       sinks=sinks)
    return out.contiguous(), lse.contiguous()  # the kernels' (and the fake implementation's) layout


def cpu_bwd(dout, q, k, v, out, lse, dlse, mask, causal, scale, deterministic=False, arch=0, softcap=0.0, sinks=None):
    """The kernels' backward from the saved LSE (which holds the sinks), through the cap's derivative
    1 - tanh^2, with dsinks as the real op gets it (no autograd: compiled backward graphs run below it)."""
    CALLS.append("bwd")
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    qh, kh, vh, oh, doh = (t.double().transpose(1, 2) for t in (q, k, v, out, dout))
    kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    allowed = to_dense(mask, causal, seqlen_q=sq, seqlen_k=sk)
    allowed = allowed.repeat_interleave(hq // allowed.shape[1], 1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    dcap = torch.ones_like(s)
    if softcap:
        t = torch.tanh(s / softcap)
        s, dcap = softcap * t, 1 - t * t
    p = torch.exp(s - lse.double().unsqueeze(-1)).masked_fill(~allowed, 0).nan_to_num(0)
    delta = (doh * oh).sum(-1, keepdim=True)
    if dlse is not None:  # d lse / d s = p: the LSE's gradient joins each row's
        delta = delta - dlse.double().unsqueeze(-1)
    ds = p * (doh @ vh.transpose(-1, -2) - delta) * dcap
    dq = (ds @ kh * scale).transpose(1, 2)
    fold = lambda t: t.unflatten(1, (hk, g)).sum(2).transpose(1, 2)  # noqa: E731 - GQA: sum over the group
    dk, dv = fold(ds.transpose(-1, -2) @ qh * scale), fold(p.transpose(-1, -2) @ doh)
    grads = tuple(x.to(q.dtype).contiguous() for x in (dq, dk, dv))
    dsum = delta.squeeze(-1).float()  # the kernels' row term D = rowsum(dO * O) - dlse, [B, Hq, Sq]
    return grads + (_cuda.sink_grad(lse, dsum, sinks),)


@contextlib.contextmanager
def registered():
    """flashmask::fwd / bwd given the stand-ins on the CPU (removed again on exit)."""
    with torch.library._scoped_library("flashmask", "IMPL") as lib:
        lib.impl("fwd", cpu_fwd, "CPU")
        lib.impl("bwd", cpu_bwd, "CPU")
        yield


@contextlib.contextmanager
def in_place_of_the_kernels():
    """flashmask_attention and the context-parallel attention run the stand-ins where they would run
    the kernels: through the ops (under a dispatch mode) and the eager path. Yields :data:`CALLS`,
    emptied first; everything is put back on exit."""
    import flashmask.attention

    saved = flashmask.attention.kernel_arch, _cuda._C
    flashmask.attention.kernel_arch, _cuda._C = (lambda *a, **k: 0), CpuExtension()
    CALLS.clear()
    try:
        with registered():
            yield CALLS
    finally:
        flashmask.attention.kernel_arch, _cuda._C = saved


class CpuExtension:
    """_C's fwd and bwd by the stand-ins, for the eager path (_EagerAttention)."""

    def fwd(self, q, k, v, mask, causal, scale, num_splits, arch, softcap, sinks):
        return list(cpu_fwd(q, k, v, mask, causal, scale, softcap=softcap, sinks=sinks))

    def bwd(self, dout, q, k, v, out, lse, dlse, mask, causal, scale, deterministic, arch, softcap):
        dq, dk, dv, _ = cpu_bwd(dout, q, k, v, out, lse, dlse, mask, causal, scale, softcap=softcap)
        dsum = (dout.double() * out.double()).sum(-1).transpose(1, 2)  # D = rowsum(dO * O) - dlse
        if dlse is not None:
            dsum = dsum - dlse.double()
        return [dq, dk, dv, dsum.float()]
