"""What the transformers GPU tests share: bf16 packed runs against a float32 oracle of each document
alone. The error of the flashmask run must stay within twice the error of plain bf16 attention on
the separate documents, plus a small epsilon (as attn_helpers.assert_close_to_reference)."""
import torch

from tests.model_zoo import set_impl

VOCAB = 512


def check_close(got, want32, base16, what):
    e_got = (got.float() - want32).abs()
    e_base = (base16.float() - want32).abs()
    assert torch.isfinite(got).all(), what
    assert e_got.max() <= 2 * e_base.max() + 1e-2, (what, float(e_got.max()), float(e_base.max()))
    assert e_got.mean() <= 2 * e_base.mean() + 1e-3, (what, float(e_got.mean()), float(e_base.mean()))


def docs_for(seed, n, lo, hi):
    """n random documents of lo..hi tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g) for _ in range(n)]


def alone(model, seqs, name):
    """The float32 logits of each sequence run alone with attention implementation `name`."""
    set_impl(model, name)
    with torch.no_grad():
        return [model(input_ids=s[None].cuda(), use_cache=False).logits[0].float() for s in seqs]
