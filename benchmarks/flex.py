"""FlexAttention glue: a ``mask_mod`` giving exactly the mask of a ``startend_row_indices`` tensor,
a cache that keeps compiled kernels reusable, the compiled ``flex_attention`` and block-mask
builder, the bytes a ``BlockMask`` holds, and flashmask's ``softcap`` (a ``score_mod``) and
``sinks`` (a renormalisation by the LSE) in FlexAttention's terms. FlexAttention is imported where
it is used."""
from __future__ import annotations

import math
import sys
from typing import Callable, Dict, Optional, Tuple

import torch

from benchmarks import cuda_memory
from benchmarks.flops import check_layout


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
    check_layout(startend, causal)
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
    A mask_mod handed out earlier therefore follows the latest mask of its layout and ``tag``:
    masks in use together (one per layer type of a model) need tags of their own.
    """

    def __init__(self):
        self._entries: Dict[tuple, Tuple[list, Callable]] = {}

    def get(self, startend: torch.Tensor, causal: bool, seqlen_q: int, num_heads: Optional[int],
            tag: Optional[str] = None):
        key = (bool(causal), tuple(startend.shape), str(startend.device), int(seqlen_q),
               None if startend.shape[1] == 1 else num_heads, tag)
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


_SOFTCAP_MODS: Dict[float, Callable] = {}


def softcap_score_mod(softcap: float) -> Callable:
    """A ``score_mod`` giving flashmask's ``softcap``: FlexAttention multiplies q.k by ``scale`` before
    it calls ``score_mod`` (as flashmask applies ``softmax_scale`` first), so the score it gets is
    ``s = (q.k) * scale`` and it returns ``softcap * tanh(s / softcap)``. One function per value, so
    that ``torch.compile`` reuses its kernels from one call to the next."""
    softcap = float(softcap)
    if not softcap > 0 or not math.isfinite(softcap):
        raise ValueError(f"softcap must be a finite float > 0, got {softcap}")
    if softcap not in _SOFTCAP_MODS:
        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)
        _SOFTCAP_MODS[softcap] = score_mod
    return _SOFTCAP_MODS[softcap]


def sink_renorm(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with sinks from attention without them: ``out`` ``[B, H, S, Dv]`` and its natural-log
    LSE ``[B, H, S]``, ``sinks`` ``[H]``. A sink adds ``exp(sink_h)`` to each row's denominator only,
    so ``out_sink = out * exp(lse) / (exp(lse) + exp(sink_h)) = out * sigmoid(lse - sink_h)``: exact,
    and differentiable in out, lse and sinks. A row no key may attend (out 0, LSE -inf) stays 0."""
    ct = torch.promote_types(out.dtype, torch.float32)  # float32 for bf16/fp16 outputs
    w = torch.sigmoid(lse.to(ct) - sinks.to(ct).view(1, -1, 1))
    return (out.to(ct) * w.unsqueeze(-1)).to(out.dtype)


def _lse_request() -> dict:
    """The keyword that makes flex_attention return its LSE (``return_aux`` since torch 2.9)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # pragma: no cover - older torch
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def flex_attention_with_sinks(q, k, v, sinks, *, block_mask=None, score_mod=None, enable_gqa=False,
                              kernel_options=None):
    """``flex_attention`` with attention sinks ``[Hq]``: its output renormalised by its LSE
    (:func:`sink_renorm`). ``q, k, v`` ``[B, H, S, D]``."""
    from torch.nn.attention.flex_attention import flex_attention
    out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa,
                              kernel_options=kernel_options, **_lse_request())
    return sink_renorm(out, getattr(aux, "lse", aux), sinks)


def compiled_flex_attention_with_sinks(compile: bool = True):
    """:func:`flex_attention_with_sinks` through ``torch.compile(dynamic=False)`` (the renormalisation
    fused with what follows the kernel), made once; ``compile=False``: eager, for tests."""
    if not compile:
        return flex_attention_with_sinks
    if "flex_sinks" not in _COMPILED:
        _COMPILED["flex_sinks"] = torch.compile(flex_attention_with_sinks, dynamic=False)
    return _COMPILED["flex_sinks"]


def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask
    if "cbm" not in _COMPILED:
        _COMPILED["cbm"] = torch.compile(create_block_mask, dynamic=False)
    return _COMPILED["cbm"]


def build_block_mask(mask_mod, batch: Optional[int], heads: Optional[int], seqlen_q: int, seqlen_k: int,
                     device: torch.device, how: str = "auto") -> Tuple[object, str]:
    """``create_block_mask`` eagerly (it materialises the Sq x Sk mask and a few temporaries) when
    that fits in half the free memory, else through ``torch.compile`` (fused, no dense mask).
    Returns ``(block_mask, "eager" | "compiled")``."""
    from torch.nn.attention.flex_attention import create_block_mask
    if how not in ("auto", "eager", "compile"):
        raise ValueError(f"how must be auto, eager or compile, got {how!r}")
    if how == "auto":
        free = cuda_memory.free_memory_bytes(device)
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
