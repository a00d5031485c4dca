"""Pictures: exact block fractions without a dense mask, PNG output, draw_all."""
import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import masks
from masks import to_dense
from masks.plot import visible_fraction
from tests.cpu.test_masks_convert import startend


def _pooled(t, causal, sq, b, h, nr, nc):
    """Block fractions from the dense mask, with the same bin edges as plot.py (n * k // bins)."""
    d = to_dense(t, causal, sq)[b, h].double()
    re_ = [k * sq // nr for k in range(nr + 1)]
    ce = [k * t.shape[2] // nc for k in range(nc + 1)]
    return torch.tensor([[d[re_[r]:re_[r + 1], ce[c]:ce[c + 1]].mean().item() for c in range(nc)] for r in range(nr)],
                        dtype=torch.float64)


@settings(max_examples=150, deadline=None)
@given(startend(), st.integers(1, 13))
def test_visible_fraction_matches_pooled_dense(case, max_size):
    causal, c, sq, t = case
    b, h = t.shape[0] - 1, t.shape[1] - 1
    got = visible_fraction(t, causal, sq, batch=b, head=h, max_size=max_size)
    nr, nc = min(sq, max_size), min(t.shape[2], max_size)
    assert got.shape == (nr, nc)
    assert torch.allclose(got, _pooled(t, causal, sq, b, h, nr, nc), rtol=0, atol=1e-12)


def test_visible_fraction_is_the_mask_when_small():
    m = masks.share_question(10, [4, 3, 3])
    assert torch.equal(visible_fraction(m, True) == 1, to_dense(m, True)[0, 0])


def test_visible_fraction_large_causal_is_about_half():
    f = visible_fraction(masks.causal(1 << 16), True, max_size=64)
    assert f.shape == (64, 64)
    assert torch.equal(f.triu(1), torch.zeros_like(f)) and torch.all(f.tril(-1)[f.tril(-1) > 0] == 1)
    assert torch.allclose(f.diagonal(), torch.full((64,), (1024 * 1025 / 2) / 1024**2, dtype=torch.float64))


def test_plot_mask_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    p = tmp_path / "m.png"
    fig = masks.plot_mask(masks.document(20, [5, 15]), False, path=str(p), title="doc")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig.axes[0].get_title() == "doc"
    big = tmp_path / "big.png"
    fig = masks.plot_mask(masks.causal_document(5000, [1000] * 5), True, path=str(big), max_size=100)
    assert big.stat().st_size > 0 and "block fractions" in fig.axes[0].get_title()
    assert fig.axes[0].images[0].get_array().shape == (100, 100)


def test_plot_mask_into_given_axes():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    assert masks.plot_mask(masks.causal(8), True, ax=ax) is fig
    assert ax.images[0].get_array().shape == (8, 8)


def test_plot_mask_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes "import matplotlib..." fail
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        masks.plot_mask(masks.causal(4), True)


@pytest.mark.slow
def test_draw_all(tmp_path):
    pytest.importorskip("matplotlib")
    from masks import draw_all

    draw_all.main(str(tmp_path))
    names = sorted(os.listdir(tmp_path))
    assert names == sorted([f"{n}.png" for n in masks.FAMILIES] + ["all_masks.png"])
    assert all((tmp_path / n).read_bytes()[:4] == b"\x89PNG" for n in names)
