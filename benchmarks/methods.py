"""The attention methods compared, behind one interface: :func:`prepare_method` returns a
:class:`Prepared` whose ``attn(q, k, v)`` takes ``[B, S, H, D]`` tensors (v's head dim may differ
from q's and k's) and returns ``[B, S, H, Dv]``, with the problem's soft-capping and attention
sinks where the method can express them (:func:`option_refusal` says why not elsewhere)."""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from benchmarks import flex
from benchmarks.dense_masks import dense_fit, dense_mask
from benchmarks.errors import format_error, is_fatal_cuda_error, status_of
from benchmarks.flops import is_plain
from benchmarks.tiles import bounds_bytes, fwd_tile
from benchmarks.timing import sync

METHODS = ("flashmask", "flex", "sdpa_dense", "sdpa_flash", "sdpa_cudnn")  # the default set
# Opt-in methods (only when named in --methods): flashmask with deterministic=True, whose forward is
# the default one, so it has backward rows only; flashmask forced onto its SM80 kernels (on a Hopper
# GPU "flashmask" runs the SM90 ones where they exist); FlexAttention's FLASH backend
# (FlashAttention-4 on CuTe-DSL, where the `flash-attn-4` package is installed); flashmask with no mask
# tensor on the plain causal and full families (the kernels built for no mask, as SDPA's is_causal).
EXTRA_METHODS = ("flashmask_det", "flashmask_sm80", "flex_flash", "flashmask_plain")
ALL_METHODS = METHODS + EXTRA_METHODS
METHOD_SKIP_MODES = {"flashmask_det": ("fwd",)}


def method_modes(method: str, modes: Sequence[str]) -> List[str]:
    """The modes of ``modes`` that ``method`` has rows for (``flashmask_det``: no ``fwd``, it is the
    default forward)."""
    skip = METHOD_SKIP_MODES.get(method, ())
    return [m for m in modes if m not in skip]


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
    head_dim_v: Optional[int] = None  # v's head dim when it differs from q's and k's (None: equal)
    softcap: float = 0.0  # logit soft-capping (flashmask_attention's softcap; 0: off)
    sinks: Optional[torch.Tensor] = None  # attention sinks [heads], float32, a leaf requiring grad

    @property
    def gqa(self) -> bool:
        return self.kv_heads is not None and self.kv_heads != self.heads

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v


@dataclass
class Options:
    flashmask_backend: str = "cuda"
    flex_compile: bool = True
    flex_block_mask: str = "auto"  # auto | eager | compile
    dense_mem_fraction: float = 0.5


@dataclass
class Prepared:
    attn: Callable  # (q, k, v) [B, S, H, D] (v: [.., Dv]) -> out [B, S, H, Dv]
    mask_bytes: Optional[int] = None  # the method's mask representation kept for the calls
    build_ms: Optional[float] = None  # time to build that representation
    notes: List[str] = field(default_factory=list)
    state: Dict[str, object] = field(default_factory=dict)  # tensors to drop when done
    params: Tuple[torch.Tensor, ...] = ()  # more leaves attn reads (the sinks): differentiated in bwd modes


def bhsd(x):
    """[B, S, H, D] <-> [B, H, S, D] (the layout of FlexAttention and SDPA)."""
    return x.transpose(1, 2)


def option_refusal(method: str, p: Problem) -> Optional[str]:
    """Why ``method`` cannot express the soft-capping or the sinks of ``p``, or None. SDPA (every
    backend) has neither a hook on the scores nor a logit that only joins the denominator."""
    if not method.startswith("sdpa"):
        return None
    missing = [what for what, used in (("logit soft-capping (softcap)", bool(p.softcap)),
                                       ("attention sinks", p.sinks is not None)) if used]
    if not missing:
        return None
    return f"SDPA cannot express {' or '.join(missing)}: no score modification, no denominator-only logit"


def _sm80_elsewhere(p: Problem, deterministic: bool) -> str:
    """A note for the rows where a call forced onto the SM80 kernels runs on another family here (a
    build for sm_80 and sm_90 compiles the SM80 kernels for sm_80 only at the head dims the SM90 ones
    serve); "" where it runs on them."""
    from flashmask import _cuda
    q = torch.empty(1, 1, 1, p.head_dim, dtype=p.dtype, device=p.device)
    fwd = _cuda.selected_arch(q, 80, "fwd", p.dv)
    bwd = _cuda.selected_arch(q, 80, "bwd_deterministic" if deterministic else "bwd", p.dv)
    if fwd == bwd == 80:
        return ""
    which = "forward and backward" if fwd == bwd else "forward" if fwd != 80 else "backward"
    return f"{which} on the sm{max(fwd, bwd)} kernels (FLASHMASK_ARCHS=90 builds the SM80 ones for sm_90)"


def prepare_method(method: str, p: Problem, opt: Options) -> Prepared:
    """Build what ``method`` needs for the mask of ``p`` and return its attention callable.

    Raises :class:`Skip` when the method does not apply (e.g. flash/cuDNN SDPA with a mask other
    than causal or none, or with a value head dim they do not take; a dense mask that does not fit;
    SDPA with soft-capping or sinks).
    """
    sq = sk = p.seqlen
    sinks, params = p.sinks, (() if p.sinks is None else (p.sinks,))
    if method in ("flashmask", "flashmask_det", "flashmask_sm80", "flashmask_plain"):
        import flashmask
        if method == "flashmask_plain" and not is_plain(p.startend, p.causal, sq):
            raise Skip(f"{method} takes only causal or no mask", report=False)
        if opt.flashmask_backend == "cuda":
            if not flashmask.cuda.available():
                raise RuntimeError(f"flashmask CUDA kernels unavailable: {flashmask.cuda.unavailable_reason()}")
        startend, causal, backend, softcap = p.startend, p.causal, opt.flashmask_backend, p.softcap
        if method == "flashmask_plain":
            startend = None
        if method == "flashmask_sm80" and backend == "cuda":
            backend = "sm80"
        deterministic = method == "flashmask_det"

        def attn(q, k, v):
            return flashmask.flashmask_attention(q, k, v, startend, causal=causal, backend=backend,
                                                 deterministic=deterministic, softcap=softcap, sinks=sinks)

        _, bn = fwd_tile(p.head_dim)
        mask_bytes = 0 if startend is None else startend.numel() * startend.element_size() + bounds_bytes(startend, bn)
        prep = Prepared(attn, mask_bytes=mask_bytes, params=params)
        note = _sm80_elsewhere(p, deterministic) if backend == "sm80" and flashmask.cuda.available() else ""
        if note:
            prep.notes.append(note)
        return prep

    if method in ("flex", "flex_flash"):
        hm = p.startend.shape[1]
        mm = flex.FLEX_MASK_MODS.get(p.startend, p.causal, sq, p.heads)
        bm_batch = None if p.startend.shape[0] == 1 else p.startend.shape[0]
        bm_heads = None if hm == 1 else p.heads
        sync(p.device)
        t0 = time.perf_counter()
        bm, how = flex.build_block_mask(mm, bm_batch, bm_heads, sq, sk, p.device, opt.flex_block_mask)
        sync(p.device)
        build_ms = (time.perf_counter() - t0) * 1e3
        gqa = p.gqa
        options = {"BACKEND": "FLASH"} if method == "flex_flash" else None
        # score_mod=None when soft-capping is off: the plain kernel, as without the option
        score_mod = flex.softcap_score_mod(p.softcap) if p.softcap else None
        if sinks is None:
            flex_attention = flex.compiled_flex_attention(opt.flex_compile)

            def attn(q, k, v):
                return bhsd(flex_attention(bhsd(q), bhsd(k), bhsd(v), score_mod=score_mod, block_mask=bm,
                                            enable_gqa=gqa, kernel_options=options))
        else:
            flex_sinks = flex.compiled_flex_attention_with_sinks(opt.flex_compile)

            def attn(q, k, v):
                return bhsd(flex_sinks(bhsd(q), bhsd(k), bhsd(v), sinks, score_mod=score_mod, block_mask=bm,
                                        enable_gqa=gqa, kernel_options=options))

        prep = Prepared(attn, mask_bytes=flex.block_mask_bytes(bm), build_ms=build_ms, state={"bm": bm},
                        params=params)
        prep.notes.append(f"block mask {how} {build_ms:.0f} ms")
        if score_mod is not None:
            prep.notes.append("softcap as score_mod")
        if sinks is not None:
            prep.notes.append("sinks as out * sigmoid(lse - sink)")
        return prep

    import torch.nn.functional as F
    if method in ("sdpa_flash", "sdpa_cudnn") and not is_plain(p.startend, p.causal, sq):
        raise Skip(f"{method} takes only causal or no mask", report=False)
    refused = option_refusal(method, p)
    if refused:
        raise Skip(refused)
    if method == "sdpa_dense":
        hm = p.startend.shape[1]
        if hm not in (1, p.heads):
            raise Skip(f"dense mask with {hm} heads does not broadcast to {p.heads} heads")
        fits, note = dense_fit(p.startend.shape[0], hm, sq, sk, p.dtype, p.device, opt.dense_mem_fraction)
        if not fits:
            raise Skip(note)
        sync(p.device)
        t0 = time.perf_counter()
        dense = dense_mask(p.startend, p.causal, sq)
        sync(p.device)
        build_ms = (time.perf_counter() - t0) * 1e3

        gqa = p.gqa

        def attn(q, k, v):
            return bhsd(F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), attn_mask=dense, enable_gqa=gqa))

        return Prepared(attn, mask_bytes=dense.numel(), build_ms=build_ms, state={"dense": dense})

    if method in ("sdpa_flash", "sdpa_cudnn"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = SDPBackend.FLASH_ATTENTION if method == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        causal, gqa = p.causal, p.gqa
        if p.dv != p.head_dim:
            refused = _sdpa_refuses(backend, p)
            if refused:
                raise Skip(f"{method} does not take q/k head dim {p.head_dim} with v head dim {p.dv}: {refused}")

        def attn(q, k, v):
            with sdpa_kernel(backend):
                return bhsd(F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=causal,
                                                            enable_gqa=gqa))

        return Prepared(attn, mask_bytes=0)

    raise ValueError(f"unknown method {method!r}; choose from {ALL_METHODS}")


def _sdpa_refuses(backend, p: Problem) -> Optional[str]:
    """Why SDPA's ``backend`` refuses the head dims of ``p`` (a call on 16 tokens), or None if it runs them.
    PyTorch says why in warnings before it raises "No available kernel": their text is the reason."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    hk = p.kv_heads or p.heads
    shapes = ((1, p.heads, 16, p.head_dim), (1, hk, 16, p.head_dim), (1, hk, 16, p.dv))
    q, k, v = (torch.zeros(s, dtype=p.dtype, device=p.device) for s in shapes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=p.causal, enable_gqa=p.gqa)
        except RuntimeError as e:
            why = [str(w.message).split(" (Triggered internally")[0] for w in caught]
            why = [w for w in why if not w.rstrip().endswith("because:")]
            return "; ".join(why) if why else format_error(e)
    return None


def release(prep: Optional[Prepared]) -> None:
    if prep is not None:
        prep.state.clear()
        prep.attn = None


def try_prepare(method: str, problem: Problem, opt: Options) -> Tuple[Optional[Prepared], Optional[dict]]:
    """``(prepared, None)``, or ``(None, outcome)`` with outcome ``{"status", "notes", "fatal"}``;
    status ``"skip"`` means: leave no row (the method does not apply and need not be listed)."""
    try:
        return prepare_method(method, problem, opt), None
    except Skip as e:
        return None, {"status": "n/a" if e.report else "skip", "notes": str(e), "fatal": False}
    except Exception as e:
        return None, {"status": status_of(e), "notes": f"setup: {format_error(e)}", "fatal": is_fatal_cuda_error(e)}
