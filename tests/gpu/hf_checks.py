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


def check_packed_rows(got, docs, want32, base16, row_len=2048, what=""):
    """The logits ``got`` [rows, row_len, V] of ``docs`` packed by ``PackedSFTCollator(row_len)``, each
    document's span against its own logits alone (``check_close``)."""
    from flashmask.data import pack_sequences

    for r, row in enumerate(pack_sequences([len(d) for d in docs], row_len)):
        col = 0
        for i in row:
            n = len(docs[i])
            check_close(got[r, col:col + n], want32[i], base16[i], f"{what}doc {i}")
            col += n


def docs_for(seed, n, lo, hi):
    """n random documents of lo..hi tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g) for _ in range(n)]


def alone(model, seqs, name):
    """The float32 logits of each sequence run alone with attention implementation `name`."""
    set_impl(model, name)
    with torch.no_grad():
        return [model(input_ids=s[None].cuda(), use_cache=False).logits[0].float() for s in seqs]


def check_packed_sft_gradients(m16, m32, docs, name, baseline, every_parameter=False, after_packed=None,
                               on_grads=None):
    """Every parameter's gradient of a packed SFT loss (bf16 model m16 on backend `name`) against the
    float32 oracle m32 on each document alone: its relative error stays within twice that of bf16
    `baseline` attention on the separate documents. every_parameter: each parameter must get a
    gradient; after_packed() runs after the packed backward, on_grads(model) after each backward."""
    from flashmask.data import PackedSFTCollator

    b = {k: v.cuda() for k, v in PackedSFTCollator(2048)([{"input_ids": d} for d in docs]).items()}
    n_targets = sum(len(d) - 1 for d in docs)

    def grads(model, packed):
        model.zero_grad()
        if packed:
            model(**b, use_cache=False).loss.float().backward()
        else:
            for d in docs:
                x = d[None].cuda()
                (model(input_ids=x, labels=x, use_cache=False).loss.float() * (len(d) - 1) / n_targets).backward()
        if on_grads is not None:
            on_grads(model)
        params = list(model.parameters())
        if every_parameter:
            assert all(p.grad is not None for p in params)
        return torch.cat([p.grad.float().flatten() for p in params if p.grad is not None])

    got = grads(m16, True)
    if after_packed is not None:
        after_packed()
    set_impl(m16, baseline)
    base = grads(m16, False)
    set_impl(m16, name)
    want = grads(m32, False)
    rel = lambda x: float((x - want).norm() / want.norm())  # noqa: E731
    assert torch.isfinite(got).all()
    assert rel(got) <= 2 * rel(base) + 1e-3, (rel(got), rel(base))


def check_padded_batch(m16, m32, name, vocab, what, after=None):
    """A left-padded batch of three rows on attention ``name`` (bf16) against the float32 copy on
    eager, within the bound of check_close; ``after`` runs once the flashmask forward has."""
    g = torch.Generator().manual_seed(2)
    lens = [700, 300, 520]
    ids = torch.randint(0, vocab, (3, max(lens)), generator=g).cuda()
    am = torch.zeros(3, max(lens), dtype=torch.long, device="cuda")
    for i, n in enumerate(lens):
        am[i, max(lens) - n:] = 1  # left padding
    with torch.no_grad():
        got = m16(input_ids=ids, attention_mask=am, use_cache=False).logits
        want = m32(input_ids=ids, attention_mask=am, use_cache=False).logits
        base = set_impl(m16, "eager")(input_ids=ids, attention_mask=am, use_cache=False).logits
    set_impl(m16, name)
    if after is not None:
        after()
    real = am.bool()
    check_close(got[real], want[real], base[real], what)
