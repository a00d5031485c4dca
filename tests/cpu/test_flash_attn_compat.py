"""flash-attn's ``flash_attn_func`` / ``flash_attn_varlen_func`` on flashmask (flashmask/flash_attn.py)
and ``masks.from_cu_seqlens_qk``, on the reference path: against an independent per-document oracle
written from flash-attn's definition (bottom-right alignment within each document), forward and
gradients; the errors; the kept masks."""
import doctest
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashmask
import masks
from flashmask import flash_attn as fa
from flashmask.flash_attn import flash_attn_func, flash_attn_varlen_func


def kept_mask():
    """The mask of the latest varlen call."""
    return next(reversed(fa._masks._values.values()))[0]


def allowed(lq, lk, causal, window):
    """bool [lq, lk]: flash-attn's rule, query r sees key o iff r + lk - lq - left <= o <= r + lk - lq + right."""
    left, right = window
    if causal:
        right = 0
    r = torch.arange(lq)[:, None] + (lk - lq)
    o = torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        ok &= o >= r - left
    if right >= 0:
        ok &= o <= r + right
    return ok


def oracle(q, k, v, cu_q, cu_k, causal, window, scale=None):
    """Each document alone in float64: out [total_q, Hq, Dv] and lse [Hq, total_q] (0 and +inf where a
    query sees no key)."""
    hq, hk = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs, lses = [], []
    for a, b, c, d in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist()):
        qi = q[a:b].double().transpose(0, 1)
        ki = k[c:d].double().repeat_interleave(hq // hk, 1).transpose(0, 1)
        vi = v[c:d].double().repeat_interleave(hq // hk, 1).transpose(0, 1)
        s = (qi @ ki.transpose(1, 2) * scale).masked_fill(~allowed(b - a, d - c, causal, window), -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), torch.zeros_like(s))
        outs.append((p @ vi).transpose(0, 1))
        lses.append(torch.where(torch.isfinite(lse), lse, math.inf))
    return torch.cat(outs), torch.cat(lses, 1)


def packed(lens_q, lens_k, hq=4, hk=2, d=8, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=g)
    k = torch.randn(int(cu_k[-1]), hk, d, generator=g)
    v = torch.randn(int(cu_k[-1]), hk, dv or d, generator=g)
    return q, k, v, cu_q, cu_k


CASES = [  # (query lengths, key lengths): equal documents, longer keys (a cache), longer queries, empty ones
    ([5, 3, 7], [5, 3, 7]),
    ([2, 4, 1], [9, 4, 6]),
    ([6, 3], [2, 3]),
    ([3, 0, 4, 2], [3, 5, 0, 2]),
]
WINDOWS = [(-1, -1), (2, 0), (1, 3), (0, 0), (-1, 1)]


@pytest.mark.parametrize("lens", CASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", WINDOWS)
def test_varlen_matches_each_document_alone(lens, causal, window):
    q, k, v, cu_q, cu_k = packed(*lens, dv=6)
    out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens[0]), max(lens[1]), causal=causal,
                                             window_size=window, return_attn_probs=True)
    want_out, want_lse = oracle(q, k, v, cu_q, cu_k, causal, window)
    assert out.shape == (q.shape[0], 4, 6) and lse.shape == (4, q.shape[0]) and probs is None
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens", [CASES[0], CASES[1]])
def test_varlen_gradients_and_options(lens):
    """Gradients of q, k and v against the oracle's, with a softmax scale; softcap as the reference has it."""
    q, k, v, cu_q, cu_k = packed(*lens, seed=1)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, 9, 9, softmax_scale=0.3, causal=True, window_size=(3, 0))
    want = oracle(*leaves, cu_q, cu_k, True, (3, 0), scale=0.3)[0]
    dout = torch.randn_like(want)
    got = torch.autograd.grad((out * dout).sum(), leaves)
    ref = torch.autograd.grad((want * dout).sum(), leaves)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-9, rtol=1e-7)
    capped = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True, softcap=2.0)
    direct = flashmask.flashmask_attention(q[None], k[None], v[None], kept_mask(),
                                           causal=lens[0] == lens[1], softcap=2.0)[0]
    torch.testing.assert_close(capped, direct)


def test_flash_attn_func_matches_the_window_rule():
    """Batched, Sq != Sk (bottom-right), GQA, windows with and without causal."""
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 5, 4, 8, generator=g), torch.randn(2, 9, 2, 8, generator=g), torch.randn(2, 9, 2, 8,
                                                                                                        generator=g)
    cu_q, cu_k = torch.tensor([0, 5]), torch.tensor([0, 9])
    for causal in (True, False):
        for window in WINDOWS:
            out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
            for b in range(2):
                want_out, want_lse = oracle(q[b], k[b], v[b], cu_q, cu_k, causal, window)
                torch.testing.assert_close(out[b].double(), want_out, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(lse[b].double(), want_lse, atol=1e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(docs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=5),
       causal=st.booleans(), left=st.integers(-1, 4), right=st.integers(-1, 4))
def test_from_cu_seqlens_qk_is_the_rule_document_by_document(docs, causal, left, right):
    lens_q, lens_k = [a for a, _ in docs], [b for _, b in docs]
    if sum(lens_q) == 0 or sum(lens_k) == 0:
        return
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()])
    mask = masks.from_cu_seqlens_qk(cu_q, cu_k, causal, (left, right))
    assert mask.dtype == torch.int32 and mask.shape == (1, 1, sum(lens_k), 2)
    want = torch.zeros(sum(lens_q), sum(lens_k), dtype=torch.bool)
    for a, b, c, d in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist()):
        want[a:b, c:d] = allowed(b - a, d - c, causal, (left, right))
    assert torch.equal(masks.to_dense(mask, False, sum(lens_q))[0, 0], want)


def test_equal_documents_take_the_compact_causal_form():
    q, k, v, cu_q, cu_k = packed([4, 4], [4, 4])
    fa._masks.clear()
    flash_attn_varlen_func(q, k, v, cu_q, cu_k.clone(), 4, 4, causal=True)
    mask = kept_mask()
    assert torch.equal(mask, masks.from_cu_seqlens(cu_q, True))


def test_the_mask_is_built_once_per_cu_seqlens_and_again_after_an_in_place_change(monkeypatch):
    calls = []
    build = masks.from_cu_seqlens_qk
    monkeypatch.setattr(masks, "from_cu_seqlens_qk", lambda *a, **kw: calls.append(1) or build(*a, **kw))
    q, k, v, cu_q, cu_k = packed([3, 4], [5, 4])
    fa._masks.clear()
    first = [flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, causal=True) for _ in range(3)]
    assert len(calls) == 1 and all(torch.equal(first[0], o) for o in first)
    cu_q[1] = 2  # documents of 2 and 5 queries now
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)
    assert len(calls) == 2
    torch.testing.assert_close(out.double(), oracle(q, k, v, cu_q, cu_k, True, (-1, -1))[0], atol=1e-5, rtol=1e-5)
    for i in range(fa._masks.size + 2):  # a bounded cache: the oldest entries go
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True, window_size=(i, 0))
    assert len(fa._masks) == fa._masks.size


def test_errors_name_the_argument():
    q, k, v, cu_q, cu_k = packed([3, 4], [5, 4])
    call = lambda **kw: flash_attn_varlen_func(**{**dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,  # noqa: E731
                                                         max_seqlen_q=4, max_seqlen_k=5, causal=True), **kw})
    with pytest.raises(ValueError, match="dropout_p=0.1"):
        call(dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        call(alibi_slopes=torch.ones(4))
    with pytest.raises(NotImplementedError, match="block_table"):
        call(block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"max_seqlen_q must be an int >= the longest document \(4 tokens\), got 3"):
        call(max_seqlen_q=3)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        call(max_seqlen_k=5.0)
    with pytest.raises(ValueError, match=r"q must be a tensor \[total_tokens, heads, head_dim\], got \(1, 7, 4, 8\)"):
        call(q=q[None])
    with pytest.raises(ValueError, match=r"cu_seqlens_q must end at the number of tokens B \* S = 7"):
        call(cu_seqlens_q=torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match="same documents, got 2 and 1"):
        call(cu_seqlens_k=torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="window_size"):
        call(window_size=(-2, 0))
    with pytest.raises(TypeError, match="causal must be a bool"):
        call(causal="yes")
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q[None], k[None], v[None], dropout_p=0.5)


def test_module_example_and_exports():
    res = doctest.testmod(fa, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0
    assert flashmask.flash_attn_varlen_func is flash_attn_varlen_func and flashmask.flash_attn_func is flash_attn_func


def test_under_torch_compile():
    """The mask's build stays out of the graph (one graph break); the attention traces as usual."""
    q, k, v, cu_q, cu_k = packed([3, 4], [5, 4])
    compiled = torch.compile(lambda a, b, c: flash_attn_varlen_func(a, b, c, cu_q, cu_k, 4, 5, causal=True),
                             backend="aot_eager")
    for _ in range(2):
        torch.testing.assert_close(compiled(q, k, v), flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, causal=True))


def test_no_queries_or_no_keys():
    """As flash-attn: an empty result, or zeros where no document has a key."""
    q, k, v, cu_q, cu_k = packed([3, 4], [5, 4])
    out = flash_attn_varlen_func(q, k[:0], v[:0], cu_q, torch.tensor([0, 0, 0]), 4, 0, causal=True)
    assert out.shape == (7, 4, 8) and not out.any()
    out = flash_attn_varlen_func(q[:0], k, v, torch.tensor([0, 0, 0]), cu_k, 0, 5)
    assert out.shape == (0, 4, 8)


def test_from_cu_seqlens_qk_errors_name_the_argument():
    cu = torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match="same documents, got 2 and 1"):
        masks.from_cu_seqlens_qk(cu, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"at least one query and one key, got cu_seqlens_q\[-1\]=4, "
                                         r"cu_seqlens_k\[-1\]=0"):
        masks.from_cu_seqlens_qk(cu, torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        masks.from_cu_seqlens_qk(cu, torch.tensor([0, 3, 1]))
    with pytest.raises(TypeError, match="causal must be a bool"):
        masks.from_cu_seqlens_qk(cu, cu, causal=1)
    with pytest.raises(ValueError, match="window_size must be a pair"):
        masks.from_cu_seqlens_qk(cu, cu, window_size=(1,))
