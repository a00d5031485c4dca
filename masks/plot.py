"""Pictures of a mask: ``plot_mask`` draws one (batch, head) as an image (PNG on request).

Large masks are shown downsampled: each pixel is the fraction of its block of (query, key) pairs
that attend. ``visible_fraction`` computes that exactly in O(Sk + pixels) time and memory, from
the column intervals, never materialising the Sq x Sk mask: column j's visible rows are at most
three disjoint intervals, and the number of visible rows below a row edge x is a sum of ramps
``(x - a)+ - (x - b)+`` whose per-block totals come from prefix sums over the edges.
"""
from __future__ import annotations

from typing import Optional

import torch

from .format import unpack


def _edges(n: int, bins: int, device) -> torch.Tensor:
    return torch.arange(bins + 1, device=device) * n // bins  # bins of n // bins or n // bins + 1


def _visible_pieces(startend: torch.Tensor, causal: bool, sq: int):
    """The visible rows of every column of ``[Sk, C]`` as three disjoint ``[a, b)`` pieces, ``[Sk, 3]`` each."""
    iv = unpack(startend[None, None], causal)
    sk = startend.shape[0]
    lts = iv.lts[0, 0].long()
    if causal:  # masked: the causal triangle [0, d) and [LTS, LTE)
        d = torch.arange(sk, device=lts.device) - (sk - sq)
        m = [(torch.zeros_like(lts), d), (lts, iv.lte[0, 0].long() if iv.lte is not None else torch.full_like(lts, sq))]
    elif iv.lte is None:  # [0, UTE) and [LTS, Sq)
        m = [(torch.zeros_like(lts), iv.ute[0, 0].long()), (lts, torch.full_like(lts, sq))]
    else:
        m = [(iv.uts[0, 0].long(), iv.ute[0, 0].long()), (lts, iv.lte[0, 0].long())]
    (a1, b1), (a2, b2) = [(lo.clamp(0, sq), hi.clamp(0, sq)) for lo, hi in m]
    # An empty masked interval becomes [Sq, Sq) so that it sorts last and hides nothing.
    a1, b1 = torch.where(a1 < b1, a1, sq), torch.where(a1 < b1, b1, sq)
    a2, b2 = torch.where(a2 < b2, a2, sq), torch.where(a2 < b2, b2, sq)
    swap = a2 < a1
    a1, a2 = torch.where(swap, a2, a1), torch.where(swap, a1, a2)
    b1, b2 = torch.where(swap, b2, b1), torch.where(swap, b1, b2)
    lo = torch.stack([torch.zeros_like(a1), b1, torch.maximum(b1, b2)], -1)
    hi = torch.stack([a1, torch.maximum(b1, a2), torch.full_like(a1, sq)], -1)
    return lo, hi


def visible_fraction(startend_row_indices: torch.Tensor, causal: bool, seqlen_q: Optional[int] = None,
                     batch: int = 0, head: int = 0, max_size: int = 512) -> torch.Tensor:
    """Fraction of attending pairs per block, float64 ``[min(Sq, max_size), min(Sk, max_size)]``.

    With ``Sq, Sk <= max_size`` every block is one pair, so this is exactly the 0/1 mask.
    """
    t = startend_row_indices[batch, head]
    sk = t.shape[0]
    sq = sk if seqlen_q is None else int(seqlen_q)
    nr, nc = min(sq, max_size), min(sk, max_size)
    dev = t.device
    redge, cedge = _edges(sq, nr, dev), _edges(sk, nc, dev)
    a, b = _visible_pieces(t, causal, sq)  # [Sk, 3]
    col_bin = (torch.searchsorted(cedge, torch.arange(sk, device=dev), right=True) - 1).clamp(max=nc - 1)
    # Each piece adds a ramp (x - a)+ and removes (x - b)+. A ramp from p is non-zero at the row
    # edges x > p, i.e. from edge index searchsorted(redge, p, right=True) on.
    pts = torch.cat([a, b], -1)  # [Sk, 6]
    sign = torch.tensor([1, 1, 1, -1, -1, -1], device=dev).expand_as(pts)
    first_edge = torch.searchsorted(redge, pts.contiguous(), right=True)
    flat = (col_bin.unsqueeze(-1) * (nr + 2) + first_edge).flatten()
    n = torch.zeros(nc * (nr + 2), dtype=torch.long, device=dev).index_add_(0, flat, sign.flatten())
    s = torch.zeros_like(n).index_add_(0, flat, (sign * pts).flatten())
    n, s = n.view(nc, nr + 2).cumsum(1)[:, : nr + 1], s.view(nc, nr + 2).cumsum(1)[:, : nr + 1]
    g = redge * n - s  # [nc, nr + 1]: visible rows below each row edge, summed over the column bin
    count = (g[:, 1:] - g[:, :-1]).T  # [nr, nc]
    area = (redge[1:] - redge[:-1]).unsqueeze(1) * (cedge[1:] - cedge[:-1]).unsqueeze(0)
    return count.double() / area


def plot_mask(startend_row_indices: torch.Tensor, causal: bool, seqlen_q: Optional[int] = None, batch: int = 0,
              head: int = 0, path=None, title: Optional[str] = None, ax=None, max_size: int = 512):
    """Draw one (batch, head) of a mask (dark = attends) and return the matplotlib Figure.

    Saves a PNG when ``path`` is given; draws into ``ax`` when given. Masks larger than
    ``max_size`` are shown as per-block fractions (see ``visible_fraction``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # matplotlib is optional: only pictures need it
        raise ImportError("plot_mask needs matplotlib: pip install matplotlib") from e
    img = visible_fraction(startend_row_indices, causal, seqlen_q, batch, head, max_size).cpu().numpy()
    sk = startend_row_indices.shape[2]
    sq = sk if seqlen_q is None else int(seqlen_q)
    if ax is None:
        fig = Figure(figsize=(5, 5 * min(2.0, max(0.5, sq / sk))))  # no pyplot: no global state, no GUI
        ax = fig.add_subplot()
    fig = ax.figure
    ax.imshow(img, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest",
              extent=(-0.5, sk - 0.5, sq - 0.5, -0.5), aspect="equal")
    if max(sq, sk) <= 64:  # cell borders help to read small masks token by token
        ax.set_xticks([x - 0.5 for x in range(1, sk)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, sq)], minor=True)
        ax.grid(which="minor", color="white", linewidth=0.3)
        ax.tick_params(which="minor", length=0)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    c = startend_row_indices.shape[-1]
    down = " (block fractions)" if img.shape != (sq, sk) else ""
    ax.set_title(title if title is not None else f"{sq}x{sk}, causal={bool(causal)}, C={c}{down}")
    if path is not None:
        fig.savefig(path, dpi=100, bbox_inches="tight")
    return fig
