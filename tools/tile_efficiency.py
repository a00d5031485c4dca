"""How much of the work a tiled kernel does is on visible pairs, per mask family and tile shape.

A kernel that skips fully masked (block_m x block_n) tiles still computes every element of each
tile it visits. Visible pairs / computed pairs is then a ceiling on its TFLOP/s (counted on visible
pairs) relative to its dense rate; the share of visited tiles that some element masks is how often
the element-wise compare runs. Runs on the CPU, a chunk of rows at a time (O(rows * Sk) memory):

    python -m tools.tile_efficiency --seqlens 8k,32k --tiles 192x128,128x128,64x128
"""
import argparse
from typing import Dict, List, Tuple

import torch

from benchmarks.tiles import tile_stats
from masks import FAMILIES
from masks.examples import example
from masks.format import to_dense


def tile_counts(mask: torch.Tensor, causal: bool, block_m: int, block_n: int, chunk_rows: int = 2048,
                warpgroup_rows: int = 0) -> Dict[str, int]:
    """Visible pairs, computed pairs (elements of visited tiles, clipped to the sequence), visited
    tiles and the visited tiles some element masks, over every (batch, mask head) of a square mask
    (Sq = Sk, as the benchmark's).

    With warpgroup_rows (a divisor of block_m) also the pairs computed when each warpgroup of that
    many rows skips some blocks of the tile's walk (key blocks in decreasing order), the ceiling of
    a per-warpgroup skip in a kernel: `computed_leading`, those above the last block its own rows
    see; `computed_skip`, every block its rows do not see; `computed_skip_cut`, those only where the
    column intervals cut the tile partly by the kernels' bounds test (a block the causal diagonal
    alone crosses is computed by every warpgroup)."""
    b, hm, sk = mask.shape[:3]
    sq = sk
    # The kernels' bounds test of whether the column intervals cut each tile: [B, Hm, query tiles, key blocks].
    cut_map = tile_stats(mask, causal, sq, block_m, block_n, return_maps=True)["cut_map"] if warpgroup_rows else None
    chunk_rows = max(block_m, chunk_rows // block_m * block_m)  # whole query tiles per chunk
    n_tiles = -(-sk // block_n)
    sub = warpgroup_rows or block_m
    if block_m % sub:
        raise ValueError(f"warpgroup_rows={warpgroup_rows} must divide block_m={block_m}")
    counts = dict(visible=0, computed=0, tiles=0, partial=0, computed_leading=0, computed_skip=0,
                  computed_skip_cut=0)
    for r0 in range(0, sq, chunk_rows):
        rows = to_dense(mask, causal, rows=slice(r0, min(r0 + chunk_rows, sq)))  # [B, Hm, rows, Sk]
        m = rows.shape[2]
        m_tiles = -(-m // block_m)
        # Pad to whole tiles with masked elements, then count each tile's visible elements.
        padded = torch.zeros(b, hm, m_tiles * block_m, n_tiles * block_n, dtype=torch.bool)
        padded[:, :, :m, :sk] = rows
        per_tile = padded.view(b, hm, m_tiles, block_m, n_tiles, block_n).sum((3, 5))
        heights = torch.full((m_tiles,), block_m)
        heights[-1] = m - (m_tiles - 1) * block_m
        widths = torch.full((n_tiles,), block_n)
        widths[-1] = sk - (n_tiles - 1) * block_n
        size = heights.view(-1, 1) * widths.view(1, -1)  # real elements per tile
        visited = per_tile > 0
        counts["visible"] += int(per_tile.sum())
        counts["computed"] += int((visited * size).sum())
        counts["tiles"] += int(visited.sum())
        counts["partial"] += int((visited & (per_tile < size)).sum())
        if warpgroup_rows:  # per warpgroup: the tile's visited blocks up to the last one its rows see
            per_wg = padded.view(b, hm, m_tiles, block_m // sub, sub, n_tiles, block_n).any(6).any(4)
            n = torch.arange(n_tiles)
            last_seen = torch.where(per_wg, n, -1).amax(-1, keepdim=True)  # [B, Hm, m_tiles, wgs, 1]
            walked = visited.unsqueeze(3) & (n <= last_seen)
            wg_rows = (torch.arange(m_tiles * block_m).view(m_tiles, -1, sub) < m).sum(-1)  # real rows
            group_size = wg_rows.view(m_tiles, -1, 1) * widths  # real pairs of a (warpgroup, block)
            counts["computed_leading"] += int((walked * group_size).sum())
            counts["computed_skip"] += int(((visited.unsqueeze(3) & per_wg) * group_size).sum())
            cut = cut_map[:, :, r0 // block_m:r0 // block_m + m_tiles].unsqueeze(3)
            kept = visited.unsqueeze(3) & (per_wg | ~cut)
            counts["computed_skip_cut"] += int((kept * group_size).sum())
    if not warpgroup_rows:
        for key in ("computed_leading", "computed_skip", "computed_skip_cut"):
            del counts[key]
    return counts


def parse_tiles(text: str) -> List[Tuple[int, int]]:
    return [tuple(int(x) for x in t.split("x")) for t in text.split(",")]


def parse_seqlens(text: str) -> List[int]:
    return [int(s[:-1]) * 1024 if s.endswith("k") else int(s) for s in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="all", help=f"comma list or 'all': {', '.join(FAMILIES)}")
    parser.add_argument("--seqlens", default="8k,32k", help="comma list; 'k' suffix = 1024")
    parser.add_argument("--tiles", default="192x128,128x128,64x128", help="block_m x block_n, comma list")
    parser.add_argument("--warpgroup-rows", type=int, default=0,
                        help="also the ratios when each warpgroup of this many rows skips its leading "
                             "blocks, every block it does not see, and those only where the intervals cut the tile")
    args = parser.parse_args()
    families = list(FAMILIES) if args.families == "all" else args.families.split(",")
    tiles = parse_tiles(args.tiles)
    lead = args.warpgroup_rows
    print("visible / computed pairs (share of visited tiles with masked elements"
          + (f"; with {lead}-row warpgroups skipping their leading blocks / every unseen block / "
             "unseen blocks the intervals cut)" if lead else ")"))
    width = 40 if lead else 16
    print(f"{'family':24s} {'seqlen':>7s} " + " ".join(f"{f'{m}x{n}':>{width}s}" for m, n in tiles))
    for family in families:
        for s in parse_seqlens(args.seqlens):
            mask, causal = example(family, s)
            cells = []
            for m, n in tiles:
                c = tile_counts(mask, causal, m, n, warpgroup_rows=lead if lead and m % lead == 0 else 0)
                cell = f"{c['visible'] / c['computed']:.3f} ({c['partial'] / c['tiles']:.2f})"
                if "computed_leading" in c:
                    cell += "; " + " / ".join(f"{c['visible'] / c[k]:.3f}" for k in
                                              ("computed_leading", "computed_skip", "computed_skip_cut"))
                cells.append(cell)
            print(f"{family:24s} {s:7d} " + " ".join(f"{x:>{width}s}" for x in cells), flush=True)


if __name__ == "__main__":
    main()
