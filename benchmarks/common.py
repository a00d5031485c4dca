"""Shared pieces of the benchmark scripts.

* FLOP accounting on unmasked pairs (fwd = 4*B*H*D*pairs, bwd = 2.5x): :func:`count_pairs`, :func:`total_pairs`,
  :func:`attn_flops`. The counter works from the column intervals in O(Sk) and does not use
  ``masks/format.py``, so that the tests can check it against ``masks.format.to_dense``.
* Tile accounting (the kernels' skip rules, csrc/mask/intervals.h): :func:`tile_stats`.
* The methods compared (:data:`METHODS`, plus the opt-in :data:`EXTRA_METHODS`) behind one
  interface: :func:`prepare_method` returns a :class:`Prepared` whose ``attn(q, k, v)`` takes and
  returns ``[B, S, H, D]`` tensors; :func:`method_modes` drops the modes a method has no row for.
* FlexAttention glue: :func:`flex_mask_mod` (a ``mask_mod`` that gives exactly the mask of a
  ``startend_row_indices`` tensor) and a cache that keeps compiled kernels reusable.
* Dense masks for SDPA, bool or additive (:func:`dense_mask`, :func:`dense_fit`).
* Timing (:func:`time_ms`, :func:`make_step`, :func:`run_mode`), peak-memory counters
  (:func:`reset_peak`, :func:`peak_since`), memory clean-up, error formatting, tables
  (:func:`format_table`, :func:`table_cell`), CSV/JSON output and plots.

Nothing here needs CUDA or triton at import time: triton, matplotlib and FlexAttention are
imported where they are used.
"""
from __future__ import annotations

import csv
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

METHODS = ("flashmask", "flex", "sdpa_dense", "sdpa_flash", "sdpa_cudnn")  # the default set
# Opt-in methods (only when named in --methods): flashmask with deterministic=True, whose forward is
# the default one, so it has backward rows only; flashmask forced onto its SM80 kernels (on a Hopper
# GPU "flashmask" runs the SM90 ones where they exist); FlexAttention's FLASH backend
# (FlashAttention-4 on CuTe-DSL, where the `flash-attn-4` package is installed).
EXTRA_METHODS = ("flashmask_det", "flashmask_sm80", "flex_flash")
ALL_METHODS = METHODS + EXTRA_METHODS
METHOD_SKIP_MODES = {"flashmask_det": ("fwd",)}
MODES = ("fwd", "bwd", "fwdbwd")
# FLOPs of a mode relative to the forward's 4 * B * H * D * pairs.
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

ROW_FIELDS = ("family", "seqlen", "head_dim", "heads", "kv_heads", "batch", "mode", "method", "status", "density",
              "pairs", "ms", "tflops", "mask_build_ms", "first_call_s", "host_ms", "notes")


# --------------------------------------------------------------------------------------------
# Argument parsing helpers
# --------------------------------------------------------------------------------------------

def parse_int_list(text: str) -> List[int]:
    """``"8192,32k,128K,2m"`` -> ``[8192, 32768, 131072, 2097152]`` (k = 1024, m = 1024 * 1024)."""
    out = []
    for tok in str(text).split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        mult = 1
        if tok.endswith("k"):
            tok, mult = tok[:-1], 1024
        elif tok.endswith("m"):
            tok, mult = tok[:-1], 1024 * 1024
        try:
            val = int(tok) * mult
        except ValueError:
            raise ValueError(f"not an integer: {tok!r} in {text!r}") from None
        if val <= 0:
            raise ValueError(f"values must be positive, got {val} in {text!r}")
        out.append(val)
    if not out:
        raise ValueError(f"empty list: {text!r}")
    return out


def parse_choice_list(text: str, choices: Sequence[str], what: str) -> List[str]:
    """Comma-separated names, each checked against ``choices`` (``all`` = every choice)."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if items == ["all"]:
        return list(choices)
    bad = [t for t in items if t not in choices]
    if bad:
        raise ValueError(f"unknown {what} {bad}; choose from {', '.join(choices)}")
    if not items:
        raise ValueError(f"no {what} given")
    return list(dict.fromkeys(items))


def method_modes(method: str, modes: Sequence[str]) -> List[str]:
    """The modes of ``modes`` that ``method`` has rows for (``flashmask_det``: no ``fwd``, it is the
    default forward)."""
    skip = METHOD_SKIP_MODES.get(method, ())
    return [m for m in modes if m not in skip]


def fmt_len(s: int) -> str:
    return f"{s // 1024}K" if s % 1024 == 0 and s >= 1024 else str(s)


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# --------------------------------------------------------------------------------------------
# The column intervals, independent of masks/format.py
# --------------------------------------------------------------------------------------------

def _mask_layout(startend: torch.Tensor, causal: bool) -> int:
    if startend.dim() != 4:
        raise ValueError(f"startend_row_indices must be [B, Hm, Sk, C], got shape {tuple(startend.shape)}")
    c = startend.shape[-1]
    allowed = (1, 2) if causal else (2, 4)
    if c not in allowed:
        raise ValueError(f"causal={bool(causal)} needs C in {allowed}, got C={c}")
    return c


def canonical_intervals(startend: torch.Tensor, causal: bool, seqlen_q: int):
    """The two masked row intervals of every key column, ``(lts, lte, uts, ute)`` int64
    ``[B, Hm, Sk]`` clamped to ``[0, Sq]``: rows in ``[lts, lte)`` and in ``[uts, ute)`` are masked
    (absent vectors become neutral: ``lte = Sq``, ``uts = ute = 0``). See docs/format.md."""
    c = _mask_layout(startend, causal)
    x = startend.long().clamp(0, int(seqlen_q))
    cols = x.unbind(-1)
    zero = torch.zeros_like(cols[0])
    last = torch.full_like(cols[0], int(seqlen_q))
    if causal:
        return cols[0], (cols[1] if c == 2 else last), zero, zero
    if c == 2:
        return cols[0], last, zero, cols[1]
    return cols[0], cols[1], cols[2], cols[3]


def _len(a, b):
    return (b - a).clamp_min(0)


def count_pairs(startend: Optional[torch.Tensor], causal: bool, seqlen_q: Optional[int] = None,
                seqlen_k: Optional[int] = None) -> torch.Tensor:
    """Number of attended (query, key) pairs of every (batch, mask head): int64 ``[B, Hm]``.

    O(Sk): column j has up to three masked row intervals (the causal one ``[0, j - (Sk - Sq))``,
    ``[LTS, LTE)`` and ``[UTS, UTE)``); the size of their union comes by inclusion-exclusion,
    since the intersection of intervals is an interval. ``startend=None``: only ``causal``.
    """
    if startend is None:
        if seqlen_k is None:
            raise ValueError("count_pairs needs seqlen_k when startend is None")
        sk = int(seqlen_k)
        sq = sk if seqlen_q is None else int(seqlen_q)
        device = None
        lts = torch.full((1, 1, sk), sq, dtype=torch.long)
        lte, uts, ute = lts.clone(), torch.zeros_like(lts), torch.zeros_like(lts)
    else:
        sk = startend.shape[2]
        if seqlen_k is not None and int(seqlen_k) != sk:
            raise ValueError(f"seqlen_k={seqlen_k} but startend has Sk={sk}")
        sq = sk if seqlen_q is None else int(seqlen_q)
        device = startend.device
        lts, lte, uts, ute = canonical_intervals(startend, causal, sq)
    j = torch.arange(sk, device=device, dtype=torch.long)
    cs = torch.zeros_like(j)
    # Causal (bottom-right aligned): query i sees key j iff j <= i + Sk - Sq, so rows [0, j - Sk + Sq) are masked.
    ce = (j - (sk - sq)).clamp(0, sq) if causal else torch.zeros_like(j)
    cs, ce = cs.view(1, 1, sk), ce.view(1, 1, sk)
    a = _len(cs, ce)
    l_ = _len(lts, lte)
    u = _len(uts, ute)
    al = _len(torch.maximum(cs, lts), torch.minimum(ce, lte))
    au = _len(torch.maximum(cs, uts), torch.minimum(ce, ute))
    lu = _len(torch.maximum(lts, uts), torch.minimum(lte, ute))
    alu = _len(torch.maximum(torch.maximum(cs, lts), uts), torch.minimum(torch.minimum(ce, lte), ute))
    masked = a + l_ + u - al - au - lu + alu
    return (sq - masked).sum(-1)


def total_pairs(startend: Optional[torch.Tensor], causal: bool, *, batch: int, heads: int, seqlen_q: int,
                seqlen_k: int) -> int:
    """Attended pairs summed over the batch and the query heads (the FLOP count's ``B*H*pairs``)."""
    p = count_pairs(startend, causal, seqlen_q, seqlen_k)  # [Bm, Hm]
    bm, hm = p.shape
    if heads % hm:
        raise ValueError(f"{hm} mask heads do not divide {heads} query heads")
    per_sample = p.sum(1) * (heads // hm)
    if bm == batch:
        return int(per_sample.sum())
    if bm == 1:
        return int(per_sample.sum()) * batch
    raise ValueError(f"mask batch {bm} does not match batch {batch}")


def attn_flops(pairs: int, head_dim: int, mode: str) -> float:
    """FLOPs on unmasked pairs: fwd = 4 * D * pairs (pairs already summed over B and H), bwd = 2.5 x fwd,
    fwd+bwd = 3.5 x fwd."""
    return 4.0 * head_dim * pairs * FLOP_FACTOR[mode]


def fwd_tile(head_dim: int) -> Tuple[int, int]:
    """(BlockM, BlockN) of the forward kernel; mirrors ``fwd_tile`` in csrc/sm80/tile_config.h."""
    if head_dim <= 64:
        return 128, 128
    return 128, 64


def bwd_tile(head_dim: int) -> Tuple[int, int]:
    """(BlockM, BlockN) of the backward kernel; mirrors ``bwd_tile`` in csrc/sm80/tile_config.h."""
    return (64, 128) if head_dim <= 128 else (64, 64)


def add_timing_args(p) -> None:
    """--quick / --warmup / --rep of the do_bench timings; resolve_timing fills the defaults."""
    p.add_argument("--quick", action="store_true", help="fewer repetitions (warmup 10 ms, rep 30 ms)")
    p.add_argument("--warmup", type=float, default=None, help="do_bench warmup in ms (default 25, --quick 10)")
    p.add_argument("--rep", type=float, default=None, help="do_bench repetition time in ms (default 100, --quick 30)")


def resolve_timing(args) -> None:
    if args.warmup is None:
        args.warmup = 10.0 if args.quick else 25.0
    if args.rep is None:
        args.rep = 30.0 if args.quick else 100.0


def add_testing_args(p, device_help: str = "torch device (cpu only for smoke tests)") -> None:
    """The options that let the CPU smoke tests run a benchmark script without CUDA."""
    g = p.add_argument_group("testing options")
    g.add_argument("--device", default="cuda", help=device_help)
    g.add_argument("--flashmask-backend", default="cuda", choices=["cuda", "auto", "reference"],
                   help="backend= passed to flashmask_attention")
    g.add_argument("--flex-no-compile", action="store_true", help="eager flex_attention (slow; for smoke tests)")


def bounds_bytes(startend: torch.Tensor, block_n: int) -> int:
    """Bytes of the per-key-block mask bounds (8 int32 per block of ``block_n`` columns, csrc/mask/bounds.h)."""
    b, hm, sk, _ = startend.shape
    return b * hm * math.ceil(sk / block_n) * 8 * 4


def _block_min_max(x: torch.Tensor, block: int):
    """Min and max of ``x [..., S]`` over blocks of ``block`` columns (the last block may be short)."""
    s = x.shape[-1]
    nb = math.ceil(s / block)
    pad = nb * block - s
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)  # repeating the last column is neutral
    x = x.reshape(*x.shape[:-1], nb, block)
    return x.amin(-1), x.amax(-1)


def tile_stats(startend: Optional[torch.Tensor], causal: bool, seqlen_q: int, block_m: int, block_n: int,
               seqlen_k: Optional[int] = None, return_maps: bool = False) -> Dict[str, object]:
    """Classify every (query tile, key block) pair by the kernels' rules (csrc/mask/intervals.h).

    A tile is skipped when the causal triangle or one interval hides it whole (from the per-block
    min/max); it is partial when the causal diagonal or an interval may touch it. Returns counts
    ``tiles``, ``live`` (not skipped), ``partial`` and ``live_fraction``, summed over (b, mask head);
    ``return_maps`` adds the bool maps ``live_map`` and ``partial_map`` ``[B, Hm, n_query_tiles, n_key_blocks]``,
    and ``cut_map``: the tiles the column intervals alone may touch (the causal diagonal left out).
    """
    if startend is None:  # nothing masked beyond causal: LTS = Sq (and UTE = 0 when non-causal)
        sk = int(seqlen_k)
        startend = torch.zeros(1, 1, sk, 1 if causal else 2, dtype=torch.int32)
        startend[..., 0] = int(seqlen_q)
    sk = startend.shape[2]
    sq = int(seqlen_q)
    lts, lte, uts, ute = canonical_intervals(startend, causal, sq)
    nm, nn = math.ceil(sq / block_m), math.ceil(sk / block_n)
    r0 = (torch.arange(nm, device=startend.device) * block_m).view(nm, 1)
    r1 = torch.clamp(r0 + block_m, max=sq)
    c0 = (torch.arange(nn, device=startend.device) * block_n).view(1, nn)
    c1 = torch.clamp(c0 + block_n, max=sk)
    off = sk - sq

    def mm(t):
        lo, hi = _block_min_max(t, block_n)  # [B, Hm, nn]
        return lo.unsqueeze(-2), hi.unsqueeze(-2)  # [B, Hm, 1, nn]

    (lts_lo, lts_hi), (lte_lo, lte_hi) = mm(lts), mm(lte)
    (uts_lo, uts_hi), (ute_lo, ute_hi) = mm(uts), mm(ute)
    full = ((r0 >= lts_hi) & (r1 <= lte_lo)) | ((r0 >= uts_hi) & (r1 <= ute_lo))
    cut = ((r1 > lts_lo) & (r0 < lte_hi)) | ((r1 > uts_lo) & (r0 < ute_hi))
    part = cut
    if causal:  # key j visible from row j - off on: the block is hidden if its first key is past the last row
        full = full | (c0 > (r1 - 1 + off))
        part = part | ((c1 - 1) > (r0 + off))
    live = ~full
    part = live & part
    tiles = live.numel()
    n_live = int(live.sum())
    out = {"tiles": tiles, "live": n_live, "partial": int(part.sum()), "live_fraction": n_live / max(tiles, 1)}
    if return_maps:
        out["live_map"], out["partial_map"], out["cut_map"] = live, part, cut
    return out


def is_plain(startend: Optional[torch.Tensor], causal: bool, seqlen_q: int) -> bool:
    """True when the mask hides nothing beyond ``causal`` (expressible as SDPA ``is_causal``)."""
    if startend is None:
        return True
    sk = startend.shape[2]
    plain = int(count_pairs(None, causal, seqlen_q, sk).item())
    return bool((count_pairs(startend, causal, seqlen_q) == plain).all())


# --------------------------------------------------------------------------------------------
# FlexAttention glue
# --------------------------------------------------------------------------------------------

def _split_vectors(startend: torch.Tensor, num_heads: Optional[int]):
    """The C vectors of the mask as contiguous int32 tensors, ``[B, Sk]`` when Hm == 1 else ``[B, Hm, Sk]``."""
    hm = startend.shape[1]
    if hm == 1:
        return [startend[:, 0, :, i].contiguous() for i in range(startend.shape[-1])]
    if num_heads is None or num_heads % hm:
        raise ValueError(f"a mask with Hm={hm} heads needs num_heads (a multiple of Hm), got {num_heads}")
    return [startend[..., i].contiguous() for i in range(startend.shape[-1])]


def _mask_mod_from_vectors(vecs, causal: bool, offset: int, group: int):
    """A FlexAttention ``mask_mod`` (True = attend) over the interval vectors ``vecs`` (the table of docs/format.md).

    ``offset = Sk - Sq``: causal keeps ``kv_idx <= q_idx + offset`` (bottom-right alignment).
    ``group = Hq // Hm`` when the vectors carry a head dimension, else 0.
    """
    if group:
        def col(t, b, h, kv):
            return t[b, h // group, kv]
    else:
        def col(t, b, h, kv):
            return t[b, kv]

    c = len(vecs)
    if causal and c == 1:
        (lts,) = vecs

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + offset) & (q_idx < col(lts, b, h, kv_idx))
    elif causal and c == 2:
        lts, lte = vecs

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + offset) & ((q_idx < col(lts, b, h, kv_idx)) | (q_idx >= col(lte, b, h, kv_idx)))
    elif not causal and c == 2:
        lts, ute = vecs

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx < col(lts, b, h, kv_idx)) & (q_idx >= col(ute, b, h, kv_idx))
    elif not causal and c == 4:
        lts, lte, uts, ute = vecs

        def mask_mod(b, h, q_idx, kv_idx):
            lower = (q_idx < col(lts, b, h, kv_idx)) | (q_idx >= col(lte, b, h, kv_idx))
            upper = (q_idx < col(uts, b, h, kv_idx)) | (q_idx >= col(ute, b, h, kv_idx))
            return lower & upper
    else:
        raise ValueError(f"causal={causal} with C={c} is not a FlashMask layout")
    return mask_mod


def flex_mask_mod(startend: torch.Tensor, causal: bool, seqlen_q: Optional[int] = None,
                  num_heads: Optional[int] = None):
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` giving exactly the mask of ``startend``.

    ``h`` is the query head (``num_heads`` is needed when the mask has Hm > 1 heads). The vectors
    are copied; the function also works on broadcast index tensors (as in a plain PyTorch call).
    """
    _mask_layout(startend, causal)
    sk = startend.shape[2]
    sq = sk if seqlen_q is None else int(seqlen_q)
    hm = startend.shape[1]
    vecs = _split_vectors(startend, num_heads)
    return _mask_mod_from_vectors(vecs, bool(causal), sk - sq, 0 if hm == 1 else num_heads // hm)


class FlexMaskModCache:
    """One ``mask_mod`` function per mask layout (causal mode, C, shape, device).

    A later mask of the same layout has its values copied into the same buffers and gets the same
    function object back, so ``torch.compile`` sees the same function and the same tensors (only
    their values change) and reuses its compiled FlexAttention kernels instead of recompiling.
    A mask_mod handed out earlier therefore follows the latest mask of its layout.
    """

    def __init__(self):
        self._entries: Dict[tuple, Tuple[list, Callable]] = {}

    def get(self, startend: torch.Tensor, causal: bool, seqlen_q: int, num_heads: Optional[int]):
        key = (bool(causal), tuple(startend.shape), str(startend.device), int(seqlen_q),
               None if startend.shape[1] == 1 else num_heads)
        vecs = _split_vectors(startend, num_heads)
        if key in self._entries:
            bufs, fn = self._entries[key]
            for buf, v in zip(bufs, vecs):
                buf.copy_(v)
            return fn
        hm, sk = startend.shape[1], startend.shape[2]
        fn = _mask_mod_from_vectors(vecs, bool(causal), sk - int(seqlen_q), 0 if hm == 1 else num_heads // hm)
        self._entries[key] = (vecs, fn)
        return fn

    def clear(self):
        self._entries.clear()


FLEX_MASK_MODS = FlexMaskModCache()
_COMPILED: Dict[str, Callable] = {}


def configure_dynamo(retain_graph: bool = False) -> None:
    """Room for the recompiles of a sweep (one per mask layout, length and grad mode), and no
    donated buffers when backward is run repeatedly on one graph (``retain_graph=True``)."""
    try:
        import torch._dynamo
        cfg = torch._dynamo.config
        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(int(getattr(cfg, name)), 256))
        for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(int(getattr(cfg, name)), 4096))
    except Exception as e:  # pragma: no cover - depends on the torch build
        print(f"warning: could not configure torch._dynamo: {e}", file=sys.stderr)
    if retain_graph:
        try:
            import torch._functorch.config as fcfg
            if hasattr(fcfg, "donated_buffer"):
                fcfg.donated_buffer = False
        except Exception:  # pragma: no cover
            pass


def compiled_flex_attention(compile: bool = True):
    """``torch.compile(flex_attention, dynamic=False)``, made once (``compile=False``: eager, for tests)."""
    from torch.nn.attention.flex_attention import flex_attention
    if not compile:
        return flex_attention
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask
    if "cbm" not in _COMPILED:
        _COMPILED["cbm"] = torch.compile(create_block_mask, dynamic=False)
    return _COMPILED["cbm"]


def free_memory_bytes(device: torch.device) -> Optional[int]:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    # Memory cached by the allocator is free for us too.
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def build_block_mask(mask_mod, batch: Optional[int], heads: Optional[int], seqlen_q: int, seqlen_k: int,
                     device: torch.device, how: str = "auto") -> Tuple[object, str]:
    """``create_block_mask`` eagerly (it materialises the Sq x Sk mask and a few temporaries) when
    that fits in half the free memory, else through ``torch.compile`` (fused, no dense mask).
    Returns ``(block_mask, "eager" | "compiled")``."""
    from torch.nn.attention.flex_attention import create_block_mask
    if how not in ("auto", "eager", "compile"):
        raise ValueError(f"how must be auto, eager or compile, got {how!r}")
    if how == "auto":
        free = free_memory_bytes(device)
        need = 8 * (batch or 1) * (heads or 1) * seqlen_q * seqlen_k  # the bool mask and its temporaries
        how = "eager" if free is None or need <= 0.5 * free else "compile"
    fn = create_block_mask if how == "eager" else _compiled_create_block_mask()
    bm = fn(mask_mod, batch, heads, seqlen_q, seqlen_k, device=device)
    return bm, ("eager" if how == "eager" else "compiled")


_BLOCK_MASK_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                       "q_indices", "full_q_num_blocks", "full_q_indices")


def block_mask_bytes(bm) -> int:
    """Bytes of the tensors a FlexAttention ``BlockMask`` holds."""
    total, seen = 0, set()
    for name in _BLOCK_MASK_TENSORS + ("dq_write_order", "dq_write_order_full"):
        t = getattr(bm, name, None)
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def block_mask_bytes_estimate(batch: int, heads: int, seqlen_q: int, seqlen_k: int, block: int = 128) -> int:
    """Bytes of a ``create_block_mask`` result: int32 counts and dense ``[nq, nkv]`` index tables for
    partial and full blocks, in both the kv-major and the q-major direction."""
    nq, nk = math.ceil(seqlen_q / block), math.ceil(seqlen_k / block)
    return 4 * batch * heads * (2 * nq + 2 * nq * nk + 2 * nk + 2 * nk * nq)


# --------------------------------------------------------------------------------------------
# Dense masks for SDPA
# --------------------------------------------------------------------------------------------

def dense_mask_bytes(batch: int, mask_heads: int, seqlen_q: int, seqlen_k: int) -> int:
    return batch * mask_heads * seqlen_q * seqlen_k


def dense_fit(batch: int, mask_heads: int, seqlen_q: int, seqlen_k: int, dtype: torch.dtype,
              device: torch.device, fraction: float = 0.5, additive: bool = False) -> Tuple[bool, str]:
    """Whether a dense mask fits in ``fraction`` of the free memory. Returns ``(fits, note)``.

    ``additive=False``: a bool mask plus the additive mask in ``dtype`` that SDPA makes of it on each
    call. ``additive=True``: one additive mask in ``dtype`` (given to SDPA as is).
    """
    n = dense_mask_bytes(batch, mask_heads, seqlen_q, seqlen_k)
    size = torch.empty((), dtype=dtype).element_size()
    if additive:
        need = n * size
        note = f"S^2 mask = {need / 1e9:.1f} GB additive {str(dtype).replace('torch.', '')}"
    else:
        need = n * (1 + size)
        note = f"S^2 mask = {n / 1e9:.1f} GB bool + {need / 1e9 - n / 1e9:.1f} GB additive mask per call"
    free = free_memory_bytes(device)
    note += "" if free is None else f", {free / 1e9:.1f} GB free"
    if free is not None and need > fraction * free:
        return False, f"does not fit ({note})"
    return True, note


def dense_mask(startend: torch.Tensor, causal: bool, seqlen_q: int, chunk_bytes: int = 1 << 27,
               dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """The dense mask ``[B, Hm, Sq, Sk]``, expanded with ``masks.format.to_dense`` a chunk of rows at
    a time on the mask's device. ``dtype=torch.bool``: True = attend; a float dtype: an additive
    mask, 0 where attended and the dtype's lowest value elsewhere (as transformers makes them)."""
    from masks.format import to_dense
    b, hm, sk, _ = startend.shape
    out = torch.empty(b, hm, seqlen_q, sk, dtype=dtype, device=startend.device)
    rows = max(1, chunk_bytes // max(1, b * hm * sk))
    for r0 in range(0, seqlen_q, rows):
        r1 = min(seqlen_q, r0 + rows)
        allowed = to_dense(startend, causal, seqlen_q=seqlen_q, rows=slice(r0, r1))
        if dtype == torch.bool:
            out[:, :, r0:r1] = allowed
        else:
            out[:, :, r0:r1].zero_().masked_fill_(~allowed, torch.finfo(dtype).min)
    return out


# --------------------------------------------------------------------------------------------
# Methods
# --------------------------------------------------------------------------------------------

class Skip(Exception):
    """A method that does not apply to a configuration. ``report=False``: leave no row for it."""

    def __init__(self, message: str, report: bool = True):
        super().__init__(message)
        self.report = report


@dataclass
class Problem:
    startend: torch.Tensor
    causal: bool
    batch: int
    heads: int
    head_dim: int
    seqlen: int
    dtype: torch.dtype
    device: torch.device
    kv_heads: Optional[int] = None  # GQA: fewer key/value heads than query heads (None: as many)

    @property
    def gqa(self) -> bool:
        return self.kv_heads is not None and self.kv_heads != self.heads


@dataclass
class Options:
    flashmask_backend: str = "cuda"
    flex_compile: bool = True
    flex_block_mask: str = "auto"  # auto | eager | compile
    dense_mem_fraction: float = 0.5
    force_backward: bool = False


@dataclass
class Prepared:
    attn: Callable  # (q, k, v) [B, S, H, D] -> out [B, S, H, D]
    mask_bytes: Optional[int] = None  # the method's mask representation kept for the calls
    build_ms: Optional[float] = None  # time to build that representation
    notes: List[str] = field(default_factory=list)
    no_backward: Optional[str] = None  # why backward is not timed (reported as n/a)
    state: Dict[str, object] = field(default_factory=dict)  # tensors to drop when done


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


sync = _sync  # the public name, for the scripts


def _bhsd(x):
    return x.transpose(1, 2)


def prepare_method(method: str, p: Problem, opt: Options) -> Prepared:
    """Build what ``method`` needs for the mask of ``p`` and return its attention callable.

    Raises :class:`Skip` when the method does not apply (e.g. flash/cuDNN SDPA with a mask other
    than causal or none, a dense mask that does not fit).
    """
    sq = sk = p.seqlen
    if method in ("flashmask", "flashmask_det", "flashmask_sm80"):
        import flashmask
        if opt.flashmask_backend == "cuda" and not flashmask.cuda.available():
            raise RuntimeError(f"flashmask CUDA kernels unavailable: {flashmask.cuda.unavailable_reason()}")
        startend, causal, backend = p.startend, p.causal, opt.flashmask_backend
        if method == "flashmask_sm80" and backend == "cuda":
            backend = "sm80"
        deterministic = method == "flashmask_det"

        def attn(q, k, v):
            return flashmask.flashmask_attention(q, k, v, startend, causal=causal, backend=backend,
                                                 deterministic=deterministic)

        _, bn = fwd_tile(p.head_dim)
        prep = Prepared(attn, mask_bytes=startend.numel() * startend.element_size() + bounds_bytes(startend, bn))
        if backend in ("cuda", "sm80") and not flashmask.cuda.has_backward() and not opt.force_backward:
            prep.no_backward = "n/a (no kernel)"
        elif backend in ("cuda", "sm80") and not flashmask.cuda.has_backward():
            prep.notes.append("bwd via reference path (no kernel)")
        return prep

    if method in ("flex", "flex_flash"):
        hm = p.startend.shape[1]
        mm = FLEX_MASK_MODS.get(p.startend, p.causal, sq, p.heads)
        bm_batch = None if p.startend.shape[0] == 1 else p.startend.shape[0]
        bm_heads = None if hm == 1 else p.heads
        _sync(p.device)
        t0 = time.perf_counter()
        bm, how = build_block_mask(mm, bm_batch, bm_heads, sq, sk, p.device, opt.flex_block_mask)
        _sync(p.device)
        build_ms = (time.perf_counter() - t0) * 1e3
        flex = compiled_flex_attention(opt.flex_compile)

        gqa = p.gqa
        options = {"BACKEND": "FLASH"} if method == "flex_flash" else None

        def attn(q, k, v):
            return _bhsd(flex(_bhsd(q), _bhsd(k), _bhsd(v), block_mask=bm, enable_gqa=gqa, kernel_options=options))

        prep = Prepared(attn, mask_bytes=block_mask_bytes(bm), build_ms=build_ms, state={"bm": bm})
        prep.notes.append(f"block mask {how} {build_ms:.0f} ms")
        return prep

    import torch.nn.functional as F
    if method == "sdpa_dense":
        hm = p.startend.shape[1]
        if hm not in (1, p.heads):
            raise Skip(f"dense mask with {hm} heads does not broadcast to {p.heads} heads")
        fits, note = dense_fit(p.startend.shape[0], hm, sq, sk, p.dtype, p.device, opt.dense_mem_fraction)
        if not fits:
            raise Skip(note)
        _sync(p.device)
        t0 = time.perf_counter()
        dense = dense_mask(p.startend, p.causal, sq)
        _sync(p.device)
        build_ms = (time.perf_counter() - t0) * 1e3

        gqa = p.gqa

        def attn(q, k, v):
            return _bhsd(F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), attn_mask=dense, enable_gqa=gqa))

        return Prepared(attn, mask_bytes=dense.numel(), build_ms=build_ms, state={"dense": dense})

    if method in ("sdpa_flash", "sdpa_cudnn"):
        if not is_plain(p.startend, p.causal, sq):
            raise Skip(f"{method} takes only causal or no mask", report=False)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = SDPBackend.FLASH_ATTENTION if method == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        causal, gqa = p.causal, p.gqa

        def attn(q, k, v):
            with sdpa_kernel(backend):
                return _bhsd(F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), is_causal=causal,
                                                            enable_gqa=gqa))

        return Prepared(attn, mask_bytes=0)

    raise ValueError(f"unknown method {method!r}; choose from {ALL_METHODS}")


def release(prep: Optional[Prepared]) -> None:
    if prep is not None:
        prep.state.clear()
        prep.attn = None


# --------------------------------------------------------------------------------------------
# Inputs, timing, errors
# --------------------------------------------------------------------------------------------

def make_inputs(batch: int, seqlen: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                seed: int = 0, kv_heads: Optional[int] = None):
    """Fresh random q, k, v (requiring grad) and dout: q and dout ``[B, S, H, D]``, k and v
    ``[B, S, kv_heads, D]`` (default ``H``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, seqlen, heads, head_dim)
    kv_shape = (batch, seqlen, heads if kv_heads is None else kv_heads, head_dim)
    q, k, v, dout = (torch.randn(sh, generator=g, device=device, dtype=dtype) for sh in (shape, kv_shape, kv_shape, shape))
    for t in (q, k, v):
        t.requires_grad_(True)
    return q, k, v, dout


def make_step(attn: Callable, mode: str, q, k, v, dout) -> Callable:
    """The function to time. ``bwd`` runs the forward once here, outside the timed function."""
    if mode == "fwd":
        qd, kd, vd = q.detach(), k.detach(), v.detach()  # no autograd state at all in the forward timing

        def step():
            with torch.no_grad():
                return attn(qd, kd, vd)
    elif mode == "bwd":
        out = attn(q, k, v)

        def step():
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    elif mode == "fwdbwd":
        def step():
            out = attn(q, k, v)
            return torch.autograd.grad(out, (q, k, v), dout)
    else:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    return step


def _fallback_bench(fn: Callable, warmup_ms: float, rep_ms: float, device: torch.device) -> float:
    """Median per-call time in ms, each call timed alone (CUDA events on GPU, perf_counter else)."""
    def one() -> float:
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    est = max(one(), 1e-3)
    for _ in range(int(warmup_ms / est)):
        fn()
    times = [one() for _ in range(max(1, min(10000, int(rep_ms / est))))]
    return float(statistics.median(times))


MIN_TIMED_CALLS = 5


def time_ms(fn: Callable, warmup_ms: float, rep_ms: float, device: torch.device) -> float:
    """Median ms of ``fn`` by ``triton.testing.do_bench`` on CUDA (imported here, not at import time)."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            # At 32K and beyond one call outlasts rep_ms, and do_bench would time it once: take
            # at least MIN_TIMED_CALLS calls.
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            rep_ms = max(rep_ms, MIN_TIMED_CALLS * s.elapsed_time(e))
            return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return _fallback_bench(fn, warmup_ms, rep_ms, device)


# A call shorter than this may wait for its own launch path (tens of microseconds of Python and
# driver): such cells also get their host time per call measured.
HOST_CHECK_BELOW_MS = 2.0
# At this share of the measured time the GPU is (nearly) waiting for the host: a host slowed down
# for a moment then makes a whole cell slow (docs/perf_notes.md, version 43's measured row).
HOST_BOUND_SHARE = 0.8


def host_ms_per_call(fn: Callable, device: torch.device, calls: int = 20) -> float:
    """Host time per call (ms) of ``calls`` calls issued back to back, their GPU work queued behind."""
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e3
    _sync(device)
    return host


def host_bound_note(ms: float, host_ms: Optional[float]) -> str:
    """A note for a cell whose launch path takes nearly as long as its measured call, else ""."""
    if host_ms is None or host_ms < HOST_BOUND_SHARE * ms:
        return ""
    return f"host-bound? {host_ms:.3f} ms of host time a call against {ms:.3f} ms measured"


def run_mode(prep: Prepared, mode: str, tensors, warmup_ms: float, rep_ms: float,
             device: torch.device) -> Tuple[float, float, Optional[float]]:
    """``(median ms, first-call seconds, host ms per call)``; the first call (compilation, plans) is
    not in the median; the host time only for CUDA calls shorter than HOST_CHECK_BELOW_MS (else None)."""
    q, k, v, dout = tensors
    _sync(device)
    t0 = time.perf_counter()
    step = make_step(prep.attn, mode, q, k, v, dout)
    r = step()
    del r
    _sync(device)
    first = time.perf_counter() - t0
    ms = time_ms(step, warmup_ms, rep_ms, device)
    host = host_ms_per_call(step, device) if device.type == "cuda" and ms < HOST_CHECK_BELOW_MS else None
    del step
    return ms, first, host


def reset_peak(device: torch.device) -> Optional[int]:
    """Synchronise, reset the CUDA peak counter and return the bytes allocated now (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.memory_allocated(device))


def peak_since(device: torch.device, base: Optional[int] = 0) -> Optional[int]:
    """``torch.cuda.max_memory_allocated`` minus ``base`` (bytes; None off CUDA)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device) - (base or 0))


def status_of(e: BaseException) -> str:
    return "oom" if is_oom(e) else "error"


def try_prepare(method: str, problem: Problem, opt: Options) -> Tuple[Optional[Prepared], Optional[dict]]:
    """``(prepared, None)``, or ``(None, outcome)`` with outcome ``{"status", "notes", "fatal"}``;
    status ``"skip"`` means: leave no row (the method does not apply and need not be listed)."""
    try:
        return prepare_method(method, problem, opt), None
    except Skip as e:
        return None, {"status": "n/a" if e.report else "skip", "notes": str(e), "fatal": False}
    except Exception as e:
        return None, {"status": status_of(e), "notes": f"setup: {format_error(e)}", "fatal": is_fatal_cuda_error(e)}


def try_time(prep: Prepared, mode: str, tensors, pairs: int, head_dim: int, warmup_ms: float, rep_ms: float,
             device: torch.device) -> dict:
    """Time one mode; never raises. Returns ``{"status", "ms", "tflops", "first_call_s", "host_ms",
    "notes", "fatal"}``; a cell that may be bound by its launch path says so in its notes."""
    notes = [n for n in prep.notes if n]
    if mode != "fwd" and prep.no_backward:
        return {"status": "n/a", "notes": prep.no_backward, "fatal": False}
    try:
        ms, first, host = run_mode(prep, mode, tensors, warmup_ms, rep_ms, device)
        tflops = attn_flops(pairs, head_dim, mode) / (ms * 1e-3) / 1e12
        host_note = host_bound_note(ms, host)
        if host_note:
            notes.append(host_note)
        return {"status": "ok", "ms": ms, "tflops": tflops, "first_call_s": first, "host_ms": host,
                "notes": "; ".join(notes), "fatal": False}
    except Exception as e:
        return {"status": status_of(e), "notes": "; ".join([*notes, format_error(e)]),
                "fatal": is_fatal_cuda_error(e)}


def is_oom(e: BaseException) -> bool:
    return isinstance(e, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in str(e).lower()


def is_fatal_cuda_error(e: BaseException) -> bool:
    """Errors after which the CUDA context is unusable (every later call would fail too)."""
    msg = str(e).lower()
    return any(s in msg for s in ("illegal memory access", "unspecified launch failure", "misaligned address",
                                  "illegal instruction", "device-side assert"))


def format_error(e: BaseException, limit: int = 240) -> str:
    if is_oom(e):
        return "OOM"
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    msg = f"{type(e).__name__}: {lines[0] if lines else ''}"
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def cleanup(collect: bool = True) -> None:
    """Free what can be freed: ``gc.collect()`` (slow with a big heap: at config boundaries and after
    errors, whose tracebacks hold frames and tensors) and the CUDA allocator's cached blocks."""
    if collect:
        gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()
        except Exception:  # a sticky CUDA error: nothing more to free
            pass
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]], align: Optional[str] = None) -> str:
    """A plain fixed-width table; ``align`` is a string of 'l'/'r' per column (default: first left)."""
    rows = [["" if c is None else str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    align = align or ("l" + "r" * (len(headers) - 1))

    def line(cells):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def table_cell(row: Optional[dict], key: str = "ms", fmt="{:.3f}") -> str:
    """A table cell: ``row[key]`` formatted (``fmt``: a format string or a function), or the row's
    status (``n/a``, ``OOM``, ``err``) when it failed; ``-`` without a row or without the number."""
    if row is None:
        return "-"
    if row["status"] != "ok":
        return {"n/a": "n/a", "oom": "OOM", "error": "err"}.get(row["status"], row["status"])
    if row.get(key) is None:
        return "-"
    return fmt(row[key]) if callable(fmt) else fmt.format(row[key])


def shorten(text: Optional[str], limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters (with ``...``) for a table cell."""
    text = text or ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _csv_value(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def write_results(out_dir: str, stem: str, rows: List[dict], fields: Sequence[str], meta: dict) -> Tuple[str, str]:
    """``out_dir/stem.csv`` and ``out_dir/stem.json`` (``{"meta": ..., "rows": [...]}``)."""
    os.makedirs(out_dir, exist_ok=True)
    csv_path, json_path = os.path.join(out_dir, stem + ".csv"), os.path.join(out_dir, stem + ".json")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r.get(k)) for k in fields})
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    return csv_path, json_path


def default_out_dir(name: str) -> str:
    """``benchmarks/results/<name>``; the results folder gets a .gitignore that ignores everything."""
    base = os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(base, exist_ok=True)
    gi = os.path.join(base, ".gitignore")
    if not os.path.exists(gi):
        with open(gi, "w") as f:
            f.write("*\n")
    return os.path.join(base, name)


def environment(device: torch.device) -> dict:
    """Versions and the device, for the JSON metadata."""
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device),
           "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if device.type == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    try:
        import flashmask
        env["flashmask"] = flashmask.__version__
        env["flashmask_kernels"] = flashmask.cuda.available()
        env["flashmask_backward_kernel"] = flashmask.cuda.has_backward()
    except Exception as e:  # pragma: no cover
        env["flashmask"] = f"import failed: {e}"
    return env


def pyplot():
    """matplotlib.pyplot with the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
