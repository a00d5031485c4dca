"""One rule for the mask tensor at every entry point: int32 ``[B, Hm, Sk, C]`` with ``B`` equal to
the inputs' batch (no dtype conversion, no broadcasting), checked by ``masks.format.check_tensor``."""
import pytest
import torch

import masks
from flashmask import FlashMaskAttention, FlashMaskSelfAttention, flashmask_attention
from flashmask import distributed as fmd

B, S, HQ, HK, D = 2, 6, 4, 2, 8
GOOD = masks.causal_document(S, [3, 3], batch_size=B)  # int32 [2, 1, 6, 1]

# (what is wrong, the mask, the message every entry point gives, after the argument's name)
BAD = [
    ("int64", GOOD.long(), r"must be torch\.int32, got torch\.int64"),
    ("float", GOOD.float(), r"must be torch\.int32, got torch\.float32"),
    ("batch 1 for a batch of 2", GOOD[:1], r"has batch 1 but the inputs have batch 2"),
]


def _qkv():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, S, HQ, D, generator=g), torch.randn(B, S, HK, D, generator=g),
            torch.randn(B, S, HK, D, generator=g))


def _hf():
    return pytest.importorskip("flashmask.integrations.transformers")


def _causal_module():
    m = torch.nn.Module()
    m.is_causal = True
    return m


def call_flashmask_attention(mask):
    q, k, v = _qkv()
    flashmask_attention(q, k, v, mask, causal=True)


def call_attention_module(mask):
    q, k, v = _qkv()
    FlashMaskAttention(causal=True)(q, k, v, mask)


def call_attention_module_bhsd(mask):
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    FlashMaskAttention(causal=True, layout="bhsd")(q, k, v, mask)


def call_self_attention_module(mask):
    FlashMaskSelfAttention(hidden_size=32, num_heads=HQ, num_kv_heads=HK)(torch.randn(B, S, 32), mask)


def call_transformers_backend(mask):
    fm_hf = _hf()
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    fm_hf.flashmask_attention_forward(_causal_module(), q, k, v, None, **{fm_hf.MASK_KWARG: mask})


def call_shard_packed_batch(mask):
    fmd.shard_packed_batch({"input_ids": torch.zeros(B, S, dtype=torch.long), fmd.MASK_KEY: mask}, mode="ulysses")


def _one_process_plan(mask):
    # make_plan checks the dtype; the batch is only known when the plan meets q (batch 2 here).
    return fmd.make_plan(mask, True, mode="ulysses")


def call_context_parallel_attention(mask):
    q, k, v = _qkv()
    fmd.context_parallel_attention(q, k, v, _one_process_plan(mask))


def call_context_parallel_backend(mask):
    _hf()
    cp_hf = pytest.importorskip("flashmask.distributed.hf")
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    with cp_hf.context_parallel(_one_process_plan(mask)):
        cp_hf.cp_attention_forward(_causal_module(), q, k, v, None)


ENTRY_POINTS = [call_flashmask_attention, call_attention_module, call_attention_module_bhsd,
                call_self_attention_module, call_transformers_backend, call_shard_packed_batch,
                call_context_parallel_attention, call_context_parallel_backend]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__[5:])
@pytest.mark.parametrize("what, mask, match", BAD, ids=[b[0] for b in BAD])
def test_every_entry_point_applies_the_same_rule(entry, what, mask, match):
    with pytest.raises(ValueError, match=r"startend_row_indices " + match):
        entry(mask)


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__[5:])
def test_every_entry_point_takes_a_good_mask(entry):
    entry(GOOD)


@pytest.mark.parametrize("what, mask, match", BAD[:2], ids=[b[0] for b in BAD[:2]])
def test_to_dense_and_make_plan_apply_the_dtype_rule(what, mask, match):
    with pytest.raises(ValueError, match=r"startend_row_indices " + match):
        masks.to_dense(mask, causal=True)
    with pytest.raises(ValueError, match=r"startend_row_indices " + match):
        fmd.make_plan(mask, True, mode="ulysses")
    with pytest.raises(ValueError, match=r"startend_row_indices " + match):
        masks.validate(mask, True)


def test_check_tensor_names_the_argument_and_the_fix():
    with pytest.raises(ValueError, match=r"my_mask has batch 1 but the inputs have batch 3: .*expand\(3, -1, -1, -1\)"):
        masks.check_tensor(GOOD[:1], batch_size=3, name="my_mask")
    with pytest.raises(ValueError, match=r"my_mask must have 4 dimensions \[B, Hm, Sk, C\], got shape \(6, 1\)"):
        masks.check_tensor(GOOD[0, 0], name="my_mask")
    with pytest.raises(TypeError, match="my_mask must be a torch.Tensor, got list"):
        masks.check_tensor([1, 2], name="my_mask")
