"""Non-finite inputs on the kernels (GPU only): a row whose visible scores are all -inf (q holds +inf
against keys of the opposite sign) gives NaN output and LSE, as softmax does, while a row that the
mask hides entirely keeps output 0 and LSE +inf whatever q holds. The kernels tell the two apart by
the mask's per-row key counts (a prefix sum over the columns' visible runs), so the fuzz below
poisons every row and compares the NaN rows with the rows the dense mask lets see a key.

Every test forces a kernel family (every_kernel_family runs it once per family), so that a fallback
to the reference path raises.
"""
import pytest
import torch

import flashmask
from flashmask import _cuda
from flashmask.reference import reference_attention
from tests.attn_helpers import assert_close_to_reference, hidden_rows, hide_rows, random_startend
from tests.gpu import cases as cuda_cases
from tests.gpu.cases import DTYPES, HEAD_DIMS, MODES, arch_of, main_head_dim, pick, poison_allocator, run_kernel

pytestmark = [
    pytest.mark.skipif(not _cuda.available(), reason="needs a CUDA device and the built extension"),
    pytest.mark.usefixtures("every_kernel_family", "seeded_by_test_id"),
]


# (Sq, Sk, mask heads) for Hq = 4, Hk = 2: mask heads 1, Hk and Hq, Sq != Sk, lengths off the tiles.
SHAPES = [(333, 517, 1), (517, 333, 2), (300, 300, 4)]


def poisoned_qkv(b, sq, sk, hq, hk, d, dtype, rows):
    """Random q, k, v with k[..., 0] = -1 and q[:, rows, :, 0] = +inf: the scores of those rows are
    -inf at every key, the others finite."""
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    k[..., 0] = -1.0
    q[:, rows, :, 0] = float("inf")
    return q, k, v


def nan_rows(out, lse):
    """bool [B, Hq, Sq]: the rows whose output is NaN throughout, checked against their LSE."""
    rows = out.isnan().all(-1).transpose(1, 2)
    assert torch.equal(rows, lse.isnan()), "a row's output and LSE disagree on NaN"
    assert not (out.isnan().any(-1).transpose(1, 2) & ~rows).any(), "a row is partly NaN"
    return rows


@pytest.mark.parametrize("causal,c", MODES + [(True, 0), (False, 0)])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_row_poisoned_nan_exactly_where_the_mask_lets_a_row_see_a_key(shape, causal, c):
    """All rows poisoned, random column intervals (overlapping intervals, whole tiles hidden) and a
    band of rows hidden by the mask in batch 0: NaN rows are exactly the rows the dense mask lets see
    a key; the others out 0 and LSE +inf. c = 0: no mask (causal: the rows above the bottom-right
    diagonal when Sq > Sk see nothing)."""
    sq, sk, hm = shape
    i = SHAPES.index(shape) + MODES.index((causal, c)) if c else SHAPES.index(shape)
    mask = None
    if c:
        mask = hide_rows(random_startend(2, hm, sq, sk, causal, c, device="cuda"), causal, sq // 3, sq // 3 + 40)
    d, dtype = pick(HEAD_DIMS, i), pick(DTYPES, i)
    q, k, v = poisoned_qkv(2, sq, sk, 4, 2, d, dtype, slice(None))
    out, lse = run_kernel(q, k, v, mask, causal)
    hidden = hidden_rows(mask, causal, sq, sk, 2, 4, device="cuda")
    assert torch.equal(nan_rows(out, lse), ~hidden)
    assert (out.transpose(1, 2)[hidden] == 0).all()
    assert lse[hidden].isposinf().all()
    if mask is not None:
        assert hidden.any() and (~hidden).any()


@pytest.mark.parametrize("causal,c", MODES)
def test_poisoned_rows_give_nan_and_the_others_do_not_change(causal, c):
    """Some rows poisoned, among them rows the mask hides: those that see keys give NaN as the
    reference does, the hidden ones 0 and +inf, and every other row is what the same call gives
    without the poison (a row's output depends on its own scores only), up to rounding."""
    i = MODES.index((causal, c))
    sq, sk, hm = pick(SHAPES, i)
    mask = hide_rows(random_startend(2, hm, sq, sk, causal, c, device="cuda"), causal, 100, 140)
    rows = torch.tensor([0, 5, 77, 101, 120, 139, 250, sq - 1])
    d, dtype = pick(HEAD_DIMS, i + 1), pick(DTYPES, i)
    q, k, v = poisoned_qkv(2, sq, sk, 4, 2, d, dtype, rows)
    out, lse = run_kernel(q, k, v, mask, causal)
    _, ref_lse = reference_attention(q.float(), k.float(), v.float(), mask, causal=causal)
    assert torch.equal(nan_rows(out, lse), ref_lse.isnan())
    assert ref_lse.isnan().any()
    clean_q = q.clone()
    clean_q[:, rows, :, 0] = 1.0
    clean_out, clean_lse = run_kernel(clean_q, k, v, mask, causal)
    assert_close_to_reference(clean_out, clean_lse, clean_q, k, v, mask, causal)
    untouched = torch.ones(sq, dtype=torch.bool)
    untouched[rows] = False
    # Not bitwise: the SM90 forward takes its rescale decisions per warp (at head dim 64 without the
    # block max), and a NaN row takes part; P then rounds differently to 16 bits (a few ulps).
    torch.testing.assert_close(out[:, untouched], clean_out[:, untouched], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse[..., untouched], clean_lse[..., untouched], atol=1e-4, rtol=1e-5)
    hidden = hidden_rows(mask, causal, sq, sk, 2, 4, device="cuda")
    assert (out.transpose(1, 2)[hidden] == 0).all() and lse[hidden].isposinf().all()


@pytest.mark.parametrize("option", ["softcap", "sinks"])
def test_options_keep_poisoned_rows_finite(option):
    """With soft-capping every score is finite (tanh(-inf) = -1: the row averages its visible values);
    with sinks a row of -inf scores puts all its weight on the sink (out 0, LSE = sink). Both as the
    reference gives them."""
    sq, sk = 300, 420
    mask = random_startend(1, 2, sq, sk, True, 2, device="cuda")
    rows = torch.tensor([3, 64, 65, 299])
    d, dtype = main_head_dim(), DTYPES[-1]
    q, k, v = poisoned_qkv(1, sq, sk, 4, 2, d, dtype, rows)
    kw = {"softcap": 20.0} if option == "softcap" else {"sinks": torch.randn(4, device="cuda")}
    out, lse = run_kernel(q, k, v, mask, True, **kw)
    assert not out.isnan().any() and not lse.isnan().any()
    ref_out, ref_lse = reference_attention(q.float(), k.float(), v.float(), mask, causal=True, **kw)
    torch.testing.assert_close(out[:, rows].float(), ref_out[:, rows], atol=2e-2, rtol=0)
    torch.testing.assert_close(lse[..., rows], ref_lse[..., rows], atol=1e-3, rtol=1e-5)
    if option == "sinks":
        seen = ~hidden_rows(mask, True, sq, sk, 1, 4, device="cuda")[..., rows]
        assert seen.any() and (out[:, rows].transpose(1, 2)[seen] == 0).all()


@pytest.mark.parametrize("num_splits", [3, 8])
def test_split_kv_merge_gives_nan_only_where_no_split_saw_a_finite_score(num_splits):
    """Split-KV, 16 queries against 2000 keys whose first 1000 score -inf for every query (k
    holds +inf where q is -1): rows 0-7 see both halves and stay finite (the reference weighs the -inf
    scores 0, though some splits saw nothing else), rows 8-11 see only the first half and give NaN,
    rows 12-15 see no key and give 0 and +inf."""
    sq, sk = 16, 2000
    first = torch.tensor([12, 16, 0, 0], dtype=torch.int32, device="cuda")  # hides rows [12, 16)
    second = torch.tensor([8, 16, 0, 0], dtype=torch.int32, device="cuda")  # hides rows [8, 16)
    mask = torch.stack([first] * 1000 + [second] * 1000).view(1, 1, sk, 4).expand(2, 1, sk, 4).contiguous()
    q, k, v = poisoned_qkv(2, sq, sk, 4, 2, pick(HEAD_DIMS, num_splits), DTYPES[-1], [])
    q[..., 0] = -1.0
    k[:, :1000, :, 0] = float("inf")
    cuda_cases.skip_unless_backend_serves(q)
    poison_allocator(q.numel() * 64)
    out, lse = _cuda.fwd(q, k, v, mask, False, q.shape[-1] ** -0.5, False, num_splits, arch_of(cuda_cases.BACKEND))
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_attention(q.float(), k.float(), v.float(), mask, causal=False)
    want_nan = torch.zeros(2, 4, sq, dtype=torch.bool, device="cuda")
    want_nan[..., 8:12] = True
    assert torch.equal(ref_lse.isnan(), want_nan)
    assert torch.equal(nan_rows(out, lse), want_nan)
    assert (out[:, 12:] == 0).all() and lse[..., 12:].isposinf().all()
    torch.testing.assert_close(lse[..., :8], ref_lse[..., :8], atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(out[:, :8].float(), ref_out[:, :8], atol=2e-2, rtol=0)


def test_backward_nan_reaches_the_poisoned_rows_of_dq_and_dk_dv():
    """The NaN LSE of a poisoned row makes its dQ NaN, and dK and dV carry NaN, as autograd on the
    reference gives; the other rows' dQ stay finite (hidden rows: 0)."""
    sq, sk = 300, 300
    mask = hide_rows(random_startend(1, 1, sq, sk, True, 1, device="cuda"), True, 280, 300)
    rows = torch.tensor([7, 128, 129, 200])
    d, dtype = main_head_dim(), DTYPES[-1]
    q, k, v = poisoned_qkv(1, sq, sk, 4, 2, d, dtype, rows)
    cuda_cases.skip_unless_backend_serves(q, backward=True)
    dout = torch.randn(1, sq, 4, d, device="cuda", dtype=dtype)

    def grads(fn, *t):
        t = [x.detach().requires_grad_() for x in t]
        fn(*t).backward(dout.to(t[0].dtype))
        return [x.grad for x in t]

    got = grads(lambda a, b, c: flashmask.flashmask_attention(a, b, c, mask, causal=True,
                                                               backend=cuda_cases.BACKEND), q, k, v)
    ref = grads(lambda a, b, c: reference_attention(a, b, c, mask, causal=True)[0], q.float(), k.float(), v.float())
    assert torch.equal(got[0].isnan().any(-1), ref[0].isnan().any(-1))
    assert ref[0].isnan().any()
    hidden = hidden_rows(mask, True, sq, sk, 1, 4, device="cuda").transpose(1, 2)
    assert (got[0][hidden] == 0).all()
    for name, g, r in zip(("dk", "dv"), got[1:], ref[1:]):
        assert g.isnan().any() and r.isnan().any(), name
