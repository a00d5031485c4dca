"""The pure-PyTorch reference path against an independent naive float64 oracle (CPU).

The oracle (``attn_helpers.naive_attention``) is softmax(Q K^T * scale, masked) V written from the
definition; its dense masks come from each family's ``*_mask_mod`` or from the interval table of
docs/format.md written afresh (``attn_helpers.dense_from_intervals``), never from ``to_dense``.
"""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import masks
from flashmask import flashmask_attention
from flashmask.reference import reference_attention
from masks.examples import example
from tests.attn_helpers import (
    TIGHT,
    check_matches,
    dense_from_intervals,
    dense_from_mask_mod,
    error_bound,
    max_err,
    naive_attention,
    random_startend,
)

FAMILIES = list(masks.FAMILIES)
MODES = [(True, 1), (True, 2), (False, 2), (False, 4)]
HYP = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _qkv(b, sq, sk, hq, hk, d, dtype=torch.float64, generator=None, requires_grad=False):
    mk = lambda s, h: torch.randn(b, s, h, d, generator=generator, dtype=torch.float64).to(dtype)
    q, k, v = mk(sq, hq), mk(sk, hk), mk(sk, hk)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v


# --- the oracle itself --------------------------------------------------------------------------

FORMAT_PICTURES = {  # docs/format.md worked examples, Sq = Sk = 10: (startend columns, causal, picture)
    "sliding": ([[3, 4, 5, 6, 7, 8, 9, 10, 10, 10]], True,
                "#......... ##........ ###....... .###...... ..###..... ...###.... ....###... .....###.. "
                "......###. .......###"),
    "causal_doc": ([[4, 4, 4, 4, 7, 7, 7, 10, 10, 10]], True,
                   "#......... ##........ ###....... ####...... ....#..... ....##.... ....###... .......#.. "
                   ".......##. .......###"),
    "document": ([[4, 4, 4, 4, 7, 7, 7, 10, 10, 10], [0, 0, 0, 0, 4, 4, 4, 7, 7, 7]], False,
                 "####...... ####...... ####...... ####...... ....###... ....###... ....###... .......### "
                 ".......### .......###"),
    "share_q": ([[10, 10, 10, 10, 7, 7, 7, 10, 10, 10]], True,
                "#......... ##........ ###....... ####...... #####..... ######.... #######... ####...#.. "
                "####...##. ####...###"),
    "global_sw": ([[10, 10, 4, 5, 6, 7, 8, 9, 10, 10], [10] * 10, [0, 0, 0, 0, 2, 2, 2, 2, 2, 2],
                   [0, 0, 0, 0, 3, 4, 5, 6, 7, 8]], False,
                  "########## ########## ####...... #####..... ##.###.... ##..###... ##...###.. ##....###. "
                  "##.....### ##......##"),
}


@pytest.mark.parametrize("name", list(FORMAT_PICTURES))
def test_oracle_mask_matches_spec_pictures(name):
    cols, causal, pic = FORMAT_PICTURES[name]
    se = torch.tensor(cols, dtype=torch.int32).T.reshape(1, 1, 10, len(cols))
    want = torch.tensor([[ch == "#" for ch in row] for row in pic.split()])
    assert torch.equal(dense_from_intervals(se, causal, 10, 10)[0, 0], want)


@settings(max_examples=15, **HYP)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(1, 20), st.integers(1, 20),
       st.integers(1, 8), st.booleans())
def test_oracle_matches_sdpa_without_mask(b, hk, g, sq, sk, d, causal):
    # Sanity of the oracle itself against PyTorch's math SDPA (float64), where SDPA applies.
    q, k, v = _qkv(b, sq, sk, hk * g, hk, d)
    allowed = dense_from_intervals(None, causal, sq, sk)
    out, _ = naive_attention(q, k, v, allowed)
    kk, vv = (t.repeat_interleave(g, 2).transpose(1, 2) for t in (k, v))
    want = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=allowed[0, 0]).transpose(1, 2)
    empty = ~allowed[0, 0].any(-1)
    want[:, empty] = 0  # SDPA gives NaN there
    torch.testing.assert_close(out, want, **TIGHT)


# --- every family -------------------------------------------------------------------------------

def _lens(rnd: random.Random, s: int, tail: bool = True) -> list:
    """1-4 positive lengths summing to s (sometimes less: the rest becomes a tail segment)."""
    n = rnd.randint(1, min(4, s))
    cuts = sorted(rnd.sample(range(1, s), n - 1)) if n > 1 else []
    lens = [b - a for a, b in zip([0] + cuts, cuts + [s])]
    if tail and len(lens) > 1 and rnd.random() < 0.3:
        lens = lens[:-1]
    return lens


def _regions(rnd: random.Random, s: int) -> list:
    """Up to two qk_sparse regions with disjoint key ranges."""
    keys = sorted(rnd.sample(range(0, s + 1), min(4, s + 1)))
    out = []
    for ks, ke in zip(keys[::2], keys[1::2]):
        r0 = rnd.randint(0, s)
        out.append((ks, ke, r0, rnd.randint(r0, s)))
    return out


def family_args(family: str, s: int, bsz: int, rnd: random.Random):
    """(args, kwargs) for ``masks.<family>(s, *args, **kwargs)`` and its ``_mask_mod``, batch bsz."""
    per = lambda f: [f() for _ in range(bsz)]
    if family in ("full", "causal"):
        return (), {"batch_size": bsz}
    if family == "sliding_window":
        return (rnd.randint(1, s),), {"batch_size": bsz}
    if family in ("causal_document", "document", "causal_blockwise", "share_question"):
        return (per(lambda: _lens(rnd, s)),), {}
    if family == "global_sliding_window":
        return (rnd.randint(0, s), rnd.randint(1, s)), {"batch_size": bsz}
    if family == "prefix_lm_causal":
        return (per(lambda: rnd.randint(0, s)),), {}
    if family == "prefix_lm_document":
        docs = per(lambda: _lens(rnd, s))
        return (docs, [[rnd.randint(0, n) for n in x] for x in docs]), {}
    if family == "qk_sparse":
        return (per(lambda: _regions(rnd, s)),), {}
    if family == "random_eviction":
        return (), {"batch_size": bsz, "seed": rnd.randint(0, 2 ** 31 - 1)}
    raise AssertionError(f"no arguments for family {family}")


def test_family_args_cover_every_family():
    rnd = random.Random()
    for family in FAMILIES:
        args, kw = family_args(family, 9, 2, rnd)
        assert getattr(masks, family)(9, *args, **kw).shape[:3] == (2, 1, 9)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=8, **HYP)
@given(data=st.data())
def test_every_family_matches_naive_oracle(family, data):
    """The builder's mask through the reference == the naive oracle on the family's mask_mod."""
    s = data.draw(st.integers(1, 70), label="seqlen")
    bsz = data.draw(st.integers(1, 2), label="batch")
    hk = data.draw(st.sampled_from([1, 2]), label="Hk")
    hq = hk * data.draw(st.sampled_from([1, 2]), label="group")
    d = data.draw(st.sampled_from([1, 4, 8]), label="D")
    scale = data.draw(st.sampled_from([None, 0.3, 1.7]), label="scale")
    rnd = data.draw(st.randoms(use_true_random=False), label="rnd")
    mod = masks.FAMILIES[family]
    args, kw = family_args(family, s, bsz, rnd)
    se = getattr(masks, family)(s, *args, **kw)
    allowed = dense_from_mask_mod(getattr(masks, f"{family}_mask_mod")(s, *args, **kw), bsz, s)
    q, k, v = _qkv(bsz, s, s, hq, hk, d)
    out, lse = reference_attention(q, k, v, se, causal=mod.CAUSAL, softmax_scale=scale)
    assert out.dtype == torch.float64 and out.shape == (bsz, s, hq, d) and lse.shape == (bsz, hq, s)
    check_matches(out, lse, *naive_attention(q, k, v, allowed, scale))


@pytest.mark.parametrize("s", [37, 64, 129])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_examples_match_naive_oracle(family, s):
    """``masks.examples.example`` (the benchmark settings) against the interval definition, GQA 4:2."""
    se, causal = example(family, s, batch_size=2)
    assert causal == masks.FAMILIES[family].CAUSAL
    q, k, v = _qkv(2, s, s, 4, 2, 8)
    out, lse = reference_attention(q, k, v, se, causal=causal)
    check_matches(out, lse, *naive_attention(q, k, v, dense_from_intervals(se, causal, s, s)))


# --- random masks of every mode, GQA, mask heads, Sq != Sk ------------------------------------

@st.composite
def attention_case(draw, modes=MODES, max_s=33):
    causal, c = draw(st.sampled_from(modes), label="mode")
    b = draw(st.integers(1, 2), label="B")
    hk = draw(st.sampled_from([1, 2, 3]), label="Hk")
    hq = hk * draw(st.sampled_from([1, 2, 4]), label="group")  # MHA, GQA, MQA (hk = 1)
    hm = draw(st.sampled_from(sorted({1, hk, hq})), label="Hm")
    sq = draw(st.integers(1, max_s), label="Sq")
    sk = draw(st.one_of(st.just(sq), st.integers(1, max_s)), label="Sk")
    d = draw(st.sampled_from([1, 3, 8, 16]), label="D")
    scale = draw(st.sampled_from([None, 0.05, 0.5, 2.0]), label="scale")
    seed = draw(st.integers(0, 2 ** 31 - 1), label="seed")
    return causal, c, b, hq, hk, hm, sq, sk, d, scale, seed


@settings(max_examples=60, **HYP)
@given(attention_case())
def test_random_masks_match_naive_oracle(case):
    causal, c, b, hq, hk, hm, sq, sk, d, scale, seed = case
    g = torch.Generator().manual_seed(seed)
    se = random_startend(b, hm, sq, sk, causal, c, generator=g)
    q, k, v = _qkv(b, sq, sk, hq, hk, d, generator=g)
    out, lse = reference_attention(q, k, v, se, causal=causal, softmax_scale=scale)
    assert out.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq) and lse.dtype == torch.float64
    check_matches(out, lse, *naive_attention(q, k, v, dense_from_intervals(se, causal, sq, sk), scale))


def test_mask_heads_are_mapped_per_group():
    """Hm = Hk = 2, Hq = 4: mask head 0 (everything masked) must govern query heads 0 and 1 only."""
    sq = sk = 6
    se = torch.zeros(1, 2, sk, 4, dtype=torch.int32)
    se[:, 0, :, 1] = sq  # head 0: [LTS, LTE) = [0, Sq) masks every row
    q, k, v = _qkv(1, sq, sk, 4, 2, 4)
    out, lse = reference_attention(q, k, v, se, causal=False)
    assert torch.isposinf(lse[:, :2]).all() and torch.isfinite(lse[:, 2:]).all()
    assert (out[:, :, :2] == 0).all()
    check_matches(out, lse, *naive_attention(q, k, v, dense_from_intervals(se, False, sq, sk)))


@settings(max_examples=30, **HYP)
@given(st.integers(1, 2), st.integers(1, 2), st.integers(1, 3), st.integers(1, 30), st.integers(1, 30),
       st.integers(1, 8), st.booleans(), st.sampled_from([None, 0.7]))
def test_no_mask_matches_naive_oracle(b, hk, g, sq, sk, d, causal, scale):
    q, k, v = _qkv(b, sq, sk, hk * g, hk, d)
    out, lse = reference_attention(q, k, v, None, causal=causal, softmax_scale=scale)
    check_matches(out, lse, *naive_attention(q, k, v, dense_from_intervals(None, causal, sq, sk), scale))


def test_causal_bottom_right_alignment_sq_greater_than_sk():
    """Causal, Sq=7 > Sk=4: query i sees key j iff j <= i - 3, so rows 0-2 are empty and row 3 sees key 0."""
    q, k, v = _qkv(1, 7, 4, 2, 1, 5)
    out, lse = reference_attention(q, k, v, None, causal=True)
    assert torch.isposinf(lse[:, :, :3]).all() and (out[:, :3] == 0).all()
    assert torch.isfinite(lse[:, :, 3:]).all()
    torch.testing.assert_close(out[0, 3], v[0, 0].expand(2, 5), **TIGHT)  # one key: softmax weight 1
    torch.testing.assert_close(lse[0, :, 3], (q[0, 3] @ k[0, 0, 0]) / math.sqrt(5), **TIGHT)
    # The last row sees every key: plain softmax attention.
    s = (q[0, 6] @ k[0, :, 0].T) / math.sqrt(5)  # [H, Sk]
    torch.testing.assert_close(out[0, 6], torch.softmax(s, -1) @ v[0, :, 0], **TIGHT)
    # The same holds with an explicit (no-op) C=1 mask: LTS = Sq everywhere.
    se = torch.full((1, 1, 4, 1), 7, dtype=torch.int32)
    out2, lse2 = reference_attention(q, k, v, se, causal=True)
    check_matches(out2, lse2, out, lse)


def test_causal_bottom_right_alignment_sq_less_than_sk():
    """Causal, Sq=3 < Sk=6: query 0 sees keys 0..3, query 2 sees all 6."""
    q, k, v = _qkv(1, 3, 6, 1, 1, 4)
    out, lse = reference_attention(q, k, v, None, causal=True)
    for i, n in ((0, 4), (1, 5), (2, 6)):
        s = (q[0, i, 0] @ k[0, :n, 0].T) / 2.0
        torch.testing.assert_close(out[0, i, 0], torch.softmax(s, -1) @ v[0, :n, 0], **TIGHT)
        torch.testing.assert_close(lse[0, 0, i], torch.logsumexp(s, -1), **TIGHT)


@settings(max_examples=25, **HYP)
@given(attention_case(max_s=40), st.data())
def test_chunking_gives_the_same_result(case, data):
    causal, c, b, hq, hk, hm, sq, sk, d, scale, seed = case
    chunk = data.draw(st.integers(1, max(1, sq - 1)), label="chunk_size")
    g = torch.Generator().manual_seed(seed)
    se = random_startend(b, hm, sq, sk, causal, c, generator=g)
    q, k, v = _qkv(b, sq, sk, hq, hk, d, generator=g)
    whole = reference_attention(q, k, v, se, causal=causal, softmax_scale=scale)
    chunked = reference_attention(q, k, v, se, causal=causal, softmax_scale=scale, chunk_size=chunk)
    check_matches(*chunked, *whole, atol=1e-12, rtol=1e-12)
    check_matches(*chunked, *naive_attention(q, k, v, dense_from_intervals(se, causal, sq, sk), scale))


# --- dtypes -------------------------------------------------------------------------------------

# out is rounded to the input dtype (magnitude <= max |v| ~ 5); LSE is computed in float32.
LOW_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}


@pytest.mark.parametrize("dtype", list(LOW_TOL))
@pytest.mark.parametrize("causal,c", MODES)
def test_low_precision_inputs(dtype, causal, c):
    b, hq, hk, hm, sq, sk, d = 2, 4, 2, 2, 29, 23, 16
    se = random_startend(b, hm, sq, sk, causal, c)
    se[0, 0, :, 0] = 0  # batch 0, mask head 0: LTS=0 ...
    if c in (2, 4) and causal or c == 4:
        se[0, 0, :, 1] = sq  # ... with LTE=Sq: every row of query heads 0-1 is masked
    q, k, v = _qkv(b, sq, sk, hq, hk, d, dtype=dtype)
    out, lse = reference_attention(q, k, v, se, causal=causal)
    assert out.dtype == dtype and out.shape == (b, sq, hq, d)
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, sq)
    ref_out, ref_lse = naive_attention(q, k, v, dense_from_intervals(se, causal, sq, sk))
    assert torch.isposinf(ref_lse[0, :2]).all()
    tol = LOW_TOL[dtype]
    check_matches(out, lse, ref_out, ref_lse, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


# --- fully masked rows --------------------------------------------------------------------------

def _mask_with_empty_rows(b, hm, sq, sk, empty_rows, causal, c):
    """A random mask whose given rows no key may attend."""
    se = random_startend(b, hm, sq, sk, causal, c).long()
    rows = torch.tensor(sorted(empty_rows))
    if causal and c == 1:  # C=1 can only mask a suffix: empty rows from min(rows) on
        se[..., 0] = torch.minimum(se[..., 0], rows.min())
    elif not causal and c == 2:  # rows >= LTS or < UTE: take [0, UTE) up to the last empty row
        se[..., 1] = torch.maximum(se[..., 1], rows.max() + 1)
        se[..., 0] = torch.maximum(se[..., 0], se[..., 1])
    else:  # one interval [r0, r1) around all of them in every column
        se[..., 0], se[..., 1] = rows.min(), rows.max() + 1
    return se.to(torch.int32)


@pytest.mark.parametrize("causal,c", MODES)
def test_fully_masked_rows_are_exact(causal, c):
    sq, sk = 11, 9
    se = _mask_with_empty_rows(2, 3, sq, sk, {4, 6}, causal, c)
    q, k, v = _qkv(2, sq, sk, 3, 1, 8)
    out, lse = reference_attention(q, k, v, se, causal=causal)
    ref_out, ref_lse = naive_attention(q, k, v, dense_from_intervals(se, causal, sq, sk))
    assert torch.isposinf(ref_lse[:, :, [4, 6]]).all()
    assert torch.isposinf(lse[:, :, [4, 6]]).all()
    assert torch.equal(out[:, [4, 6]], torch.zeros_like(out[:, [4, 6]]))
    check_matches(out, lse, ref_out, ref_lse)


def test_every_row_masked():
    q, k, v = _qkv(1, 5, 4, 2, 2, 3)
    se = torch.tensor([0, 5], dtype=torch.int32).expand(1, 1, 4, 2)  # non-causal: rows >= 0
    out, lse = reference_attention(q, k, v, se, causal=False)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()


def _sdpa_math(q, k, v, allowed):
    """softmax attention in float64 from the definition (what SDPA's math backend computes)."""
    s = torch.matmul(q.transpose(1, 2), k.transpose(1, 2).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    return torch.matmul(p, v.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("what", ["q +inf, visible score -inf", "q +inf, visible score +inf", "k nan", "v inf"])
def test_non_finite_inputs_propagate_as_nan(what):
    """A row with a visible key whose score is not finite gives NaN (as softmax does), one whose
    value is inf gives inf; a row the mask hides entirely keeps out 0 and lse +inf whatever the
    inputs hold."""
    sq = sk = 6
    q, k, v = _qkv(1, sq, sk, 1, 1, 4)
    se = torch.tensor([[2, 6, 6, 6, 6, 6]], dtype=torch.int32).view(1, 1, sk, 1)  # LTS; row 1 empty below
    se[0, 0, 1, 0] = 1  # key 1: hidden from rows >= 1
    se[0, 0, 0, 0] = 1  # key 0: hidden from rows >= 1, so row 1 (causal: keys 0, 1) sees nothing
    row, hidden_row = 0, 1  # causal row 0 sees key 0 only
    if what.startswith("q +inf"):
        q[0, row] = float("inf")
        k[0, 0] = -1.0 if "-inf" in what else 1.0
        q[0, hidden_row] = float("inf")
    elif what == "k nan":
        k[0, 0] = float("nan")  # seen by row 0 only
    else:
        v[0, 0] = float("inf")
    allowed = dense_from_intervals(se, True, sq, sk)
    out, lse = reference_attention(q, k, v, se, causal=True)
    want = _sdpa_math(q, k, v, allowed)
    assert not torch.isfinite(out[0, row]).any(), what
    seen = [r for r in range(sq) if r != hidden_row]
    torch.testing.assert_close(out[0, seen], want[0, seen], equal_nan=True)
    assert torch.isfinite(lse[0, :, row]).all() if what == "v inf" else torch.isnan(lse[0, :, row]).all(), what
    assert torch.equal(out[0, hidden_row], torch.zeros_like(out[0, hidden_row])), what
    assert torch.isposinf(lse[0, :, hidden_row]).all(), what
    via_api = flashmask_attention(q, k, v, se, causal=True, backend="reference")
    assert torch.equal(via_api.isnan(), out.isnan())


def test_zero_length_keys_give_empty_rows():
    """Sk = 0: no key exists, so every row is empty (out 0, LSE +inf), as documented."""
    q, k, v = _qkv(1, 3, 0, 2, 1, 4)
    for causal in (False, True):
        out, lse = reference_attention(q, k, v, None, causal=causal)
        assert out.shape == (1, 3, 2, 4) and torch.equal(out, torch.zeros_like(out))
        assert lse.shape == (1, 2, 3) and torch.isposinf(lse).all()


def test_zero_length_queries():
    q, k, v = _qkv(2, 0, 5, 2, 1, 4)
    out, lse = reference_attention(q, k, v, None, causal=True)
    assert out.shape == (2, 0, 2, 4) and lse.shape == (2, 2, 0)


# --- gradients ----------------------------------------------------------------------------------

def _tiny_cases():
    """(name, startend, causal, Sq, Sk, Hq, Hk, empty query rows)."""
    t = lambda rows, h=1: torch.tensor(rows, dtype=torch.int32).T.reshape(1, h, -1, len(rows) // h)
    return [
        ("causal_document", masks.causal_document(5, [2, 3]), True, 5, 5, 2, 1, []),
        ("document", masks.document(5, [3, 2]), False, 5, 5, 2, 2, []),
        ("prefix_lm_causal", masks.prefix_lm_causal(5, 2), False, 5, 5, 2, 1, []),
        ("global_sliding_window", masks.global_sliding_window(6, 1, 2), False, 6, 6, 1, 1, []),
        ("causal_blockwise", masks.causal_blockwise(6, [2, 2]), True, 6, 6, 2, 1, []),
        # non-causal C=4: row 2 masked in every column ([LTS, LTE) = [2, 3)), rows 0 by UTS/UTE on keys 1-3
        ("c4_empty_row", t([[2, 2, 2, 2], [3, 3, 3, 3], [0, 0, 0, 0], [0, 1, 1, 1]]), False, 4, 4, 2, 1, [2]),
        # causal C=2: row 3 masked in every column it could see
        ("causal_c2_empty_row", t([[3, 3, 3, 3, 5], [4, 4, 4, 4, 5]]), True, 5, 5, 2, 1, [3]),
        # causal Sq=5 > Sk=3, no mask: rows 0-1 see nothing (bottom-right alignment)
        ("causal_sq_gt_sk", None, True, 5, 3, 2, 1, [0, 1]),
        # non-causal C=2, per-head masks (Hm = Hq = 2), row 0 empty on head 1 only
        ("per_head", torch.tensor([[[[4, 0], [2, 0], [3, 0]], [[4, 1], [3, 1], [4, 1]]]], dtype=torch.int32),
         False, 4, 3, 2, 1, None),
    ]


TINY = _tiny_cases()


def _tiny_inputs(case):
    _, se, causal, sq, sk, hq, hk, _ = case
    return se, causal, _qkv(1, sq, sk, hq, hk, 3, requires_grad=True)


@pytest.mark.parametrize("case", TINY, ids=[c[0] for c in TINY])
def test_gradcheck_out(case):
    se, causal, qkv = _tiny_inputs(case)
    fn = lambda q, k, v: reference_attention(q, k, v, se, causal=causal, softmax_scale=0.8)[0]
    assert torch.autograd.gradcheck(fn, qkv, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", TINY, ids=[c[0] for c in TINY])
def test_gradcheck_lse(case):
    se, causal, qkv = _tiny_inputs(case)
    with torch.no_grad():
        finite = torch.isfinite(reference_attention(*qkv, se, causal=causal)[1])

    def fn(q, k, v):
        out, lse = reference_attention(q, k, v, se, causal=causal)
        return out, lse[finite]  # +inf entries have no derivative; everything else is checked

    assert torch.autograd.gradcheck(fn, qkv, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", TINY, ids=[c[0] for c in TINY])
def test_empty_rows_get_zero_gradients(case):
    empty_rows = case[-1]
    se, causal, (q, k, v) = _tiny_inputs(case)
    out, lse = reference_attention(q, k, v, se, causal=causal)
    empty = torch.isposinf(lse)  # [1, Hq, Sq]
    if empty_rows is not None:  # the case's empty rows, on every head
        assert empty.any(1)[0].nonzero().flatten().tolist() == empty_rows
        assert torch.equal(empty.all(1), empty.any(1))
    else:  # per_head: row 0 of head 1 only
        assert empty[0].nonzero().tolist() == [[1, 0]]
    fin_lse = torch.where(empty, torch.zeros_like(lse), lse)
    loss = (out * torch.randn_like(out)).sum() + (fin_lse * torch.randn_like(lse)).sum()
    loss.backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    dq = q.grad.transpose(1, 2)[empty]  # [n_empty, D]
    assert torch.equal(dq, torch.zeros_like(dq)), "a row no key may attend must get exactly zero dQ"


@settings(max_examples=30, **HYP)
@given(attention_case(max_s=12))
def test_gradients_match_naive_autograd(case):
    """dQ, dK, dV of the reference (loss on out and the finite LSE) == autograd through the oracle."""
    causal, c, b, hq, hk, hm, sq, sk, d, scale, seed = case
    g = torch.Generator().manual_seed(seed)
    se = random_startend(b, hm, sq, sk, causal, c, generator=g)
    allowed = dense_from_intervals(se, causal, sq, sk)
    q, k, v = _qkv(b, sq, sk, hq, hk, d, generator=g, requires_grad=True)
    dout = torch.randn(b, sq, hq, d, generator=g, dtype=torch.float64)
    dlse = torch.randn(b, hq, sq, generator=g, dtype=torch.float64)

    def grads(out, lse):
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        return torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))

    got = grads(*reference_attention(q, k, v, se, causal=causal, softmax_scale=scale))
    want = grads(*naive_attention(q, k, v, allowed, scale))
    for name, x, y in zip("qkv", got, want):
        assert torch.isfinite(x).all(), f"d{name} not finite"
        torch.testing.assert_close(x, y, **TIGHT, msg=lambda m: f"d{name}: {m}")


def test_error_bound_allows_one_rounding_and_no_more():
    """The GPU tests' tolerance: a result one bf16 rounding step off the float32 reference passes even
    where the baseline rounded exactly; two steps off do not; fp16 keeps the 1e-3 epsilon."""
    ref = torch.tensor([5.0, -2.0, 0.5])  # exact in bf16: the baseline's error is 0
    low = ref.to(torch.bfloat16)
    step = 2.0 ** -5  # bf16 spacing in [4, 8)
    bound = error_bound(low, ref)
    assert max_err(low, ref) == 0.0
    off_by_one = ref.clone()
    off_by_one[0] = low[0].float() + step
    assert max_err(off_by_one, ref) <= bound
    off_by_two = ref.clone()
    off_by_two[0] = low[0].float() + 2 * step
    assert max_err(off_by_two, ref) > bound
    ref = torch.tensor([5.01, -2.0, 0.5])
    low16 = ref.to(torch.float16)
    assert error_bound(low16, ref) == pytest.approx(2 * max_err(low16, ref) + 1e-3 * 5.01)
    assert error_bound(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3)) == pytest.approx(2.0 ** -7 * 1e-2)
