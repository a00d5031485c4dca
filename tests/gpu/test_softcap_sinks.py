"""Logit soft-capping (``softcap``) and attention sinks (``sinks``) on the kernels (GPU only).

Every test forces a kernel family (every_kernel_family runs it once per family, as in test_fwd.py),
so that a fallback to the reference path raises. Output and LSE, and dQ, dK, dV and the sinks'
gradient, against the reference path in float32 on the same inputs, within the rule of
tests/attn_helpers.py: twice the error of the plain half-precision computation with the same options,
plus an epsilon. Rows that no key may attend must give output 0 and, with sinks, their sink as LSE.
Each forward check also shows that it would fail a kernel that ignored an option or capped the
scores after the mask; each backward check, one that ignored an option in the gradients.
"""
import pytest
import torch

import flashmask
import masks
from flashmask import _cuda
from flashmask import distributed as fmd
from flashmask.reference import reference_attention
from masks.examples import example
from masks.format import to_dense
from tests.attn_helpers import (
    SINK_LSE_RTOL,
    assert_close_to_reference,
    error_bound,
    hidden_rows,
    hide_rows,
    low_precision_attention,
    max_err,
    random_startend,
)
from tests.gpu import cases as cuda_cases
from tests.gpu.cases import (
    DTYPES,
    HEAD_DIMS,
    MODES,
    arch_of,
    main_head_dim,
    pick,
    poison_allocator,
    run_kernel,
)

pytestmark = [
    pytest.mark.skipif(not _cuda.available(), reason="needs a CUDA device and the built extension"),
    pytest.mark.usefixtures("every_kernel_family", "seeded_by_test_id"),
]


SOFTCAPS = [5.0, 30.0, 50.0]
OPTIONS = ["softcap", "sinks", "both"]
SINK_DTYPES = [torch.float32, torch.bfloat16]
# (Sq, Sk, mask heads) for Hq = 6, Hk = 2: mask heads 1, Hk and Hq, Sq != Sk, lengths off the tiles.
SHAPES = [(333, 517, 1), (517, 333, 2), (700, 700, 6)]


def qkv(b, sq, sk, hq, hk, d, dtype, softcap=0.0, dv=None):
    """Random q, k, v ``[B, S, H, D]``; with ``softcap`` q is scaled so that the scores (std softcap / 3)
    reach the cap and tanh bends them."""
    q = torch.randn(b, sq, hq, d, device="cuda") * (softcap / 3 if softcap else 1.0)
    k = torch.randn(b, sk, hk, d, device="cuda")
    v = torch.randn(b, sk, hk, d if dv is None else dv, device="cuda")
    return q.to(dtype), k.to(dtype), v.to(dtype)


def make_sinks(kind, dtype, q, k, v, mask, causal, softcap=0.0):
    """Sink logits ``[Hq]`` for these inputs: "randn" normal values; "lse" about the rows' LSE over
    their keys (the median of the reference's), so that the sink takes a share like theirs; "extreme"
    +30, +80, -30 and -1e4; "mixed" one of each kind across the heads."""
    hq = q.shape[2]
    normal = (torch.randn(hq) * 2).tolist()
    near = [0.0] * hq
    if kind in ("lse", "mixed"):
        lse = reference_attention(q, k, v, mask, causal=causal, softcap=softcap)[1]
        level = lse[torch.isfinite(lse)].median().item() if torch.isfinite(lse).any() else 0.0
        near = (level + torch.randn(hq)).tolist()
    values = {
        "randn": normal,
        "lse": near,
        "extreme": [pick([30.0, 80.0, -30.0, -1e4], h) for h in range(hq)],
        "mixed": [pick([normal[h], 80.0, near[h], -1e4, 30.0, -30.0], h) for h in range(hq)],
    }[kind]
    return torch.tensor(values, device="cuda").to(dtype)


def case_inputs(option, i, shape, d, dtype, mask, causal, dv=None):
    """q, k, v, softcap and sinks ([B, Sq, Sk, Hq, Hk] ``shape``) for the option "softcap", "sinks" or
    "both"; the cap, the kind of sinks ("lse", "mixed", "extreme") and their dtype turn with i."""
    softcap = pick(SOFTCAPS, i) if option in ("softcap", "both") else 0.0
    q, k, v = qkv(*shape, d, dtype, softcap, dv)
    sinks = None
    if option in ("sinks", "both"):
        sinks = make_sinks(pick(["lse", "mixed", "extreme"], i), pick(SINK_DTYPES, i // 2), q, k, v, mask, causal,
                           softcap)
    return q, k, v, softcap, sinks


def random_mask(b, hm, sq, sk, causal, c):
    """Random column intervals (attn_helpers.random_startend) with a band of rows of batch 0 that sees
    no key across a tile boundary; None where c is None."""
    if c is None:
        return None
    mask = random_startend(b, hm, sq, sk, causal, c, device="cuda")
    r0 = sq // 2
    return hide_rows(mask, causal, r0, min(sq, r0 + sq // 5 + 1))


def capped_after_the_mask(q, k, v, mask, causal, softcap, sinks, scale=None):
    """What a kernel that capped the scores after the mask would return: a hidden key scores -softcap,
    not -inf (float32, rounded to q's dtype like the kernels' output)."""
    b, sq, hq, d = q.shape
    g = hq // k.shape[2]
    allowed = to_dense(mask, causal, seqlen_q=sq, seqlen_k=k.shape[1]).to(q.device)
    if allowed.shape[1] not in (1, hq):
        allowed = allowed.repeat_interleave(hq // allowed.shape[1], 1)
    qh = q.float().transpose(1, 2)
    kh, vh = (t.float().transpose(1, 2).repeat_interleave(g, 1) for t in (k, v))
    s = (qh @ kh.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    s = softcap * torch.tanh(s.masked_fill(~allowed, float("-inf")) / softcap)
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(1, hq, 1, 1).expand(b, hq, sq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :vh.shape[2]]
    return (p @ vh).transpose(1, 2).to(q.dtype), torch.logsumexp(s, dim=-1)


def wrong_results(q, k, v, mask, causal, softcap, sinks, sensitive, scale=None):
    """The results of kernels that got an option named in ``sensitive`` wrong, for the checks to fail
    on: without the cap; with the cap after the mask, where some row sees no key and no sink outweighs
    its keys' exp(-softcap) (else the rounded results are the same); without the sinks."""
    if softcap and "softcap" in sensitive:
        yield "without softcap", reference_attention(q, k, v, mask, causal=causal, softmax_scale=scale, sinks=sinks)
        low_sink = sinks is None or bool((sinks.float() <= -softcap).any())
        if low_sink and hidden_rows(mask, causal, q.shape[1], k.shape[1], q.shape[0], q.shape[2]).any():
            yield "softcap after the mask", capped_after_the_mask(q, k, v, mask, causal, softcap, sinks, scale)
    if sinks is not None and "sinks" in sensitive:
        yield "without sinks", reference_attention(q, k, v, mask, causal=causal, softmax_scale=scale, softcap=softcap)


def check_forward(q, k, v, mask, causal, softcap=0.0, sinks=None, result=None, sensitive=("softcap", "sinks"),
                  scale=None):
    """The kernels' output and LSE (``result``, else flashmask_attention's on the forced family) against
    the float32 reference; the same check fails each of ``wrong_results`` for the options in ``sensitive``."""
    if result is None:
        result = run_kernel(q, k, v, mask, causal, softmax_scale=scale, softcap=softcap, sinks=sinks)
    out, lse = result
    assert out.shape == (*q.shape[:3], v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert_close_to_reference(out, lse, q, k, v, mask, causal, scale, softcap=softcap, sinks=sinks)
    for what, wrong in wrong_results(q, k, v, mask, causal, softcap, sinks, sensitive, scale):
        with pytest.raises(AssertionError):
            assert_close_to_reference(*wrong, q, k, v, mask, causal, scale, softcap=softcap, sinks=sinks)
            pytest.fail(f"the check cannot tell the kernels' result from one {what}")
    return out, lse


def option_grads(fn, q, k, v, sinks, dout, dlse, loss):
    """Gradients with respect to q, k, v (and sinks, unless None) of <out, dout> ("out"), <finite lse,
    dlse> ("lse") or both ("both") under fn(q, k, v, sinks) -> (out, lse); zeros where unused."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().clone().requires_grad_())
    out, lse = fn(*leaves[:3], leaves[3] if sinks is not None else None)
    total = torch.zeros((), device=q.device)
    if loss in ("out", "both"):
        total = total + (out.float() * dout.float()).sum()
    if loss in ("lse", "both"):
        total = total + (torch.where(torch.isfinite(lse), lse, 0).float() * dlse).sum()
    grads = torch.autograd.grad(total, leaves, allow_unused=True)  # the reference's LSE does not read V
    return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def check_backward(q, k, v, mask, causal, softcap=0.0, sinks=None, *, loss="both", deterministic=False, dout=None,
                   dlse=None, sensitive=("softcap", "sinks"), scale=None, run=None):
    """dQ, dK, dV and dsinks of the kernels (through flashmask_attention on the forced family, or
    ``run(q, k, v, sinks) -> (out, lse)``) against autograd on the float32 reference path, each within
    ``error_bound`` of the half-precision computation's error; rows that see no key get dQ = 0. The
    reference's dQ, dK, dV without each option named in ``sensitive`` fail those bounds. Returns the
    kernels' gradients."""
    cuda_cases.skip_unless_backend_serves(q)
    b, sq, hq = q.shape[:3]
    dout = torch.randn(b, sq, hq, v.shape[-1], device="cuda", dtype=q.dtype) if dout is None else dout
    dlse = torch.randn(b, hq, sq, device="cuda") if dlse is None else dlse
    sinks32 = None if sinks is None else sinks.float()  # the oracles' sinks: a float32 leaf of the same values
    poison_allocator(q.numel() * 3 + v.numel())

    def kernels(a, b_, c, s):
        return flashmask.flashmask_attention(a, b_, c, mask, causal=causal, softmax_scale=scale, return_lse=True,
                                             backend=cuda_cases.BACKEND, deterministic=deterministic, softcap=softcap,
                                             sinks=s)

    def reference(cap):
        return lambda a, b_, c, s: reference_attention(a.float(), b_.float(), c.float(), mask, causal=causal,
                                                       softmax_scale=scale, softcap=cap, sinks=s)

    got = option_grads(kernels if run is None else run, q, k, v, sinks, dout, dlse, loss)
    ref = option_grads(reference(softcap), q, k, v, sinks32, dout, dlse, loss)
    low = option_grads(lambda a, b_, c, s: low_precision_attention(a, b_, c, mask, causal, scale, softcap, s),
                       q, k, v, sinks32, dout, dlse, loss)
    bounds = []
    for name, g, r, lo, t in zip(("dq", "dk", "dv"), got, ref, low, (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype, f"{name}: {g.shape} {g.dtype}"
        assert not torch.isnan(g).any(), f"NaN in {name}"
        bounds.append(error_bound(lo, r))
        err = max_err(g, r)
        assert err <= bounds[-1], f"{name} error {err:.3e} > bound {bounds[-1]:.3e}"
    if sinks is not None:
        g, r, lo = got[3], ref[3], low[3]
        assert g.shape == sinks.shape and g.dtype == sinks.dtype, f"dsinks: {g.shape} {g.dtype}"
        assert torch.isfinite(g).all(), f"dsinks not finite: {g}"
        # The kernels' dsinks come from their output stored in q's dtype, returned in the sinks' dtype.
        ulp = max(torch.finfo(q.dtype).eps, torch.finfo(sinks.dtype).eps)
        bound, err = error_bound(lo, r, ulp=ulp), max_err(g, r)
        assert err <= bound, f"dsinks error {err:.3e} > bound {bound:.3e}: {g.tolist()} vs {r.tolist()}"
    hidden = hidden_rows(mask, causal, sq, k.shape[1], b, hq, q.device)
    assert (got[0].transpose(1, 2)[hidden] == 0).all(), "rows that see no key must get dq = 0"
    plain = []
    if softcap and "softcap" in sensitive:
        plain.append(("softcap", option_grads(reference(0.0), q, k, v, sinks32, dout, dlse, loss)))
    if sinks is not None and "sinks" in sensitive:
        plain.append(("sinks", option_grads(reference(softcap), q, k, v, None, dout, dlse, loss)))
    for what, grads in plain:
        assert any(max_err(p, r) > bound for p, r, bound in zip(grads, ref, bounds)), \
            f"the check cannot tell the gradients from those without {what}"
    return got


# --- forward: soft-capping ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_softcap_head_dims(d, dtype):
    """Every head dim and dtype under a cap that bends the scores; the (causal, C) forms, the caps and
    the shapes (GQA 6/2, mask heads 1, Hk and Hq, Sq != Sk off the tiles) in turn, with a band of rows
    that sees no key (the cap goes before the mask: they stay empty)."""
    i = 2 * HEAD_DIMS.index(d) + DTYPES.index(dtype)
    causal, c = pick(MODES, i)
    softcap = pick(SOFTCAPS, i)
    sq, sk, hm = pick(SHAPES, i // 3)
    q, k, v = qkv(2, sq, sk, 6, 2, d, dtype, softcap)
    check_forward(q, k, v, random_mask(2, hm, sq, sk, causal, c), causal, softcap)


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("causal,c", MODES + [(True, None), (False, None)])
def test_softcap_values_and_modes(softcap, causal, c):
    """Each cap in each (causal, C) form and without a mask (the kernels' mask-free instantiation)."""
    i = 3 * (MODES + [(True, None), (False, None)]).index((causal, c)) + SOFTCAPS.index(softcap)
    sq, sk, hm = pick(SHAPES, i)
    q, k, v = qkv(2, sq, sk, 6, 2, main_head_dim(), pick(DTYPES, i), softcap)
    check_forward(q, k, v, random_mask(2, hm, sq, sk, causal, c), causal, softcap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", [-2.0, 0.0, 2.0])
@pytest.mark.parametrize("softcap", [20.0, 65.0, 66.0, 120.0])
def test_softcap_scores_at_the_ends_of_the_range(softcap, level, dtype):
    """bf16 runs soft-capped scores at a fixed max up to softcap 65.8 (csrc/common/softcap_max.h) and at
    the rows' running max above it, as fp16 always does. Every row's scores about level * softcap
    before the cap (spread by 0.15 softcap): near -softcap after it, where a fixed max's exponentials
    are smallest, or near +softcap, where they are largest; caps on both sides of the widest fixed
    max. Forward against the reference: no row's sum flushed to zero or overflowed; the backward,
    which takes P from the forward's LSE, at the two ends (level 0 spreads the scores over +-30
    logits, nearly uncapped: the plain regime the other backward tests cover)."""
    d = main_head_dim()
    sq, sk = 200, 333
    q = torch.randn(1, sq, 4, d, device="cuda") * 0.1
    k = torch.randn(1, sk, 2, d, device="cuda") * 0.1
    q[..., 0], q[..., 1] = level * softcap, 1.0  # score = level * softcap + k[..., 1] (softmax_scale 1)
    k[..., 0], k[..., 1] = 1.0, 0.15 * softcap * torch.randn(1, sk, 2, device="cuda")
    q, k, v = q.to(dtype), k.to(dtype), torch.randn(1, sk, 2, d, device="cuda").to(dtype)
    check_forward(q, k, v, None, True, softcap, scale=1.0, sensitive=())
    if level:
        check_backward(q, k, v, None, True, softcap, scale=1.0, sensitive=())


# --- forward: sinks -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["randn", "lse", "extreme"])
@pytest.mark.parametrize("causal,c", MODES + [(True, None)])
def test_sinks(kind, causal, c):
    """Sinks of each kind in float32 and bf16, in each (causal, C) form and without a mask (causal with
    Sq > Sk: the first rows see no key), alone and with a cap; rows that see no key give out 0 and
    their sink as LSE."""
    i = 3 * (MODES + [(True, None)]).index((causal, c)) + ["randn", "lse", "extreme"].index(kind)
    sq, sk, hm = (517, 333, 1) if c is None else pick(SHAPES, i)
    softcap = pick([0.0, 5.0], i)
    q, k, v = qkv(2, sq, sk, 6, 2, main_head_dim(), pick(DTYPES, i), softcap)
    mask = random_mask(2, hm, sq, sk, causal, c)
    sinks = make_sinks(kind, pick(SINK_DTYPES, i // 2), q, k, v, mask, causal, softcap)
    check_forward(q, k, v, mask, causal, softcap, sinks)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_softcap_and_sinks_head_dims(d):
    """Both options at every head dim: sinks of every kind across the heads, the forms, caps, dtypes
    and shapes in turn."""
    i = HEAD_DIMS.index(d)
    causal, c = pick(MODES, i)
    sq, sk, hm = pick(SHAPES, i)
    softcap = pick(SOFTCAPS, i)
    q, k, v = qkv(2, sq, sk, 6, 2, d, pick(DTYPES, i), softcap)
    mask = random_mask(2, hm, sq, sk, causal, c)
    sinks = make_sinks("mixed", pick(SINK_DTYPES, i // 2), q, k, v, mask, causal, softcap)
    check_forward(q, k, v, mask, causal, softcap, sinks)


def _padded_documents():
    # causal C=1 documents then 120 padding tokens whose columns hide their own rows: those rows see no key
    mask = masks.causal_document(600, [[200, 150, 130, 120], [90, 300, 90, 120]], device="cuda")
    mask[:, :, 480:, 0] = 480
    return mask, True, 600, 600


def _rows_under_every_interval():
    # non-causal C=4 random intervals, each widened over rows [200, 330)
    return hide_rows(random_startend(2, 2, 600, 600, False, 4, device="cuda"), False, 200, 330), False, 600, 600


def _a_batch_sees_nothing():
    # causal C=2: batch 1 hides every row from every key (whole tiles skipped), batch 0 random
    mask = random_startend(2, 1, 600, 700, True, 2, device="cuda")
    mask[1, ..., 0], mask[1, ..., 1] = 0, 600
    return mask, True, 600, 700


HIDDEN_ROW_MASKS = {
    "causal_more_queries_than_keys": lambda: (None, True, 333, 100),
    "padded_documents": _padded_documents,
    "rows_under_every_interval": _rows_under_every_interval,
    "a_batch_sees_nothing": _a_batch_sees_nothing,
}


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("case", sorted(HIDDEN_ROW_MASKS))
def test_rows_that_see_no_key(case, softcap):
    """Masks whose rows see no key, within tiles that compute and in tiles skipped whole: output exactly
    0 and LSE the float32 of the sink; backward: their dQ 0, and the sink takes their dLSE."""
    i = sorted(HIDDEN_ROW_MASKS).index(case) + int(softcap > 0)
    mask, causal, sq, sk = HIDDEN_ROW_MASKS[case]()
    q, k, v = qkv(2, sq, sk, 4, 2, main_head_dim(), pick(DTYPES, i), softcap)
    sinks = make_sinks(pick(["randn", "extreme", "lse", "mixed"], i), pick(SINK_DTYPES, i), q, k, v, mask, causal,
                       softcap)
    assert hidden_rows(mask, causal, sq, sk, 2, 4, q.device).any()
    check_forward(q, k, v, mask, causal, softcap, sinks)
    check_backward(q, k, v, mask, causal, softcap, sinks, sensitive=())


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_sinks_far_above_every_score(softcap):
    """Sinks of +30 and +80 over scores far below them (q = -3 k: a causal row's own key scores about
    -3 sqrt(D), and row 0 sees only it): the keys' weights exp(s - sink) stay finite and tiny, the
    LSE is the sink's, the gradients about 0."""
    d = main_head_dim()
    k = torch.randn(1, 300, 2, d, device="cuda")
    q = (-3 * k.repeat_interleave(2, 2)).to(pick(DTYPES, int(softcap > 0)))
    k, v = k.to(q.dtype), torch.randn(1, 300, 2, d, device="cuda", dtype=q.dtype)
    sinks = torch.tensor([80.0, 30.0, 80.0, 30.0], device="cuda")
    # (the cap changes nothing here that the bounds could see: only the sinks' absence must fail them)
    out, lse = check_forward(q, k, v, None, True, softcap, sinks, sensitive=("sinks",))
    assert out.abs().max() < 1e-3 and torch.isfinite(lse).all()
    torch.testing.assert_close(lse[0, :, 0], sinks, rtol=SINK_LSE_RTOL, atol=0)
    check_backward(q, k, v, None, True, softcap, sinks, sensitive=("sinks",))


# --- backward ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_backward_head_dims(d, option):
    """dQ, dK, dV and dsinks with a cap, with sinks and with both at every head dim the family's backward
    serves, the loss reading the LSE too; forms, dtypes and shapes (GQA, mask heads) in turn."""
    i = 3 * HEAD_DIMS.index(d) + OPTIONS.index(option)
    causal, c = pick(MODES, i)
    sq, sk, hm = pick(SHAPES, i)
    mask = random_mask(2, hm, sq, sk, causal, c)
    q, k, v, softcap, sinks = case_inputs(option, i, (2, sq, sk, 6, 2), d, pick(DTYPES, i), mask, causal)
    check_backward(q, k, v, mask, causal, softcap, sinks)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("causal,c", MODES)
def test_backward_modes(causal, c, option):
    i = 3 * MODES.index((causal, c)) + OPTIONS.index(option)
    sq, sk, hm = pick(SHAPES, i + 1)
    mask = random_mask(2, hm, sq, sk, causal, c)
    q, k, v, softcap, sinks = case_inputs(option, i, (2, sq, sk, 6, 2), main_head_dim(), pick(DTYPES, i), mask, causal)
    check_backward(q, k, v, mask, causal, softcap, sinks)


@pytest.mark.parametrize("loss", ["out", "lse"])
@pytest.mark.parametrize("option", OPTIONS)
def test_backward_loss_of_out_or_lse_alone(option, loss):
    """A loss of the output alone (the LSE's gradient None: dsinks = -sum p_sink rowsum(dO O)) or of the
    LSE alone (dO None), without a mask (the mask-free instantiation), causal and not."""
    i = 2 * OPTIONS.index(option) + (loss == "lse")
    causal = bool(i % 2)
    q, k, v, softcap, sinks = case_inputs(option, i, (2, 301, 429, 4, 1), main_head_dim(), pick(DTYPES, i), None,
                                          causal)
    check_backward(q, k, v, None, causal, softcap, sinks, loss=loss)


@pytest.mark.parametrize("option", OPTIONS)
def test_softmax_scale(option):
    """A softmax_scale of its own (about 3 times 1 / sqrt(D)): the cap bends the scores it scales."""
    i = OPTIONS.index(option)
    mask = random_mask(1, 2, 400, 333, False, 4)
    q, k, v, softcap, sinks = case_inputs(option, i, (1, 400, 333, 4, 2), main_head_dim(), pick(DTYPES, i), mask,
                                          False)
    scale = 3 * q.shape[-1] ** -0.5
    check_forward(q, k, v, mask, False, softcap, sinks, scale=scale)
    check_backward(q, k, v, mask, False, softcap, sinks, scale=scale)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("causal,c", [(True, 2), (False, 4)])
def test_deterministic_is_bitwise_stable(causal, c, option):
    """Two deterministic backwards give bitwise equal dQ, dK, dV and dsinks, both right."""
    i = 3 * int(causal) + OPTIONS.index(option)
    mask = random_mask(2, 2, 777, 901, causal, c)
    q, k, v, softcap, sinks = case_inputs(option, i, (2, 777, 901, 4, 2), main_head_dim(), DTYPES[-1], mask, causal)
    dout = torch.randn(2, 777, 4, q.shape[-1], device="cuda", dtype=q.dtype)
    dlse = torch.randn(2, 4, 777, device="cuda")
    first, second = (check_backward(q, k, v, mask, causal, softcap, sinks, deterministic=True, dout=dout, dlse=dlse)
                     for _ in range(2))
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), first, second):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"


# --- split-KV --------------------------------------------------------------------------------------------

SPLITS = [(1, 2000, 7), (5, 1500, 3), (13, 640, 2), (16, 1111, 16)]


def split_kv(q, k, v, mask, causal, softcap, sinks, num_splits):
    """The forward op with num_splits forced, on the family under test."""
    cuda_cases.skip_unless_backend_serves(q)
    poison_allocator(q.numel() * 64)
    result = _cuda.fwd(q, k, v, mask, causal, q.shape[-1] ** -0.5, False, num_splits, arch_of(cuda_cases.BACKEND),
                       softcap, sinks)
    torch.cuda.synchronize()
    return result


@pytest.mark.parametrize("causal,c", MODES)
@pytest.mark.parametrize("sq,sk,num_splits", SPLITS)
def test_split_kv(sq, sk, num_splits, causal, c):
    """Flash-Decoding (a few queries, many keys, each tile's key blocks shared among num_splits CTAs
    and merged by LSE) with a cap, sinks (added once, in the merge) or both; rows of batch 0 that see
    no key (from 5 queries on)."""
    i = MODES.index((causal, c)) + SPLITS.index((sq, sk, num_splits))
    mask = random_startend(2, 2, sq, sk, causal, c, device="cuda")
    if sq >= 5:
        mask = hide_rows(mask, causal, sq // 2, sq // 2 + 2)
    q, k, v, softcap, sinks = case_inputs(pick(OPTIONS, i), i, (2, sq, sk, 4, 2), main_head_dim(), DTYPES[-1], mask,
                                          causal)
    result = split_kv(q, k, v, mask, causal, softcap, sinks, num_splits)
    check_forward(q, k, v, mask, causal, softcap, sinks, result=result)


@pytest.mark.parametrize("num_splits", [3, 7])
def test_split_kv_rows_that_see_nothing_in_some_splits(num_splits):
    """16 queries, 2000 keys, non-causal C=4: rows 0-7 see only the keys from 1000 on, rows 8-11 only
    those before, rows 12-15 none: each split has rows that see nothing in it, and the merge adds the
    sink once (rows 12-15: out 0, LSE = sink)."""
    sq, sk = 16, 2000
    first = torch.tensor([0, 8, 12, 16], dtype=torch.int32, device="cuda")  # hide rows [0, 8) and [12, 16)
    second = torch.tensor([8, 16, 0, 0], dtype=torch.int32, device="cuda")  # hide rows [8, 16)
    mask = torch.stack([first] * 1000 + [second] * 1000).view(1, 1, sk, 4).expand(2, 2, sk, 4).contiguous()
    softcap = pick([5.0, 30.0], num_splits)
    q, k, v = qkv(2, sq, sk, 4, 2, main_head_dim(), DTYPES[-1], softcap)
    sinks = make_sinks("mixed", pick(SINK_DTYPES, num_splits), q, k, v, mask, False, softcap)
    result = split_kv(q, k, v, mask, False, softcap, sinks, num_splits)
    check_forward(q, k, v, mask, False, softcap, sinks, result=result)
    out, lse = result
    assert (out[:, 12:] == 0).all()


@pytest.mark.parametrize("option", OPTIONS)
def test_split_kv_chosen_by_the_binding(option):
    """flashmask_attention with 4 queries against 2048 keys: the binding splits the keys on its own (on
    both families); forward, and the backward from the merged LSE."""
    i = OPTIONS.index(option)
    mask = random_startend(1, 1, 4, 2048, True, 2, device="cuda")
    q, k, v, softcap, sinks = case_inputs(option, i, (1, 4, 2048, 4, 2), main_head_dim(), pick(DTYPES, i), mask, True)
    check_forward(q, k, v, mask, True, softcap, sinks)
    check_backward(q, k, v, mask, True, softcap, sinks)


# --- context parallelism ----------------------------------------------------------------------------------

@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("mode", fmd.MODES)
def test_context_parallel_one_process(mode, option):
    """Both context-parallel modes on one process (the plan's shard is a permutation of the rows): the
    kernels' output and gradients, the sinks' included, through the plan against the reference."""
    i = OPTIONS.index(option)
    mask, causal = example(pick(["causal_document", "share_question"], i), 600, batch_size=2, device="cuda")
    q, k, v, softcap, sinks = case_inputs(option, i, (2, 600, 600, 6, 2), main_head_dim(), pick(DTYPES, i), mask,
                                          causal)
    cuda_cases.skip_unless_backend_serves(q)
    plan = fmd.make_plan(mask, causal, mode=mode, align=8)
    rows = torch.argsort(plan.local_index.to("cuda"))  # the shard's rows back in token order

    def run(a, b_, c, s):
        out = fmd.context_parallel_attention(plan.shard(a), plan.shard(b_), plan.shard(c), plan, softcap=softcap,
                                             sinks=s, backend=cuda_cases.BACKEND)
        return out.index_select(1, rows), None

    out = run(q, k, v, sinks)[0]
    ref = reference_attention(q.float(), k.float(), v.float(), mask, causal=causal, softcap=softcap,
                              sinks=None if sinks is None else sinks.float())[0]
    low = low_precision_attention(q, k, v, mask, causal, None, softcap, sinks)[0]
    assert max_err(out, ref) <= error_bound(low, ref), f"out error {max_err(out, ref):.3e}"
    check_backward(q, k, v, mask, causal, softcap, sinks, loss="out", run=run)


# --- unequal head dims -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", OPTIONS)
def test_head_dim_pair_192_128(option, dtype):
    """q and k of head dim 192, v of 128 (multi-head latent attention), forward and backward."""
    d, dv = 192, 128
    if (d, dv) not in _cuda.compiled_head_dim_pairs():
        pytest.skip(f"this build has no ({d}, {dv}) kernels")
    if arch_of(cuda_cases.BACKEND) not in _cuda.compiled_archs(d, dtype, dv):
        pytest.skip(f"{cuda_cases.BACKEND} has no ({d}, {dv}) kernel for {dtype}")
    i = 2 * OPTIONS.index(option) + DTYPES.index(dtype)
    causal, c = pick(MODES, i)
    mask = random_mask(2, 2, 301, 427, causal, c)
    q, k, v, softcap, sinks = case_inputs(option, i, (2, 301, 427, 4, 2), d, dtype, mask, causal, dv=dv)
    check_forward(q, k, v, mask, causal, softcap, sinks)
    check_backward(q, k, v, mask, causal, softcap, sinks)
