"""The mask families: the worked examples of docs/format.md, builder == dense definition, batching, errors, scale."""
import os
import re
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import masks
from masks import FAMILIES, to_dense
from tests import ROOT

FORMAT_DOC = os.path.join(ROOT, "docs", "format.md")
# The worked examples of docs/format.md, by the start of their line -> family. The builder call and
# the vectors come from the document itself, so the document cannot drift from the code silently.
DOC_EXAMPLES = {
    "sliding window 3": "sliding_window", "causal document": "causal_document",
    "document (bidirectional)": "document", "share question": "share_question",
    "global + sliding window": "global_sliding_window", "causal blockwise": "causal_blockwise",
    "prefix-LM document": "prefix_lm_document", "prefix-LM causal": "prefix_lm_causal", "QK-sparse": "qk_sparse",
}
PICTURE_FAMILY = {"sliding": "sliding_window", "causal_doc": "causal_document", "document": "document",
                  "share_q": "share_question", "global_sw": "global_sliding_window", "blockwise": "causal_blockwise",
                  "prefix_doc": "prefix_lm_document", "prefix_lm": "prefix_lm_causal", "qk_sparse": "qk_sparse"}
NAMES = {True: ("LTS", "LTE"), False: {2: ("LTS", "UTE"), 4: ("LTS", "LTE", "UTS", "UTE")}}


def _section(title):
    """The text of the docs/format.md section whose heading starts with ``title``."""
    text = open(FORMAT_DOC).read()
    m = re.search(r"^## " + re.escape(title) + r".*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/format.md has no section '{title}'"
    return m.group(1)


def _pictures(section):
    """``{column name: bool [rows, cols]}`` from the fenced ASCII pictures of a section."""
    pics = {}
    for block in re.findall(r"```\n(.*?)```", section, re.S):
        lines = block.strip().splitlines()
        if re.fullmatch(r"[#.]+", lines[0].split()[0]):  # one picture without a header: "_"
            names, rows = ["_"], lines
        else:
            names, rows = lines[0].split(), lines[1:]
        cols = {n: [] for n in names}
        for line in rows:
            for n, row in zip(names, line.split()):
                cols[n].append([ch == "#" for ch in row])
        pics.update({n: torch.tensor(p) for n, p in cols.items()})
    return pics


def _vector(text):
    """'[1,2]' / '[10]*10' / '[4,4,10,...]' (repeat the last value) -> 10 ints."""
    m = re.fullmatch(r"\[([^\]]*)\](?:\*(\d+))?", text)
    items = [x.strip() for x in m.group(1).split(",")]
    if m.group(2):
        return [int(items[0])] * int(m.group(2))
    if items[-1] == "...":
        items = items[:-1] + [items[-2]] * (10 - len(items) + 1)
    return [int(x) for x in items]


def _parse_examples():
    """label -> (causal, C, builder call, {vector name: 10 ints}) from the worked-example list."""
    out = {}
    for line in re.findall(r"^- (.*)$", _section("Worked examples"), re.M):
        head, _, vectors = line.partition("): ")
        label = next(k for k in DOC_EXAMPLES if head.startswith(k))
        head, _, call = head.partition(" (`")
        causal = ", causal," in head + "," and "non-causal" not in head
        c = int(re.search(r"C=(\d)", head).group(1))
        vecs = dict((n, _vector(v)) for n, v in re.findall(r"(LTS|LTE|UTS|UTE) = (\[[^\]]*\](?:\*\d+)?)", vectors))
        out[label] = (causal, c, call.rstrip("`"), vecs)
    return out


def _build(call, namespace=masks):
    """Evaluate a builder call written in the document, e.g. ``masks.sliding_window(10, 3)``."""
    assert re.fullmatch(r"masks\.\w+\([\w\s,\[\]()]*\)", call), call
    return eval(call, {"__builtins__": {}, "masks": namespace})


def _call_args(call, family):
    """The arguments after seqlen of a documented builder call."""
    return _build(call, types.SimpleNamespace(**{family: lambda seqlen, *args: args}))


def _list_of_ints(text):
    return [int(x) for x in text.strip("[]").split(",")]


def test_format_doc_parsed_completely():
    ex = _parse_examples()
    assert set(ex) == set(DOC_EXAMPLES)
    assert all(len(v) == 10 for *_, vecs in ex.values() for v in vecs.values())
    assert set(_pictures(_section("Worked examples"))) == set(PICTURE_FAMILY)


@pytest.mark.parametrize("label", list(DOC_EXAMPLES))
def test_format_doc_index_vectors(label):
    causal, c, call, vecs = _parse_examples()[label]
    family = DOC_EXAMPLES[label]
    mod = FAMILIES[family]
    assert mod.CAUSAL == causal
    assert call.startswith(f"masks.{family}(10")
    m = _build(call)
    assert m.dtype == torch.int32 and m.shape == (1, 1, 10, c)
    names = NAMES[True] if causal else NAMES[False][c]
    assert set(vecs) == set(names[:c])
    for k, n in enumerate(names[:c]):
        assert m[0, 0, :, k].tolist() == vecs[n], n
    # The dense definition agrees with the documented vectors as well.
    dense = _dense_from_mask_mod(getattr(mod, f"{family}_mask_mod")(10, *_call_args(call, family)), 1, 10)
    assert torch.equal(to_dense(m, causal), dense)


@pytest.mark.parametrize("name", list(PICTURE_FAMILY))
def test_format_doc_pictures(name):
    family = PICTURE_FAMILY[name]
    label = next(k for k, v in DOC_EXAMPLES.items() if v == family)
    causal, _, call, _ = _parse_examples()[label]
    pic = _pictures(_section("Worked examples"))[name]
    assert torch.equal(to_dense(_build(call), causal)[0, 0], pic)


def test_format_doc_bottom_right_causal_picture():
    pic = _pictures(_section("Causal with Sq != Sk"))["_"]
    assert pic.shape == (4, 6)
    assert torch.equal(to_dense(None, True, seqlen_q=4, seqlen_k=6)[0, 0], pic)


def test_format_doc_out_of_range_example():
    sec = _section("Values outside")
    lts, lte = (_list_of_ints(re.search(name + r" = (\[[^\]]*\])", sec).group(1)) for name in ("LTS", "LTE"))
    t = torch.tensor([lts, lte], dtype=torch.int32).T.reshape(1, 1, 4, 2)
    assert torch.equal(to_dense(t, True)[0, 0], _pictures(sec)["_"])
    with pytest.raises(ValueError, match="values must lie in"):
        masks.validate(t, True)


def test_format_doc_packed_rule_table():
    rows = re.findall(r"^\| `(\[[^`]*\])` \| (.*?) \|$", _section("Packed sequences"), re.M)
    assert len(rows) >= 4
    for pos, docs in rows:
        starts = masks.document_starts(torch.tensor(_list_of_ints(pos)))[0].tolist()
        got = [i for i, s in enumerate(starts) if s]
        want = [int(a) for a in re.findall(r"\[(\d+)(?:-\d+)?\]", docs)]
        assert got == want, (pos, docs)


# ---------------------------------------------------------------- builder == dense definition

def _dense_from_mask_mod(mask_mod, bsz, s):
    """Evaluate a mask_mod with broadcasting index tensors -> bool [B, 1, S, S]."""
    b = torch.arange(bsz).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q = torch.arange(s).view(1, 1, -1, 1)
    kv = torch.arange(s).view(1, 1, 1, -1)
    return mask_mod(b, h, q, kv).expand(bsz, 1, s, s)


@st.composite
def _lens(draw, s, full=False):
    """One sample's lengths: >= 0 (zeros allowed), summing to s (full) or to at most s."""
    cuts = sorted(draw(st.lists(st.integers(0, s), max_size=6)))
    end = s if full else draw(st.integers(cuts[-1] if cuts else 0, s))
    pts = [0] + cuts + [end]
    return [b - a for a, b in zip(pts, pts[1:])]


@st.composite
def _batched(draw, s, one):
    """Either one sample's spec (maybe with batch_size) or a list of 1-3 differing specs."""
    kind = draw(st.sampled_from(["one", "one_bs", "batch"]))
    if kind == "one":
        return draw(one), {}, 1
    if kind == "one_bs":
        bsz = draw(st.integers(1, 3))
        return draw(one), {"batch_size": bsz}, bsz
    specs = draw(st.lists(one, min_size=1, max_size=3))
    return specs, {}, len(specs)


@st.composite
def _regions(draw, s):
    """qk_sparse regions with disjoint key ranges (in random order, maybe empty ones)."""
    cuts = sorted(draw(st.lists(st.integers(0, s), max_size=6)))
    out = []
    for a, b in zip(cuts[::2], cuts[1::2]):
        r0 = draw(st.integers(0, s))
        out.append((a, b, r0, draw(st.integers(r0, s))))
    return draw(st.permutations(out))


@st.composite
def family_case(draw, family):
    """(seqlen, args, kwargs, batch) for a random valid call of the family's builder."""
    s = draw(st.integers(1, 24))
    if family in ("full", "causal"):
        bsz = draw(st.integers(1, 3))
        return s, (), {"batch_size": bsz}, bsz
    if family == "sliding_window":
        return s, (draw(st.integers(1, s + 2)),), {}, 1
    if family == "global_sliding_window":
        return s, (draw(st.integers(0, s)), draw(st.integers(1, s + 2))), {}, 1
    if family == "random_eviction":
        bsz = draw(st.integers(1, 3))
        return s, (), {"batch_size": bsz, "seed": draw(st.integers(0, 2**31))}, bsz
    if family == "prefix_lm_causal":
        spec, kw, bsz = draw(_batched(s, st.integers(0, s)))
        return s, (spec,), kw, bsz
    if family == "share_question":
        one = _lens(s).filter(len)  # [question, answers...] needs at least the question
        spec, kw, bsz = draw(_batched(s, one))
        return s, (spec,), kw, bsz
    if family == "qk_sparse":
        spec, kw, bsz = draw(_batched(s, _regions(s)))
        return s, (spec,), kw, bsz
    if family == "prefix_lm_document":
        kind = draw(st.sampled_from(["one", "one_bs", "batch"]))
        docs = draw(st.lists(_lens(s), min_size=1, max_size=1 if kind != "batch" else 3))
        if draw(st.booleans()):
            prefix = draw(st.integers(0, s))  # one int for every document (cut to its length)
        else:
            prefix = [[draw(st.integers(0, n)) for n in x] for x in docs]
        if kind == "batch":
            return s, (docs, prefix), {}, len(docs)
        prefix = prefix if isinstance(prefix, int) else prefix[0]
        bsz = draw(st.integers(1, 3)) if kind == "one_bs" else 1
        return s, (docs[0], prefix), ({"batch_size": bsz} if kind == "one_bs" else {}), bsz
    spec, kw, bsz = draw(_batched(s, _lens(s)))
    return s, (spec,), kw, bsz


@pytest.mark.parametrize("family", list(FAMILIES))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_builder_matches_mask_mod(family, data):
    s, args, kw, bsz = data.draw(family_case(family))
    mod = FAMILIES[family]
    m = getattr(mod, family)(s, *args, **kw)
    c = m.shape[-1]
    assert m.dtype == torch.int32 and m.shape == (bsz, 1, s, c) and m.is_contiguous()
    assert c in ((1, 2) if mod.CAUSAL else (2, 4))
    masks.validate(m, mod.CAUSAL, s)
    expect = _dense_from_mask_mod(getattr(mod, f"{family}_mask_mod")(s, *args, **kw), bsz, s)
    assert torch.equal(to_dense(m, mod.CAUSAL), expect)


def _examples():
    """Small batched cases for the FlexAttention compatibility check."""
    return [
        ("full", 9, (), {"batch_size": 2}), ("causal", 9, (), {}), ("sliding_window", 9, (3,), {}),
        ("causal_document", 9, ([[2, 3], [9], []],), {}), ("document", 9, ([[4, 1], [3]],), {}),
        ("share_question", 9, ([[2, 3, 1], [4, 5]],), {}), ("global_sliding_window", 9, (2, 2), {"batch_size": 2}),
        ("causal_blockwise", 9, ([[2, 2], [3, 6]],), {}), ("prefix_lm_causal", 9, ([0, 4, 9],), {}),
        ("prefix_lm_document", 9, ([[3, 4], [5]], [[1, 4], [2]]), {}),
        ("qk_sparse", 9, ([[(1, 4, 2, 6)], [(0, 2, 5, 9), (5, 9, 6, 8)]],), {}),
        ("random_eviction", 9, (), {"seed": 3, "batch_size": 2}),
    ]


@pytest.mark.parametrize("family,s,args,kw", _examples())
def test_mask_mod_works_with_flex_attention_create_mask(family, s, args, kw):
    """create_mask evaluates the predicate under torch.vmap on scalar indices, as create_block_mask does."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    mod = FAMILIES[family]
    m = getattr(mod, family)(s, *args, **kw)
    mm = getattr(mod, f"{family}_mask_mod")(s, *args, **kw)
    dense = flex.create_mask(mm, m.shape[0], 1, s, s, device="cpu")
    assert torch.equal(dense, to_dense(m, mod.CAUSAL))


def test_mask_mod_create_block_mask():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    mm = masks.causal_document_mask_mod(256, [[100, 156], [256]])
    bm = flex.create_block_mask(mm, 2, 1, 256, 256, device="cpu", BLOCK_SIZE=128)
    # Sample 0: blocks (0,0) partial, (1,0) partial (doc 0 spans both), (1,1) partial; sample 1: causal.
    assert bm.to_dense()[:, 0].tolist() == [[[1, 0], [1, 1]], [[1, 0], [1, 1]]]


# ---------------------------------------------------------------- batching, tails and arguments

def test_batched_specs_build_each_sample():
    m = masks.causal_document(8, [[2, 6], [8], [3]])
    assert m[:, 0, :, 0].tolist() == [[2, 2, 8, 8, 8, 8, 8, 8], [8] * 8, [3, 3, 3, 8, 8, 8, 8, 8]]
    one = masks.document(8, [3, 5], batch_size=3)
    assert one.shape == (3, 1, 8, 2) and torch.equal(one[0], one[2])
    for b, spec in enumerate([[2, 6], [8], [3]]):
        assert torch.equal(m[b:b + 1], masks.causal_document(8, spec))


def test_tail_forms_one_more_document():
    # 6 of 10 tokens given: tokens 6-9 are a document of their own in every document family.
    assert masks.causal_document(10, [2, 4])[0, 0, :, 0].tolist() == [2, 2, 6, 6, 6, 6, 10, 10, 10, 10]
    assert masks.document(10, [6])[0, 0, :, 1].tolist() == [0] * 6 + [6] * 4
    assert masks.causal_document(5, [])[0, 0, :, 0].tolist() == [5] * 5
    # share_question: the tail sees neither the question nor the answers.
    d = to_dense(masks.share_question(8, [2, 2, 2]), True)[0, 0]
    assert d[7].tolist() == [False] * 6 + [True, True]
    # prefix_lm_document: the tail has no prefix (causal).
    assert masks.prefix_lm_document(6, [3], 3)[0, 0, :, 1].tolist() == [0, 0, 0, 3, 4, 5]
    # causal_blockwise: the tail is the final part that sees everything before it.
    assert to_dense(masks.causal_blockwise(6, [2, 2]), True)[0, 0, 5].all()


S1_ARGS = {"full": (), "causal": (), "sliding_window": (1,), "global_sliding_window": (0, 1),
           "causal_document": ([1],), "document": ([],), "share_question": ([1],), "causal_blockwise": ([0, 1],),
           "prefix_lm_causal": (1,), "prefix_lm_document": ([1], [1]), "qk_sparse": ([(0, 1, 0, 1)],),
           "random_eviction": ()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_s1_edge_case(name):
    mod = FAMILIES[name]
    kw = {"seed": 0} if name == "random_eviction" else {}
    m = getattr(mod, name)(1, *S1_ARGS[name], **kw)
    assert m.shape[:3] == (1, 1, 1)
    expect = _dense_from_mask_mod(getattr(mod, f"{name}_mask_mod")(1, *S1_ARGS[name], **kw), 1, 1)
    assert torch.equal(to_dense(m, mod.CAUSAL), expect)
    # The single pair is dropped by that qk_sparse region; every other family keeps it.
    assert bool(expect.all()) == (name != "qk_sparse")


@pytest.mark.parametrize("call,match", [
    (lambda: masks.causal(0), "seqlen"),
    (lambda: masks.full(4, batch_size=0), "batch_size"),
    (lambda: masks.sliding_window(4, 0), "window"),
    (lambda: masks.sliding_window(4, -2), "window"),
    (lambda: masks.causal_document(4, [3, 2]), "sum to 5 > seqlen=4"),
    (lambda: masks.causal_document(4, [3, -1]), "negative"),
    (lambda: masks.document(4, [[1], [5]]), "sample 1"),
    (lambda: masks.document(4, [[1], [2]], batch_size=3), "2 samples but batch_size=3"),
    (lambda: masks.document(4, [[[1]]]), "nested too deeply"),
    (lambda: masks.document(4, [1.5]), "list of ints"),
    (lambda: masks.share_question(4, []), "question_len"),
    (lambda: masks.global_sliding_window(4, 5, 1), "num_global"),
    (lambda: masks.global_sliding_window(4, 1, 0), "window"),
    (lambda: masks.causal_blockwise(4, [5]), "seqlen"),
    (lambda: masks.prefix_lm_causal(4, 5), "prefix_len"),
    (lambda: masks.prefix_lm_causal(4, -1), "prefix_len"),
    (lambda: masks.prefix_lm_document(4, [2, 2], [1]), "one per document"),
    (lambda: masks.prefix_lm_document(4, [2, 2], [1, 3]), "document 1 is 3"),
    (lambda: masks.prefix_lm_document(4, [2, 2], -1), ">= 0"),
    (lambda: masks.qk_sparse(4, [(0, 3, 0, 4), (2, 4, 0, 4)]), "overlap"),
    (lambda: masks.qk_sparse(4, [(0, 5, 0, 4)]), "key_end"),
    (lambda: masks.qk_sparse(4, [(2, 1, 0, 4)]), "key_start <= key_end"),
    (lambda: masks.qk_sparse(4, [(0, 1, 0)]), "4 ints"),
    (lambda: masks.random_eviction(4, seed=1, generator=torch.Generator()), "either seed or generator"),
])
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        call()


def test_random_eviction_reproducible_and_in_range():
    a = masks.random_eviction(50, batch_size=4, seed=7)
    assert torch.equal(a, masks.random_eviction(50, batch_size=4, seed=7))
    assert not torch.equal(a, masks.random_eviction(50, batch_size=4, seed=8))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(masks.random_eviction(9, generator=g1), masks.random_eviction(9, generator=g2))
    lts = masks.random_eviction(6, batch_size=4000, seed=0)[:, 0, :, 0].long()
    j = torch.arange(6)
    assert ((lts > j) & (lts <= 6)).all()
    # Every value of (j, S] occurs, roughly uniformly: key 0 has 6 choices of ~667 draws each.
    counts = torch.bincount(lts[:, 0], minlength=7)[1:]
    assert counts.min() > 500 and counts.max() < 850


def test_builders_validate_by_default(monkeypatch):
    calls = []
    monkeypatch.setattr(masks.format, "validate", lambda *a, **k: calls.append(a))
    masks.causal_document(8, [3])
    assert len(calls) == 1 and calls[0][1] is True and calls[0][2] == 8
    masks.causal_document(8, [3], validate=False)
    assert len(calls) == 1


def test_device_argument():
    m = masks.document(8, [3], device=torch.device("cpu"))
    assert m.device.type == "cpu"
    if torch.cuda.is_available():
        for name, mod in FAMILIES.items():
            _, s, args, kw = next(e for e in _examples() if e[0] == name)
            g = getattr(mod, name)(s, *args, device="cuda", **kw)
            assert g.device.type == "cuda" and torch.equal(g.cpu(), getattr(mod, name)(s, *args, **kw))


def test_registry_and_exports():
    assert list(FAMILIES) == ["full", "causal", "sliding_window", "causal_document", "document", "share_question",
                              "global_sliding_window", "causal_blockwise", "prefix_lm_causal", "prefix_lm_document",
                              "qk_sparse", "random_eviction"]
    for name, mod in FAMILIES.items():
        assert getattr(masks, name) is getattr(mod, name)
        assert getattr(masks, f"{name}_mask_mod") is getattr(mod, f"{name}_mask_mod")
        assert isinstance(mod.CAUSAL, bool) and mod.__doc__ and "::" in mod.__doc__
    for n in masks.__all__:
        assert hasattr(masks, n), n


@pytest.mark.parametrize("module", [*FAMILIES.values(), masks.packed, masks.format])
def test_docstring_examples(module):
    import doctest

    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_import_is_cheap():
    code = "import sys, masks; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.slow
def test_million_tokens_without_quadratic_memory():
    """Every builder (and the packed / picture paths) at S = 2**20 in a fresh process: a single
    S x S bool would be 1 TiB, so finishing quickly with a small peak RSS shows none is built."""
    code = textwrap.dedent("""
        import time, torch, masks
        def rss(key):
            return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key)) // 1024
        torch.set_num_threads(2)
        base = rss('VmRSS:')
        s = 1 << 20
        docs = [1000] * 1000
        t0 = time.time()
        outs = [masks.full(s), masks.causal(s), masks.sliding_window(s, 4096), masks.causal_document(s, docs),
                masks.document(s, [docs, docs[:10]]), masks.share_question(s, [5000] + docs[:100]),
                masks.global_sliding_window(s, 64, 1024), masks.causal_blockwise(s, docs[:900]),
                masks.prefix_lm_causal(s, [100, 5000]), masks.prefix_lm_document(s, docs, 100),
                masks.qk_sparse(s, [(i * 1000, i * 1000 + 500, i * 1000 + 10, i * 1000 + 900) for i in range(1000)]),
                masks.random_eviction(s, seed=0),
                masks.from_cu_seqlens(torch.arange(0, s + 1, 1024)),
                masks.from_position_ids(torch.arange(s) % 4096)]
        masks.visible_fraction(outs[3], True)
        assert all(o.shape[2] == s for o in outs)
        print(time.time() - t0, rss('VmHWM:') - base)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    seconds, peak_mb = out.stdout.split()
    assert float(seconds) < 30
    assert int(peak_mb) < 1024, f"peak RSS grew by {peak_mb} MB"
