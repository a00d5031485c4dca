"""Draw every mask family at S=32: one PNG per family plus a grid ``all_masks.png``.

Usage: ``python -m masks.draw_all [OUTDIR]`` (default ``docs/masks``).
"""
from __future__ import annotations

import os
import sys

from . import FAMILIES, plot_mask

S = 32
# One illustrative set of arguments per family (S=32); captions say what they are.
EXAMPLES = {
    "full": ((), {}, "full"),
    "causal": ((), {}, "causal"),
    "sliding_window": ((6,), {}, "sliding window 6"),
    "causal_document": (([10, 8, 9],), {}, "causal document 10,8,9 (+tail 5)"),
    "document": (([10, 8, 9],), {}, "document 10,8,9 (+tail 5)"),
    "share_question": (([10, 6, 7, 5],), {}, "share question q=10, answers 6,7,5 (+tail 4)"),
    "global_sliding_window": ((3, 4), {}, "global 3 + window 4"),
    "causal_blockwise": (([8, 7, 6],), {}, "causal blockwise 8,7,6 (+final 11)"),
    "prefix_lm_causal": ((12,), {}, "prefix-LM causal, prefix 12"),
    "prefix_lm_document": (([12, 10, 10], [5, 4, 6]), {}, "prefix-LM document 12,10,10; prefixes 5,4,6"),
    "qk_sparse": (([(6, 14, 6, 12), (18, 24, 20, 28)],), {}, "QK-sparse, 2 regions"),
    "random_eviction": ((), {"seed": 0}, "random eviction (seed 0)"),
}


def build(name: str):
    args, kwargs, caption = EXAMPLES[name]
    return getattr(FAMILIES[name], name)(S, *args, **kwargs), caption


def main(outdir: str = os.path.join("docs", "masks")) -> None:
    from matplotlib.figure import Figure

    os.makedirs(outdir, exist_ok=True)
    grid = Figure(figsize=(16, 12.5))
    axes = grid.subplots(3, 4)
    for ax, name in zip(axes.flat, FAMILIES):
        m, caption = build(name)
        causal = FAMILIES[name].CAUSAL
        plot_mask(m, causal, path=os.path.join(outdir, f"{name}.png"),
                  title=f"{caption}\ncausal={causal}, C={m.shape[-1]}")
        plot_mask(m, causal, ax=ax, title=caption if caption == name else f"{name}\n{caption}")
        ax.set_xlabel("")
        ax.set_ylabel("")
        ax.title.set_fontsize(9)
    grid.suptitle(f"FlashMask mask families, S={S} (rows: queries, columns: keys; dark = attends)")
    grid.tight_layout()
    grid.savefig(os.path.join(outdir, "all_masks.png"), dpi=90)
    print(f"wrote {len(FAMILIES) + 1} PNGs to {outdir}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
