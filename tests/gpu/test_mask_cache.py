"""The binding's mask metadata cache (csrc/api/mask_cache.*): reuse across layers and backward, no
stale reuse after an in-place change, turning it off (FLASHMASK_MASK_CACHE=0, read once per process,
or the private override), strided masks, CUDA graph capture. GPU only; every call forces
backend="cuda"."""
import os
import subprocess
import sys

import pytest
import torch

import flashmask
import masks
from flashmask import _cuda
from flashmask.reference import reference_attention
from tests import ROOT
from tests.attn_helpers import assert_close_to_reference, error_bound, low_precision_attention, max_err
from tests.gpu.cases import DTYPES, HEAD_DIMS, make_qkv

pytestmark = pytest.mark.skipif(not _cuda.available(),
                                reason="needs a CUDA device and the built extension with its backward")

B, S, HQ, HK = 2, 1000, 4, 2
DOCS = [400, 300, 300]
DOC2 = slice(400, 700)  # the keys (and rows) of the second document
DOC2_END = 700


def _d():
    return 128 if 128 in HEAD_DIMS else HEAD_DIMS[-1]


def _dtype():
    return torch.bfloat16 if torch.bfloat16 in DTYPES else DTYPES[0]


@pytest.fixture(autouse=True)
def fresh_cache():
    # The cache on, whatever FLASHMASK_MASK_CACHE said when the process started.
    with _cuda._overrides(mask_cache=1):
        _cuda.clear_mask_cache()
        yield
        _cuda.clear_mask_cache()


def qkv():
    return make_qkv(B, S, S, HQ, HK, _d(), _dtype())


def attend(q, k, v, mask, causal, deterministic=False):
    out, lse = flashmask.flashmask_attention(q, k, v, mask, causal=causal, return_lse=True, backend="cuda",
                                             deterministic=deterministic)
    return out, lse


def fwd_bwd(q, k, v, mask, causal, dout, deterministic=False):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = attend(*leaves, mask, causal, deterministic)
    grads = torch.autograd.grad((out.float() * dout.float()).sum(), leaves)
    return out.detach(), lse.detach(), grads


def assert_grads_close(grads, q, k, v, mask, causal, dout):
    """The rule of tests/gpu/test_bwd.check_backward: at most 2x the low-precision error plus an epsilon."""
    def ref_grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, _ = fn(*leaves)
        return torch.autograd.grad((out.float() * dout.float()).sum(), leaves)

    ref = ref_grads(lambda a, b, c: reference_attention(a.float(), b.float(), c.float(), mask, causal=causal))
    low = ref_grads(lambda a, b, c: low_precision_attention(a, b, c, mask, causal))
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref, low):
        assert not torch.isnan(g).any(), f"NaN in {name}"
        bound = error_bound(lo, r)
        assert max_err(g, r) <= bound, f"{name} error {max_err(g, r):.3e} > bound {bound:.3e}"


def delta(before):
    hits, misses = _cuda.mask_cache_stats()
    return hits - before[0], misses - before[1]


def with_doc2_lts(mask, lts):
    """The same mask with LTS = lts on the keys of the second document. lts = 0 masks them for every
    row, so the rows of that document (which see only those keys) become empty: the kernels would
    give them output with the old mask's stale bounds. lts = DOC2_END restores the document mask."""
    new = mask.clone()
    new[:, :, DOC2, 0] = lts  # causal C=1, and non-causal C=2 (LTS, UTE)
    return new


def without_doc2(mask):
    return with_doc2_lts(mask, 0)


def assert_doc2_rows_empty(out, lse):
    assert torch.isinf(lse[:, :, DOC2]).all() and (out[:, DOC2] == 0).all()


def test_layers_and_backward_reuse_the_metadata():
    mask = masks.causal_document(S, DOCS, batch_size=B, device="cuda")
    layers = [qkv() for _ in range(3)]
    douts = [torch.randn_like(q) for q, _, _ in layers]

    def step():
        leaves = [[t.detach().clone().requires_grad_() for t in x] for x in layers]
        outs = [attend(*x, mask, True, deterministic=True) for x in leaves]
        fwd_stats = _cuda.mask_cache_stats()
        loss = sum((o.float() * d.float()).sum() for (o, _), d in zip(outs, douts))
        grads = torch.autograd.grad(loss, [t for x in leaves for t in x])
        return [(o.detach(), lse.detach()) for o, lse in outs], grads, fwd_stats

    outs, grads, fwd_stats = step()
    assert fwd_stats == (2, 1)  # the first forward computes, the next layers reuse
    hits, misses = _cuda.mask_cache_stats()
    # Three backwards: the first one computes bounds for its own key block width when that differs
    # from the forward's; the other two reuse them.
    assert hits + misses == 6 and misses in (1, 2) and hits >= 4
    before = _cuda.mask_cache_stats()
    outs2, grads2, _ = step()
    assert delta(before) == (6, 0)  # a second step with the same mask computes nothing

    for (out, lse), (q, k, v) in zip(outs2, layers):
        assert_close_to_reference(out, lse, q, k, v, mask, True)
    assert_grads_close(grads2[:3], *layers[0], mask, True, douts[0])
    # The cached path gives the bits of the uncached one (deterministic backward).
    with _cuda._overrides(mask_cache=0):
        outs3, grads3, _ = step()
    for (o2, l2), (o3, l3) in zip(outs2, outs3):
        assert torch.equal(o2, o3) and torch.equal(l2, l3)
    for g2, g3 in zip(grads2, grads3):
        assert torch.equal(g2, g3)


@pytest.mark.parametrize("with_mask", [False, True])
def test_windowed_layers_reuse_the_metadata(with_mask):
    # window_size builds the windowed mask once per mask and window (flashmask/attention.py), so the
    # layers of a step, with or without a mask of their own, pass the kernels one tensor.
    flashmask.attention._windowed.clear()
    mask = masks.causal_document(S, DOCS, batch_size=B, device="cuda") if with_mask else None
    layers = [qkv() for _ in range(3)]
    outs = [flashmask.flashmask_attention(*x, mask, causal=True, window_size=(200, 0), return_lse=True,
                                          backend="cuda") for x in layers]
    assert _cuda.mask_cache_stats() == (2, 1)
    windowed = masks.merge_window(mask, True, (200, 0), S) if with_mask else \
        masks.window_to_startend((200, 0), S, S, True, batch_size=B, device="cuda")
    for (out, lse), (q, k, v) in zip(outs, layers):
        assert_close_to_reference(out, lse, q, k, v, windowed, True)


@pytest.mark.parametrize("change", ["copy_", "setitem", "earlier_view"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("direction", ["mask_out", "unmask"])
def test_in_place_change_invalidates(direction, change, causal):
    # mask_out: stale bounds would let the rows of the second document see keys they no longer may
    # (the forward shows it); unmask: stale bounds would skip tiles they now must visit (the rows
    # stay empty and their gradients zero).
    normal = (masks.causal_document if causal else masks.document)(S, DOCS, batch_size=B, device="cuda")
    lts = 0 if direction == "mask_out" else DOC2_END
    mask = normal if direction == "mask_out" else without_doc2(normal)
    new = with_doc2_lts(mask, lts)
    view = mask[:, :, DOC2, 0]  # a view taken before the calls: it shares the mask's version counter
    q, k, v = qkv()
    dout = torch.randn_like(q)
    fwd_bwd(q, k, v, mask, causal, dout)  # fills the forward's and the backward's entries
    fwd_bwd(q, k, v, mask, causal, dout)
    before = _cuda.mask_cache_stats()
    if change == "copy_":
        mask.copy_(new)
    elif change == "setitem":
        mask[:, :, DOC2, 0] = lts
    else:
        view.fill_(lts)
    assert torch.equal(mask, new)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = attend(*leaves, mask, causal)
    assert delta(before) == (0, 1)
    grads = torch.autograd.grad((out.float() * dout.float()).sum(), leaves)
    # The backward finds the new entry (a hit when its key block width is the forward's), never the old one.
    assert sum(delta(before)) == 2
    out, lse = out.detach(), lse.detach()
    if direction == "mask_out":
        assert_doc2_rows_empty(out, lse)
    else:
        assert torch.isfinite(lse[:, :, DOC2]).all()
    assert_close_to_reference(out, lse, q, k, v, new, causal)
    assert_grads_close(grads, q, k, v, new, causal, dout)


def test_new_tensor_with_the_same_values_misses():
    mask = masks.causal_document(S, DOCS, batch_size=B, device="cuda")
    q, k, v = qkv()
    out, lse = attend(q, k, v, mask, True)
    twin = mask.clone()
    before = _cuda.mask_cache_stats()
    out2, lse2 = attend(q, k, v, twin, True)
    assert delta(before) == (0, 1)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_dropped_mask_is_not_reused_at_the_same_address():
    # A mask freed and a new one allocated (the caching allocator likely hands out the same
    # address): the new one must not see the old one's metadata.
    q, k, v = qkv()
    mask = masks.causal_document(S, DOCS, batch_size=B, device="cuda")
    attend(q, k, v, mask, True)
    new_values = without_doc2(mask)
    del mask
    mask = torch.empty_like(new_values).copy_(new_values)
    del new_values
    before = _cuda.mask_cache_stats()
    out, lse = attend(q, k, v, mask, True)
    assert delta(before) == (0, 1)
    assert_doc2_rows_empty(out, lse)
    assert_close_to_reference(out, lse, q, k, v, mask, True)


def test_override_turns_the_cache_off():
    mask = masks.document(S, DOCS, batch_size=B, device="cuda")
    q, k, v = qkv()
    dout = torch.randn_like(q)
    with _cuda._overrides(mask_cache=0):
        out, lse, grads = fwd_bwd(q, k, v, mask, False, dout)
        fwd_bwd(q, k, v, mask, False, dout)
    assert _cuda.mask_cache_stats() == (0, 0)
    assert_close_to_reference(out, lse, q, k, v, mask, False)
    assert_grads_close(grads, q, k, v, mask, False, dout)
    attend(q, k, v, mask, False)
    attend(q, k, v, mask, False)
    assert _cuda.mask_cache_stats() == (1, 1)


_ENV_SCRIPT = """
import os
import torch
import flashmask
import masks
from flashmask import _cuda
mask = masks.document({s}, {docs}, batch_size={b}, device="cuda")
q = torch.randn({b}, {s}, {hq}, {d}, device="cuda", dtype=torch.{dtype})
k = torch.randn({b}, {s}, {hk}, {d}, device="cuda", dtype=torch.{dtype})
for _ in range(2):
    flashmask.flashmask_attention(q, k, k, mask, causal=False, backend="cuda")
# Read once, at the first call with a mask: changing it now changes nothing.
os.environ["FLASHMASK_MASK_CACHE"] = "1" if os.environ.get("FLASHMASK_MASK_CACHE") == "0" else "0"
flashmask.flashmask_attention(q, k, k, mask, causal=False, backend="cuda")
print(*_cuda.mask_cache_stats())
"""


@pytest.mark.parametrize("value,stats", [("0", "0 0"), ("off", "0 0"), (None, "2 1"), ("1", "2 1")])
def test_environment_variable(value, stats):
    """FLASHMASK_MASK_CACHE is read once per process, so each value gets a fresh interpreter."""
    script = _ENV_SCRIPT.format(s=S, docs=DOCS, b=B, hq=HQ, hk=HK, d=_d(), dtype=str(_dtype()).replace("torch.", ""))
    root = ROOT  # `python -c` imports from its cwd
    env = {k: v for k, v in os.environ.items() if k != "FLASHMASK_MASK_CACHE"}
    if value is not None:
        env["FLASHMASK_MASK_CACHE"] = value
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == stats


def _strided(mask, layout):
    """A non-contiguous tensor with the values of `mask` [B, 1, S, C], and the tensor to change in place."""
    b, h, s, c = mask.shape
    if layout == "permuted":
        t = torch.empty(b, h, c, s, dtype=mask.dtype, device=mask.device).permute(0, 1, 3, 2)
    elif layout == "every_other_column":
        t = torch.zeros(b, h, 2 * s, c, dtype=mask.dtype, device=mask.device)[:, :, ::2]
    else:  # "expanded_batch": one row broadcast over the batch (stride 0)
        base = mask[:1].clone()
        return base.expand(b, h, s, c), base
    t.copy_(mask)
    return t, t


@pytest.mark.parametrize("layout", ["permuted", "every_other_column", "expanded_batch"])
def test_non_contiguous_mask(layout):
    mask, target = _strided(masks.document(S, DOCS, batch_size=B, device="cuda"), layout)
    assert not mask.is_contiguous()
    q, k, v = qkv()
    dout = torch.randn_like(q)
    out, lse, grads = fwd_bwd(q, k, v, mask, False, dout)
    assert_close_to_reference(out, lse, q, k, v, mask.contiguous(), False)
    assert_grads_close(grads, q, k, v, mask.contiguous(), False, dout)
    before = _cuda.mask_cache_stats()
    out2, lse2 = attend(q, k, v, mask, False)
    assert delta(before) == (1, 0)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    # The entry holds a contiguous copy: a change through the strided tensor must not reuse it.
    target[:, :, DOC2, 0] = 0
    out3, lse3 = attend(q, k, v, mask, False)
    assert delta(before) == (1, 1)
    assert_doc2_rows_empty(out3, lse3)
    assert_close_to_reference(out3, lse3, q, k, v, mask.contiguous(), False)


def test_cuda_graph_capture_skips_the_cache():
    mask = masks.causal_document(S, DOCS, batch_size=B, device="cuda")
    q, k, v = qkv()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
        attend(q, k, v, mask, True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    before = _cuda.mask_cache_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = attend(q, k, v, mask, True)
    assert delta(before) == (0, 0)  # neither looked up nor stored while capturing
    # The graph computes the metadata itself at every replay: a changed mask is seen.
    mask[:, :, DOC2, 0] = 0
    graph.replay()
    torch.cuda.synchronize()
    assert_doc2_rows_empty(out, lse)
    assert_close_to_reference(out, lse, q, k, v, mask, True)
