"""format.validate errors, from_dense, window_to_startend, merge_window, from_cu_seqlens, from_position_ids."""
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import masks
from masks import from_dense, merge_window, to_dense, validate, window_to_startend

ALLOWED_C = {True: (1, 2), False: (2, 4)}


# ---------------------------------------------------------------- validate

def _ok(c, causal, b=2, h=3, sk=5, sq=5):
    t = torch.zeros(b, h, sk, c, dtype=torch.int32)
    t[..., 0] = sq  # LTS
    if causal and c == 2 or not causal and c == 4:
        t[..., 1] = sq  # LTE
    return t


@pytest.mark.parametrize("causal,c", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_validate_accepts_valid(causal, c):
    validate(_ok(c, causal), causal, 5, batch_size=2, num_heads_q=6, num_heads_k=3, seqlen_k=5)


@pytest.mark.parametrize("make,kwargs,exc,match", [
    (lambda: [1, 2], {}, TypeError, "must be a torch.Tensor"),
    (lambda: _ok(1, True).long(), {}, ValueError, "torch.int32"),
    (lambda: _ok(1, True)[0], {}, ValueError, "4 dimensions"),
    (lambda: torch.zeros(1, 1, 5, 4, dtype=torch.int32), {}, ValueError, "causal=True needs C=1 or 2"),
    (lambda: torch.zeros(1, 1, 5, 3, dtype=torch.int32), {}, ValueError, "C=3"),
    (lambda: _ok(1, True), {"batch_size": 3}, ValueError, "batch 2 but the inputs have batch 3"),
    (lambda: _ok(1, True), {"seqlen_k": 6}, ValueError, "Sk=5 columns but the keys have length 6"),
    (lambda: _ok(1, True), {"num_heads_q": 8, "num_heads_k": 2}, ValueError, "3 mask heads"),
])
def test_validate_structure_errors(make, kwargs, exc, match):
    with pytest.raises(exc, match=re.escape(match)):
        validate(make(), True, **kwargs)


def test_validate_noncausal_c1_is_an_error():
    with pytest.raises(ValueError, match=re.escape("causal=False needs C=2 or 4")):
        validate(_ok(1, True), False)


@pytest.mark.parametrize("causal,c,k,value,match", [
    (True, 1, 0, -1, "values must lie in [0, Sq=5]"),
    (True, 1, 0, 6, "values must lie in [0, Sq=5]"),
    (False, 2, 1, 6, "values must lie in [0, Sq=5]"),
    (True, 2, 1, 2, "LTS <= LTE"),  # LTS=5 > LTE=2
    (False, 4, 1, 2, "LTS <= LTE"),
    (False, 4, 2, 4, "UTS <= UTE"),  # UTS=4 > UTE=0
])
def test_validate_value_errors_name_the_column(causal, c, k, value, match):
    t = _ok(c, causal)
    t[1, 2, 3, k] = value
    t[1, 2, 4, k] = value  # a later bad column must not be the one reported
    with pytest.raises(ValueError, match=re.escape(match)) as e:
        validate(t, causal, 5)
    assert "batch 1, head 2, column 3" in str(e.value)
    validate(t, causal, 5, check_values=False)  # the structural checks alone pass


def test_validate_sq_defaults_to_sk_and_can_differ():
    t = _ok(1, True, sk=5)
    t[..., 0] = 7
    with pytest.raises(ValueError):
        validate(t, True)
    validate(t, True, 7)


# ---------------------------------------------------------------- from_dense

@st.composite
def startend(draw, causal=None, c=None):
    """A random valid (causal, C, Sq, tensor) with intervals that may be empty or overlapping."""
    causal = draw(st.booleans()) if causal is None else causal
    c = draw(st.sampled_from(ALLOWED_C[causal])) if c is None else c
    b, h, sk, sq = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 12)), draw(st.integers(1, 12))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randint(0, sq + 1, (b, h, sk, c), generator=g)
    if c in (2, 4) and (causal or c == 4):
        lo, hi = x[..., :2].min(-1).values, x[..., :2].max(-1).values
        x[..., 0], x[..., 1] = lo, hi  # LTS <= LTE
    if c == 4:
        x[..., 2], x[..., 3] = x[..., 2:].min(-1).values, x[..., 2:].max(-1).values  # UTS <= UTE
    return causal, c, sq, x.to(torch.int32)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(startend())
def test_from_dense_round_trip(case):
    causal, c, sq, t = case
    dense = to_dense(t, causal, sq)
    back = from_dense(dense, causal)
    validate(back, causal, sq)
    assert back.shape[:3] == t.shape[:3] and back.shape[3] <= c
    assert torch.equal(to_dense(back, causal, sq), dense)
    assert torch.equal(to_dense(from_dense(dense, causal, num_columns=c), causal, sq), dense)


@settings(max_examples=100, deadline=None)
@given(startend(c=1, causal=True) | startend(c=2, causal=False))
def test_from_dense_picks_the_smallest_c(case):
    causal, c, sq, t = case
    assert from_dense(to_dense(t, causal, sq), causal).shape[-1] == c


def test_from_dense_reproduces_spec_global_sliding_window():
    m = masks.global_sliding_window(10, 2, 2)
    assert torch.equal(from_dense(to_dense(m, False), False), m)


def _column_ok(col_mask, causal, c, j, sq, sk):
    """Independent per-column oracle: can C express this column (list of bools, True = attends)?"""
    d = j - (sk - sq)  # first row that the causal flag lets see key j
    if causal and any(col_mask[r] for r in range(sq) if r < d):
        return False
    rows = [r for r in range(sq) if not col_mask[r] and (not causal or r >= d)]
    runs = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    if causal:
        return len(runs) == 0 or len(runs) == 1 and (c == 2 or runs[0][1] == sq)
    if c == 4:
        return len(runs) <= 2
    return all(a == 0 or b == sq for a, b in runs) and (len(runs) < 2 or runs[0][0] == 0 and runs[-1][1] == sq)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(startend(), st.integers(0, 2**31), st.integers(0, 4))
def test_from_dense_arbitrary_masks(case, seed, flips):
    """Flip a few pairs of a representable mask: either it round-trips or the error names the
    first column that the independent oracle says cannot be expressed."""
    causal, c, sq, t = case
    dense = to_dense(t, causal, sq).clone()
    g = torch.Generator().manual_seed(seed)
    for _ in range(flips):
        idx = tuple(int(torch.randint(0, n, (1,), generator=g)) for n in dense.shape)
        dense[idx] = ~dense[idx]
    bsz, h, _, sk = dense.shape
    bad = [(b, hh, j) for b in range(bsz) for hh in range(h) for j in range(sk)
           if not _column_ok(dense[b, hh, :, j].tolist(), causal, max(ALLOWED_C[causal]), j, sq, sk)]
    if not bad:
        assert torch.equal(to_dense(from_dense(dense, causal), causal, sq), dense)
    else:
        b, hh, j = bad[0]
        with pytest.raises(ValueError, match=re.escape(f"batch {b}, head {hh}, column {j}")):
            from_dense(dense, causal)
    # A fixed C: the C=1 / non-causal C=2 oracle decides just as well.
    c_small = min(ALLOWED_C[causal])
    bad_small = [(b, hh, j) for b in range(bsz) for hh in range(h) for j in range(sk)
                 if not _column_ok(dense[b, hh, :, j].tolist(), causal, c_small, j, sq, sk)]
    if bad_small:
        with pytest.raises(ValueError, match=re.escape("batch {}, head {}, column {}".format(*bad_small[0]))):
            from_dense(dense, causal, num_columns=c_small)
    else:
        assert from_dense(dense, causal, num_columns=c_small).shape[-1] == c_small


def test_from_dense_errors():
    m = torch.ones(6, 6, dtype=torch.bool)
    m[[1, 3, 5], 2] = False  # column 2: masked rows form 3 runs
    with pytest.raises(ValueError, match=r"column 2: its masked rows form 3 run\(s\) \[1, 2\), \[3, 4\), \[5, 6\)"):
        from_dense(m, False)
    with pytest.raises(ValueError, match="column 1: it is attended by row 0, above the causal diagonal"):
        from_dense(torch.ones(4, 4, dtype=torch.bool), True)
    with pytest.raises(ValueError, match="torch.bool"):
        from_dense(torch.ones(4, 4), False)
    with pytest.raises(ValueError, match="shape"):
        from_dense(torch.ones(4, 4, 4, dtype=torch.bool), False)
    with pytest.raises(ValueError, match="C=1 columns"):
        from_dense(torch.ones(4, 4, dtype=torch.bool), False, num_columns=1)
    # A 2-D mask gives [1, 1, Sk, C]; non-square shapes keep Sk from the mask.
    assert from_dense(torch.ones(3, 5, dtype=torch.bool), False).shape == (1, 1, 5, 2)


# ---------------------------------------------------------------- windows

def _window_dense(left, right, sq, sk, causal):
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    off = sk - sq
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        right = 0
    if left >= 0:
        ok &= j >= i + off - left
    if right >= 0:
        ok &= j <= i + off + right
    return ok


@settings(max_examples=300, deadline=None)
@given(st.integers(-1, 6), st.integers(-1, 6), st.integers(1, 12), st.integers(1, 12), st.booleans())
def test_window_to_startend(left, right, sq, sk, causal):
    w = window_to_startend((left, right), sq, sk, causal, batch_size=2)
    assert w.dtype == torch.int32 and w.shape == (2, 1, sk, 1 if causal else 2)
    validate(w, causal, sq)
    assert torch.equal(to_dense(w, causal, sq)[1, 0], _window_dense(left, right, sq, sk, causal))


def test_window_to_startend_known_values():
    # flash-attn window (2, 0) is the sliding window 3 of docs/format.md.
    assert window_to_startend((2, 0), 10, 10, True)[0, 0, :, 0].tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 10, 10]
    with pytest.raises(ValueError, match="window_size"):
        window_to_startend((-2, 0), 4, 4, True)
    with pytest.raises(ValueError, match="window_size"):
        window_to_startend(3, 4, 4, True)
    with pytest.raises(ValueError, match="seqlen_q"):
        window_to_startend((1, 1), 0, 4, False)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(startend(), st.integers(-1, 5), st.integers(-1, 5))
def test_merge_window(case, left, right):
    causal, c, sq, t = case
    sk = t.shape[2]
    want = to_dense(t, causal, sq) & _window_dense(left, right, sq, sk, causal)
    try:
        got = merge_window(t, causal, (left, right), sq)
    except ValueError as e:
        # Only the two general forms may refuse, and only when the intersection truly needs more.
        assert (causal, c) in ((True, 2), (False, 4))
        b, h, j = (int(x) for x in re.search(r"batch (\d+), head (\d+), column (\d+)", str(e)).groups())
        assert not _column_ok(want[b, h, :, j].tolist(), causal, c, j, sq, sk)
        with pytest.raises(ValueError):
            from_dense(want, causal, num_columns=c)
        return
    assert got.dtype == torch.int32 and got.shape == t.shape
    validate(got, causal, sq)
    assert torch.equal(to_dense(got, causal, sq), want)
    if causal and c == 1:  # the documented closed forms
        assert torch.equal(got, torch.minimum(t, window_to_startend((left, right), sq, sk, True)))
    if not causal and c == 2:
        w = window_to_startend((left, right), sq, sk, False)
        assert torch.equal(got[..., 0], torch.minimum(t[..., 0], w[..., 0]))
        assert torch.equal(got[..., 1], torch.maximum(t[..., 1], w[..., 1]))


def test_merge_window_none_and_errors():
    assert torch.equal(merge_window(None, True, (2, 0), 10), masks.sliding_window(10, 3))
    assert merge_window(None, False, (1, 1), 4, seqlen_k=6).shape == (1, 1, 6, 2)
    # Causal C=2: rows [1, 2) masked in column 0, the window masks [4, 6): two separate runs.
    t = torch.tensor([[1, 2], [6, 6], [6, 6], [6, 6], [6, 6], [6, 6]], dtype=torch.int32).view(1, 1, 6, 2)
    with pytest.raises(ValueError, match="batch 0, head 0, column 0"):
        merge_window(t, True, (3, 0), 6)
    with pytest.raises(ValueError, match="seqlen_k"):
        merge_window(t, True, (3, 0), 6, seqlen_k=5)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4).flatmap(lambda c: st.tuples(st.just(c), startend(causal=True))), st.integers(0, 2**31))
def test_merge_chunks(case, seed):
    """Against the definition: a token sees the earlier tokens of its chunk (chunk_size positions from
    its document's position 0), on top of the mask; C=2 refuses only what it cannot express."""
    chunk, (_, c, _, t) = case
    s = t.shape[2]
    t = t.clamp(max=s)  # Sq = Sk here
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(s, generator=g)[:int(torch.randint(0, 3, (1,), generator=g))].tolist()
    starts = torch.zeros(s, dtype=torch.bool)
    starts[[0] + cuts] = True
    pos = torch.arange(s) - torch.where(starts, torch.arange(s), 0).cummax(0).values  # restarts at each cut
    rows, cols = torch.arange(s)[:, None], torch.arange(s)[None]
    same_chunk = (rows - pos[:, None] % chunk <= cols) & (cols <= rows)  # from the row's chunk start to the row
    want = to_dense(t, True, s) & same_chunk
    try:
        got = masks.merge_chunks(t, chunk, s, pos)
    except ValueError as e:
        assert c == 2
        b, h, j = (int(x) for x in re.search(r"batch (\d+), head (\d+), column (\d+)", str(e)).groups())
        assert not _column_ok(want[b, h, :, j].tolist(), True, c, j, s, s)
        return
    validate(got, True, s)
    assert torch.equal(to_dense(got, True, s), want)


def test_merge_chunks_none_and_errors():
    pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6])
    assert masks.merge_chunks(None, 3, 12, pos).flatten().tolist() == [3, 3, 3, 5, 5, 8, 8, 8, 11, 11, 11, 12]
    assert masks.merge_chunks(None, 4, 6).flatten().tolist() == [4, 4, 4, 4, 6, 6]
    with pytest.raises(ValueError, match="chunk_size"):
        masks.merge_chunks(None, 0, 6)
    with pytest.raises(ValueError, match="position_ids has 5 tokens"):
        masks.merge_chunks(None, 2, 6, torch.arange(5))
    t = masks.causal_document(6, [3, 3])  # int32 [1, 1, 6, 1]
    with pytest.raises(ValueError, match="Sk=6, expected seqlen=8"):
        masks.merge_chunks(t, 2, 8)
    with pytest.raises(ValueError, match="batch 2 but position_ids 3"):
        masks.merge_chunks(t.expand(2, -1, -1, -1), 2, 6, torch.arange(6).expand(3, -1))
    assert masks.merge_chunks(t, 2, 6, torch.arange(6).expand(2, -1)).shape == (2, 1, 6, 1)  # a mask of batch 1


# ---------------------------------------------------------------- packed sequences

@st.composite
def doc_lens(draw, s):
    cuts = sorted(draw(st.lists(st.integers(0, s), max_size=6)))
    pts = [0] + cuts + [s]
    return [b - a for a, b in zip(pts, pts[1:])]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 20).flatmap(lambda s: st.tuples(st.just(s), doc_lens(s), st.integers(0, 5))), st.booleans())
def test_from_cu_seqlens_matches_document_builders(case, causal):
    s, lens, extra = case
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    build = masks.causal_document if causal else masks.document
    got = masks.from_cu_seqlens(cu, causal=causal, seqlen=s + extra)  # extra: a padding tail
    assert torch.equal(got, build(s + extra, lens))
    if extra == 0:
        assert torch.equal(masks.from_cu_seqlens(cu, causal=causal), build(s, lens))


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 20).flatmap(lambda s: st.lists(doc_lens(s), min_size=1, max_size=3).map(lambda x: (s, x))),
       st.booleans())
def test_from_position_ids_matches_document_builders(case, causal):
    s, per = case
    pos = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in per])
    build = masks.causal_document if causal else masks.document
    assert torch.equal(masks.from_position_ids(pos, causal=causal), build(s, [[n for n in x if n] for x in per]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-2, 6), min_size=1, max_size=16), st.booleans())
def test_from_position_ids_general_restarts(pos, causal):
    """A document starts where the position does not grow by exactly 1 (Python oracle)."""
    starts = [t for t in range(len(pos)) if t == 0 or pos[t] != pos[t - 1] + 1]
    lens = [b - a for a, b in zip(starts, starts[1:] + [len(pos)])]
    build = masks.causal_document if causal else masks.document
    got = masks.from_position_ids(torch.tensor([pos]), causal=causal)
    assert torch.equal(got, build(len(pos), lens))


def test_packed_errors_and_examples():
    assert masks.from_position_ids(torch.tensor([0, 1, 2, 0, 1]))[0, 0, :, 0].tolist() == [3, 3, 3, 5, 5]
    for cu, kw, match in [([1, 3], {}, "start at 0"), ([0, 3, 2], {}, "non-decreasing"),
                          ([0, 3], {"seqlen": 2}, "seqlen"), ([[0, 3]], {}, "1-D"),
                          (torch.tensor([0.0, 3.0]), {}, "integer")]:
        with pytest.raises(ValueError, match=match):
            masks.from_cu_seqlens(torch.as_tensor(cu), **kw)
    with pytest.raises(ValueError, match="integer tensor"):
        masks.from_position_ids(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="integer tensor"):
        masks.from_position_ids(torch.zeros(1, 2, 3, dtype=torch.long))
