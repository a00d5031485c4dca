"""Shared helpers of the attention tests: random masks, a low-precision baseline, error bounds."""
from __future__ import annotations

import math

import torch

from flashmask.reference import reference_attention


def random_startend(b: int, hm: int, sq: int, sk: int, causal: bool, c: int, device="cpu",
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Random column intervals covering every mode: each interval is two sorted draws in [0, Sq],
    with a share of empty, full and boundary intervals so that whole tiles get skipped too."""
    def draw(*shape):
        x = torch.randint(0, sq + 1, shape, generator=generator)
        # A third of the columns take a block-constant value so some tiles are masked whole.
        blocky = torch.randint(0, sq + 1, (b, hm, 1), generator=generator).expand(b, hm, sk)
        pick = torch.rand(shape, generator=generator) < 0.33
        return torch.where(pick, blocky, x)

    a, z = draw(b, hm, sk), draw(b, hm, sk)
    lo, hi = torch.minimum(a, z), torch.maximum(a, z)
    if causal:
        cols = [lo] if c == 1 else [lo, hi]
    elif c == 2:
        ute = torch.minimum(draw(b, hm, sk), lo)  # [0, UTE) below [LTS, Sq) keeps most columns live
        cols = [lo, ute]
    else:
        a2, z2 = draw(b, hm, sk), draw(b, hm, sk)
        cols = [lo, hi, torch.minimum(a2, z2), torch.maximum(a2, z2)]
    return torch.stack(cols, dim=-1).to(torch.int32).to(device)


def low_precision_attention(q, k, v, startend, causal, scale=None, softcap=0.0, sinks=None):
    """A plain PyTorch implementation in the inputs' dtype (scores and probabilities rounded to it):
    the error baseline of the tolerance rule below. ``softcap`` caps the scores in that dtype too;
    ``sinks`` [Hq] join the softmax as one more column in float32 (the kernels read them so)."""
    from masks.format import to_dense
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kh = kh.repeat_interleave(hq // hk, 1)
    vh = vh.repeat_interleave(hq // hk, 1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    allowed = to_dense(startend, causal, seqlen_q=sq, seqlen_k=sk).to(q.device)
    if allowed.shape[1] not in (1, hq):
        allowed = allowed.repeat_interleave(hq // allowed.shape[1], 1)
    s = s.masked_fill(~allowed, float("-inf")).float()
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(1, hq, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]  # the sink carries no value
    return (p.to(q.dtype) @ vh).transpose(1, 2), lse


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    finite = torch.isfinite(ref)
    if not finite.any():
        return 0.0
    return (x.double() - ref.double())[finite].abs().max().item()


def error_bound(low: torch.Tensor, ref: torch.Tensor, floor: float = 1e-2, ulp: float | None = None) -> float:
    """The tolerance rule: the largest error allowed against the float32 reference ``ref``, twice the
    error of the plain half-precision baseline ``low`` plus a small epsilon. The epsilon is a
    thousandth of the values' scale (floored at ``floor`` for values that are 0 up to rounding), and
    at least one unit in the last place of ``low``'s dtype at that scale: the result's rounding to
    bf16 costs up to half of one on top of the error it carries from fp32, and in a small case the
    baseline's few values can all happen to round well (17 x 17 backwards: a dK value one bf16 step
    off against a bound of 0.65 steps, another 0.75 steps off against 0.66). ``ulp`` (relative) replaces
    that unit where the result is rounded to another dtype than ``low``'s."""
    scale = max(ref.abs().max().item(), floor)
    if ulp is None:
        ulp = torch.finfo(low.dtype).eps if low.dtype in (torch.float16, torch.bfloat16) else 0.0
    return 2 * max_err(low, ref) + max(1e-3, ulp) * scale


def hidden_rows(startend, causal, sq, sk, b, hq, device=None) -> torch.Tensor:
    """bool ``[B, Hq, Sq]``: the rows that the mask lets see no key."""
    from masks.format import to_dense
    seen = to_dense(startend, causal, seqlen_q=sq, seqlen_k=sk).any(-1)  # [B or 1, Hm or 1, Sq]
    if seen.shape[1] not in (1, hq):
        seen = seen.repeat_interleave(hq // seen.shape[1], 1)
    return (~seen).expand(b, hq, sq).to(device)


def hide_rows(mask: torch.Tensor, causal: bool, r0: int, r1: int) -> torch.Tensor:
    """A copy of ``mask`` in which batch 0 hides rows [r0, r1) from every key, by widening the intervals
    it has: causal C=1 hides rows [r0, Sq) and non-causal C=2 rows [0, r1) (their one-sided forms)."""
    m = mask.clone()
    c = m.shape[-1]
    if causal and c == 1:
        m[0, ..., 0].clamp_(max=r0)
    elif not causal and c == 2:
        m[0, ..., 1].clamp_(min=r1)
    else:  # causal C=2 and non-causal C=4: widen [LTS, LTE)
        m[0, ..., 0].clamp_(max=r0)
        m[0, ..., 1].clamp_(min=r1)
    return m


# How far the LSE of a row no key may attend may lie from its sink: a couple of float32 steps, for
# kernels that hold the sink in the units of their scores (sink / scale, times scale at the end).
SINK_LSE_RTOL = 2.0 ** -21


def assert_close_to_reference(out, lse, q, k, v, startend, causal, scale=None, softcap=0.0, sinks=None):
    """Output and LSE against a float32 reference within ``error_bound`` (the LSE's epsilon 1e-4).
    With ``sinks``, rows no key may attend must give out exactly 0 and the float32 of their sink as LSE."""
    options = {} if not softcap and sinks is None else {"softcap": softcap, "sinks": sinks}
    ref_out, ref_lse = reference_attention(q, k, v, startend, causal=causal, softmax_scale=scale, **options)
    lp_out, lp_lse = low_precision_attention(q, k, v, startend, causal, scale, **options)
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"
    empty = torch.isinf(ref_lse)  # [B, H, Sq]: rows no key may attend (none with sinks)
    assert torch.equal(torch.isinf(lse) & (lse > 0), empty), "rows with LSE +inf differ from the reference's empty rows"
    assert (out.transpose(1, 2)[empty] == 0).all(), "empty rows must give out = 0"
    if sinks is not None:
        b, sq, hq = q.shape[:3]
        hidden = hidden_rows(startend, causal, sq, k.shape[1], b, hq, lse.device)
        assert (out.transpose(1, 2)[hidden] == 0).all(), "rows no key may attend must give out = 0 with sinks too"
        sink = sinks.float().view(1, hq, 1).expand(b, hq, sq)
        torch.testing.assert_close(lse[hidden], sink[hidden], rtol=SINK_LSE_RTOL, atol=0,
                                   msg=lambda m: f"the LSE of rows no key may attend must be their sink: {m}")
        # Those rows' LSE is checked: the absolute epsilon below is below a float32 step at a sink of -1e4.
        lse, ref_lse, lp_lse = lse[~hidden], ref_lse[~hidden], lp_lse[~hidden]
    bound_o = error_bound(lp_out, ref_out, floor=1e-3)
    err_o = max_err(out, ref_out)
    assert err_o <= bound_o, f"out error {err_o:.3e} > bound {bound_o:.3e}"
    bound_l = 2 * max_err(lp_lse, ref_lse) + 1e-4
    err_l = max_err(lse, ref_lse)
    assert err_l <= bound_l, f"lse error {err_l:.3e} > bound {bound_l:.3e}"
    return err_o, bound_o


# ---------------------------------------------------------------------------------------------
# An independent float64 oracle for the CPU tests (test_reference / test_api / test_modules).
# Written directly from the table of docs/format.md and the definition of softmax attention; it shares no code
# with flashmask.reference or masks.format.to_dense.
# ---------------------------------------------------------------------------------------------

def dense_from_intervals(startend, causal: bool, sq: int, sk: int) -> torch.Tensor:
    """bool ``[B or 1, Hm or 1, Sq, Sk]`` (True = query i attends key j), from the table of docs/format.md:

    causal C=1: masked rows >= LTS; causal C=2: rows in [LTS, LTE); both plus the causal triangle
    aligned bottom-right (i sees j iff j <= i + Sk - Sq); non-causal C=2: rows >= LTS or < UTE;
    non-causal C=4: rows in [LTS, LTE) or in [UTS, UTE).
    """
    i = torch.arange(sq).view(1, 1, sq, 1)
    j = torch.arange(sk).view(1, 1, 1, sk)
    allowed = torch.ones(1, 1, sq, sk, dtype=torch.bool)
    if causal:
        allowed = allowed & (j <= i + (sk - sq))
    if startend is None:
        return allowed
    col = [x.long().cpu().unsqueeze(2) for x in startend.unbind(-1)]  # each [B, Hm, 1, Sk]
    c = len(col)
    if causal and c == 1:
        masked = i >= col[0]
    elif causal and c == 2:
        masked = (i >= col[0]) & (i < col[1])
    elif not causal and c == 2:
        masked = (i >= col[0]) | (i < col[1])
    elif not causal and c == 4:
        masked = ((i >= col[0]) & (i < col[1])) | ((i >= col[2]) & (i < col[3]))
    else:
        raise AssertionError(f"bad mode causal={causal} C={c}")
    return allowed & ~masked


def dense_from_mask_mod(mask_mod, bsz: int, sq: int, sk: int | None = None) -> torch.Tensor:
    """Evaluate a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx)`` on broadcast index tensors."""
    sk = sq if sk is None else sk
    b = torch.arange(bsz).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    qi = torch.arange(sq).view(1, 1, -1, 1)
    kv = torch.arange(sk).view(1, 1, 1, -1)
    return torch.as_tensor(mask_mod(b, h, qi, kv)).expand(bsz, 1, sq, sk)


def dense_window(sq: int, sk: int, window_size, causal: bool) -> torch.Tensor:
    """flash-attn local window ``(left, right)`` as bool ``[1, 1, Sq, Sk]``: query i attends key j iff
    ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (-1 = unbounded), and ``j <= i + Sk - Sq`` if causal."""
    left, right = window_size
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    diag = i + sk - sq
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    if causal:
        ok &= j <= diag
    return ok.view(1, 1, sq, sk)


def naive_attention(q, k, v, allowed, scale=None):
    """softmax(Q K^T * scale, masked) V in float64, straight from the definition.

    q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hk, D]``, v ``[B, Sk, Hk, Dv]``, ``allowed`` bool ``[B or 1, Hm, Sq,
    Sk]``; query head h reads key/value head ``h // (Hq // Hk)`` and mask head ``h // (Hq // Hm)``. Returns
    ``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq])`` in float64; a row with no allowed key gives out 0 and
    lse +inf. Differentiable (for autograd comparisons) on rows that have an allowed key.
    """
    q, k, v = q.double(), k.double(), v.double()
    hq, hk, d = q.shape[2], k.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    hm = allowed.shape[1]
    kv_head = torch.arange(hq) // (hq // hk)
    mask_head = torch.arange(hq) // (hq // hm)
    kk, vv = k[:, :, kv_head], v[:, :, kv_head]  # [B, Sk, Hq, D]
    a = allowed[:, mask_head].to(q.device)  # [B or 1, Hq, Sq, Sk]
    scores = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    scores = scores.masked_fill(~a, float("-inf"))
    empty = ~a.any(-1)  # [B or 1, Hq, Sq]
    # Empty rows would give softmax 0/0 = NaN: give them zero scores, then zero probabilities.
    safe = torch.where(empty.unsqueeze(-1), torch.zeros_like(scores), scores)
    p = torch.softmax(safe, dim=-1)
    p = torch.where(empty.unsqueeze(-1), torch.zeros_like(p), p)
    out = torch.einsum("bhij,bjhd->bihd", p, vv)
    lse = torch.logsumexp(safe, dim=-1)
    lse = torch.where(empty.expand_as(lse), torch.full_like(lse, float("inf")), lse)
    return out, lse


# Tolerance of float64 comparisons against the oracle.
TIGHT = dict(atol=1e-10, rtol=1e-10)


def check_matches(out, lse, ref_out, ref_lse, **tol):
    """out/lse against an oracle's (float64), TIGHT unless given; rows no key may attend must have
    exactly +inf LSE and exactly zero output, whatever the tolerance."""
    tol = tol or TIGHT
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isposinf(lse), empty), "LSE +inf exactly on the rows no key may attend"
    assert (out.transpose(1, 2)[empty] == 0).all(), "out must be exactly 0 on rows no key may attend"
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)


class KernelLaunches:
    """The extension ``flashmask._cuda._C`` with its forward launches counted: set it in place of
    ``_C`` to see how often the attention forward ran (what a checkpoint keeping it must spare)."""

    def __init__(self, inner):
        self.inner, self.fwd_calls = inner, 0

    def fwd(self, *args):
        self.fwd_calls += 1
        return self.inner.fwd(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)
