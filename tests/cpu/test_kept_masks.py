"""Masks kept between calls (flashmask/_memo.py): ``flashmask_attention``'s windowed masks and
``flash_attn_varlen_func``'s document masks are built once per input and window, rebuilt after an
in-place change, never confused between views of one memory, bounded in number."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashmask
import masks
from flashmask import attention
from flashmask import flash_attn as fa
from flashmask._memo import Recent, tensor_key
from flashmask.flash_attn import flash_attn_varlen_func


@pytest.fixture(autouse=True)
def empty():
    attention._windowed.clear()
    fa._masks.clear()
    yield


def qkv(s=12, b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, 2, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def test_recent_keeps_the_newest_and_builds_each_key_once():
    kept, built = Recent(2), []
    for key in "abac":
        kept.get(key, lambda key=key: built.append(key) or key.upper())
    # "a" was used again after "b", so "b" went when "c" came.
    assert built == ["a", "b", "c"] and len(kept) == 2
    assert kept.get("a", lambda: "new") == "A" and kept.get("b", lambda: "new") == "new"


def test_tensor_key_tells_contents_and_views_apart():
    t = torch.arange(8)
    assert tensor_key(t) == tensor_key(t)
    assert tensor_key(t) != tensor_key(t[::2])  # same memory, other elements
    before = tensor_key(t)
    t[0] = 5
    assert tensor_key(t) != before  # the version counter moved
    with torch.inference_mode():
        assert tensor_key(torch.arange(3)) is None
    assert tensor_key(torch.empty(3, device="meta")) is None


def test_windowed_mask_is_built_once_per_mask_and_window():
    q, k, v = qkv()
    doc = masks.causal_document(12, [5, 7])
    first = attention.windowed_mask(doc, (3, 0), True, q, k)
    assert attention.windowed_mask(doc, (3, 0), True, q, k) is first
    assert attention.windowed_mask(doc, (2, 0), True, q, k) is not first
    alone = attention.windowed_mask(None, (3, 0), True, q, k)
    assert attention.windowed_mask(None, (3, 0), True, q, k) is alone
    assert torch.equal(alone, masks.window_to_startend((3, 0), 12, 12, True))
    # Other shapes take their own: the batch (one mask row per sample) and the key length.
    assert attention.windowed_mask(None, (3, 0), True, *qkv(b=2)[:2]).shape[0] == 2
    assert attention.windowed_mask(None, (3, 0), True, q, qkv(s=14)[1]).shape[2] == 14


def test_in_place_change_of_the_mask_rebuilds_the_windowed_one():
    q, k, v = qkv()
    doc = masks.causal_document(12, [5, 7])
    out = flashmask.flashmask_attention(q, k, v, doc, causal=True, window_size=(3, 0))
    doc.copy_(masks.causal_document(12, [8, 4]))
    again = flashmask.flashmask_attention(q, k, v, doc, causal=True, window_size=(3, 0))
    want = flashmask.flashmask_attention(q, k, v, masks.causal_document(12, [8, 4]).clone(), causal=True,
                                         window_size=(3, 0))
    assert not torch.allclose(out, again)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_windowed_masks_are_bounded_and_keep_their_inputs():
    q, k, v = qkv()
    for i in range(attention._windowed.size + 3):
        flashmask.flashmask_attention(q, k, v, masks.causal_document(12, [5, 7]), causal=True, window_size=(i, 0))
    assert len(attention._windowed) == attention._windowed.size
    # Each entry holds the mask it was built from, so that no new tensor takes its address.
    assert all(isinstance(source, torch.Tensor) for _, source in attention._windowed._values.values())


def test_bad_window_raises_before_anything_is_kept():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="window_size must be a pair"):
        flashmask.flashmask_attention(q, k, v, causal=True, window_size=[[1], [2]])
    assert len(attention._windowed) == 0


def test_varlen_views_of_one_memory_are_told_apart():
    """cu[::2] starts at cu's address and ends at the same total: a key of address, version and
    total alone would hand it cu's mask."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(8, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 2, 4, 6, 8])
    halves = cu[::2]  # documents of 4 tokens instead of 2
    fine = flash_attn_varlen_func(q, k, v, cu, cu, 2, 2, causal=True)
    coarse = flash_attn_varlen_func(q, k, v, halves, halves, 4, 4, causal=True)
    want = flashmask.flashmask_attention(q[None], k[None], v[None], masks.causal_document(8, [4, 4]),
                                         causal=True)[0]
    torch.testing.assert_close(coarse, want, rtol=0, atol=0)
    assert not torch.allclose(fine, coarse)


def test_inference_mode_builds_without_keeping():
    """Inference tensors have no version counter to key on: the masks are built on each call (a
    varlen call under torch.inference_mode used to raise reading it)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(7, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    want = flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True, window_size=(2, 0))
    doc = masks.causal_document(7, [4, 3])
    want_window = flashmask.flashmask_attention(q[None], k[None], v[None], doc, causal=True, window_size=(2, 0))
    fa._masks.clear()
    attention._windowed.clear()
    with torch.inference_mode():
        cu_i, doc_i = cu.clone(), doc.clone()
        got = flash_attn_varlen_func(q, k, v, cu_i, cu_i, 4, 4, causal=True, window_size=(2, 0))
        got_window = flashmask.flashmask_attention(q[None], k[None], v[None], doc_i, causal=True, window_size=(2, 0))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_window, want_window, rtol=0, atol=0)
    assert len(fa._masks) == 0 and len(attention._windowed) == 0


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["same", "new", "write", "view"]), st.integers(1, 11),
                                st.integers(0, 4)), min_size=1, max_size=8))
def test_kept_windowed_masks_equal_fresh_ones(steps):
    """Any sequence of calls with the same mask, a new one, one written in place (directly or through
    a view) gives what building the windowed mask afresh gives."""
    attention._windowed.clear()
    q, k, _ = qkv()
    mask = masks.causal_document(12, [5, 7])
    for op, cut, left in steps:
        if op == "new":
            mask = masks.causal_document(12, [cut, 12 - cut])
        elif op == "write":
            mask[..., :cut, 0] = masks.causal_document(12, [cut, 12 - cut])[..., :cut, 0]
        elif op == "view":
            mask = mask[:, :, :, :]  # another tensor on the same memory and version counter
        got = attention.windowed_mask(mask, (left, 0), True, q, k)
        assert torch.equal(got, masks.merge_window(mask.clone(), True, (left, 0), 12))
