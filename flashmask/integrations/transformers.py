"""Hugging Face ``transformers`` attention backend for flashmask.

Importing this module registers the backend under the name :data:`ATTN_IMPLEMENTATION`
(``"fm_colmask"``) with ``transformers``' ``AttentionInterface`` and ``AttentionMaskInterface``
(transformers >= 4.53, 4.x and 5.x). The name avoids "flash", "sdpa" and "flex_attention", which
transformers 5.x reserves for its own implementations.

Select it when building a model::

    >>> import flashmask.integrations.transformers as fm_hf
    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    >>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation=fm_hf.ATTN_IMPLEMENTATION)
    >>> model.config._attn_implementation
    'fm_colmask'

    or ``AutoModelForCausalLM.from_pretrained(path, attn_implementation="fm_colmask")``, or switch a
    model that already exists with :func:`use_flashmask`.

Where the mask comes from, in order of precedence (per call of the attention function):

1. ``attn_mask_startend_row_indices``: a model keyword argument (the name PaddleNLP uses), an
   int32 ``[B, Hm, S, C]`` FlashMask tensor with ``B`` the batch of ``input_ids`` (the rule of
   :func:`flashmask.flashmask_attention`, :func:`masks.format.check_tensor`; see docs/format.md), e.g. from
   :class:`flashmask.data.PackedSFTCollator` or :class:`flashmask.data.ShareQuestionCollator`::

       model(input_ids=ids, position_ids=pos, attn_mask_startend_row_indices=startend)

   Its values are checked once per batch (the first layer that sees a tensor checks it, with one
   device sync; the other layers of the step get the same tensor object and skip the check).

2. ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (what ``DataCollatorWithFlattening`` and TRL's
   padding-free collators emit with ``return_flash_attn_kwargs=True``): cumulative document
   lengths over the flattened ``B * S`` tokens; each document attends (causally) to itself only.
   A document never crosses a row boundary: every row starts a new one. They must start at 0,
   never decrease and end at ``B * S`` (checked once per batch, with one device sync).
3. restarting ``position_ids`` ``[B, S]`` (TRL packing / padding-free): a new document starts
   wherever ``position_ids[t] != position_ids[t - 1] + 1``, the rule of transformers'
   ``find_packed_sequence_indices`` and of :func:`masks.from_position_ids`.
   Only used when query and key lengths are equal (no KV cache in use).
4. otherwise plain causal (or full, for a non-causal module) attention.

Where the model's own mask splits a row further, 2 and 3 are split with it: the mask function we
register reads, from transformers' mask function, where a token stops seeing the one before it
(:func:`padding_mask_function`). That brings the documents of restarting ``position_ids`` to models
that do not pass ``position_ids`` on to their attention (Llama 4), and Llama 4's chunked attention
(``attention_chunk_size`` on its RoPE layers: a token sees the earlier tokens of its chunk). The
chunks are those transformers' mask draws: on a packed row, newer transformers count them from each
document's first token, older 5.x ones (5.17) from the row's first token. On a chunked layer an
explicit ``attn_mask_startend_row_indices`` must be a causal document mask; the chunks are then
counted from each of its documents' first token (:func:`masks.merge_chunks`), whatever the version,
as they are under context parallelism (``fm_cp``, from the batch's position ids).

A 2-D padding ``attention_mask`` ``[B, S]`` (0 = padding) is honoured on top of any of these:
padded keys are hidden from every query. No ``S x S`` mask is ever built: the mask function we
register with ``AttentionMaskInterface`` only forwards the 2-D padding mask, the segment ids above
(int32 ``[B, S]``) or ``None``.

A ``sliding_window`` argument (Mistral, Qwen2, Gemma 3's local layers, ...) is honoured with transformers' own
semantics: query ``i`` sees key ``j`` iff ``i - sliding_window < j <= i``.

Models whose value head dim differs from the query/key one (multi-head latent attention:
DeepSeek-V2/V3 with 192 and 128, and others) run as they are: the value reaches the kernels
without padding and the output has the value's head dim.

Attention logit soft-capping (the ``softcap`` argument: Gemma 2's ``attn_logit_softcapping``) and
attention sinks (the ``s_aux`` argument: GPT-OSS's per-head ``sinks`` parameter, learnable) reach
:func:`flashmask.flashmask_attention` as its ``softcap`` and ``sinks``, with the numerics of the
models' eager attention: the cap on the scaled scores before the mask, the sink as one more logit
of each row's softmax that carries no value. The CUDA kernels take both.

What is not supported raises ``NotImplementedError`` instead of computing something else:
attention dropout > 0 in training, head masks, relative position biases, paged caches, chunked
attention with a KV cache or with an ``attn_mask_startend_row_indices`` other than a causal document
mask, extra mask functions composed by the model (e.g. Gemma 3 image tokens on transformers 5.x),
non-causal sliding windows and static KV caches. ``output_attentions`` gives ``None`` weights (as
with ``sdpa``).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Optional, Tuple

import torch

try:
    import transformers
    from packaging import version as _version
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("flashmask.integrations.transformers needs `transformers>=4.53` "
                      "(pip install 'transformers>=4.53')") from e

if _version.parse(transformers.__version__).release < (4, 53):
    raise ImportError(f"flashmask.integrations.transformers needs transformers>=4.53 (it relies on "
                      f"transformers.masking_utils.AttentionMaskInterface); found {transformers.__version__}")

from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface, PreTrainedModel

from flashmask._memo import Recent, tensor_key
from flashmask.attention import flashmask_attention
from masks.convert import merge_chunks
from masks.format import check_tensor as check_mask_tensor
from masks.format import validate as _validate_mask
from masks.packed import check_cu_seqlens, cu_seqlens_starts, document_starts, from_starts

#: The ``attn_implementation`` name the backend is registered under.
ATTN_IMPLEMENTATION = "fm_colmask"
#: The model keyword argument that carries a FlashMask ``startend_row_indices`` tensor.
MASK_KWARG = "attn_mask_startend_row_indices"

# transformers 5.x routes any name containing these to its own code paths.
_RESERVED_SUBSTRINGS = ("flash", "sdpa", "flex_attention")

__all__ = ["ATTN_IMPLEMENTATION", "MASK_KWARG", "register", "use_flashmask", "flashmask_attention_forward",
           "padding_mask_function", "softcap_and_sinks"]


# --------------------------------------------------------------------------------------------------
# registration


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"the backend name must be a non-empty string, got {name!r}")
    low = name.lower()
    bad = [s for s in _RESERVED_SUBSTRINGS if s in low]
    if bad:
        raise ValueError(f"attn_implementation name {name!r} contains {bad[0]!r}: transformers 5.x treats names "
                         f"containing any of {_RESERVED_SUBSTRINGS} as its own implementations")
    if low in ("eager",) or low.startswith("paged") or "|" in name or "/" in name or ":" in name:
        raise ValueError(f"attn_implementation name {name!r} is reserved by transformers (eager, paged*, or a "
                         f"hub-kernel pattern with '|', '/' or ':')")


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register the backend with transformers under ``name``; idempotent. Returns ``name``.

    Called on import with the default name. Registers :func:`flashmask_attention_forward` with
    ``AttentionInterface`` and :func:`padding_mask_function` with ``AttentionMaskInterface`` (so
    the model's mask-creation step forwards the 2-D padding mask and never builds a dense one).
    """
    _check_name(name)
    AttentionInterface.register(name, flashmask_attention_forward)
    AttentionMaskInterface.register(name, padding_mask_function)
    return name


def use_flashmask(model: torch.nn.Module, name: str = ATTN_IMPLEMENTATION) -> torch.nn.Module:
    """Switch an already-built transformers model (and its sub-models) to the flashmask backend.

    Uses ``model.set_attn_implementation`` where transformers has it (4.57, 5.x) and sets
    ``config._attn_implementation`` on every sub-model's config otherwise (4.53). Raises
    ``ValueError`` if the model does not dispatch its attention through ``AttentionInterface``
    (the switch would silently do nothing). Returns ``model``.

    Example::

        model = AutoModelForCausalLM.from_pretrained(path)   # sdpa
        use_flashmask(model)                                 # now "fm_colmask"
        model.set_attn_implementation("sdpa")                # and back
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"use_flashmask expects a transformers PreTrainedModel, got {type(model).__name__}")
    register(name)
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise ValueError(f"{type(model).__name__} does not dispatch its attention through transformers' "
                         "AttentionInterface, so its attention implementation cannot be switched")
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # transformers 4.53: the modules read config._attn_implementation at every forward
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if isinstance(cfg, transformers.PretrainedConfig):
                cfg._attn_implementation = name
    if model.config._attn_implementation != name:
        raise ValueError(f"could not switch {type(model).__name__} to attn_implementation={name!r} "
                         f"(it is {model.config._attn_implementation!r})")
    return model


# --------------------------------------------------------------------------------------------------
# mask function (AttentionMaskInterface)


def padding_mask_function(*args, attention_mask: Optional[torch.Tensor] = None, kv_length: Optional[int] = None,
                          kv_offset: int = 0, q_length: Optional[int] = None, q_offset=0,
                          cache_position: Optional[torch.Tensor] = None, config=None, **kwargs):
    """The mask "creation" transformers runs for our backend: no dense mask, ever.

    Returns the 2-D padding mask aligned with the keys, bool ``[B, kv_length]`` (True = real token),
    or ``None`` when the model got no ``attention_mask``. Where the model's mask splits the row into
    causal segments (packed documents that transformers found from restarting ``position_ids``,
    Llama 4's chunks), it returns int32 segment ids ``[B, kv_length]`` instead (0 on padding; a new id
    wherever the mask hides a token's predecessor from it, found with ``kv_length`` calls of the
    model's mask function on adjacent pairs), so that models that do not pass ``position_ids`` on to
    the attention (Llama 4) are split where their eager attention splits them.
    Raises ``NotImplementedError`` for what the backend cannot express: mask functions the model
    composes on top of the causal one (seen as ``use_vmap=True`` on transformers 5.x), chunked
    attention with a KV cache, and KV caches whose keys do not end at the current query (static
    caches).
    """
    if kwargs.get("use_vmap", False):
        raise NotImplementedError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r}: this model composes extra mask functions on top of the "
            "causal mask (e.g. bidirectional image tokens); they have no column-interval form here. Pass "
            f"`{MASK_KWARG}` explicitly or use another attention implementation")
    _check_cache_alignment(q_length, q_offset, kv_length, kv_offset, cache_position)
    if q_length is None and cache_position is not None:  # transformers 4.x
        q_length = cache_position.shape[0]
    # Without a cache the keys are the queries (the alignment check above): one segment walk serves both.
    whole_row = kv_length is not None and kv_offset == 0 and q_length == kv_length
    chunked = getattr(config, "attention_chunk_size", None) is not None
    if chunked and not whole_row:
        raise _unsupported("chunked attention (config.attention_chunk_size) with a KV cache")
    keep = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            return attention_mask  # an already-prepared mask; the attention function decides
        keep = attention_mask.to(torch.bool)
        if kv_length is not None:
            need = kv_offset + kv_length
            if keep.shape[-1] < need:  # cache slots beyond the given mask are empty
                keep = torch.nn.functional.pad(keep, (0, need - keep.shape[-1]), value=False)
            keep = keep[:, kv_offset:need]
    mask_function = kwargs.get("mask_function")
    # A compiled model keeps the plain padding mask unless chunks make the segments necessary: the
    # check below would break its graph.
    if mask_function is None or not whole_row or kv_length < 2 or (torch.compiler.is_compiling() and not chunked):
        return keep
    device = kwargs.get("device") or (cache_position.device if cache_position is not None else None) or \
        (keep.device if keep is not None else torch.device("cpu"))
    batch = kwargs.get("batch_size") or (keep.shape[0] if keep is not None else 1)
    starts = _segment_starts(mask_function, batch, kv_length, device)
    if not (chunked and torch.compiler.is_compiling()) and not bool(starts[:, 1:].any()):
        return keep
    segments = torch.cumsum(starts, 1, dtype=torch.int32)
    return segments if keep is None else segments * keep.to(device)


def _segment_starts(mask_function, batch: int, length: int, device) -> torch.Tensor:
    """bool ``[batch, length]``: where a token does not see the token before it under the model's
    mask function (transformers' index-based ``(batch, head, q_idx, kv_idx)`` form, without padding)."""
    j = torch.arange(1, length, device=device)[None]
    b = torch.arange(batch, device=device)[:, None]
    with torch.no_grad():
        sees = torch.as_tensor(mask_function(b, torch.zeros_like(b), j, j - 1), device=device)
    starts = torch.ones(batch, length, dtype=torch.bool, device=device)
    starts[:, 1:] = ~sees.to(torch.bool).expand(batch, length - 1)
    return starts


def _check_cache_alignment(q_length, q_offset, kv_length, kv_offset, cache_position) -> None:
    # The kernels align causal attention bottom-right (query i of Sq sees keys <= i + Sk - Sq), which
    # is right whenever the keys end at the last query: no cache, or a dynamic (sliding) cache.
    if kv_length is None:
        return
    if q_length is None:
        if cache_position is None:
            return
        q_length, q_offset = cache_position.shape[0], cache_position[0]
        if kv_offset == 0 and kv_length == q_length:
            return  # no cache, or the prefill of a dynamic cache
    if isinstance(q_offset, torch.Tensor):
        if torch.compiler.is_compiling():
            return
        q_offset = int(q_offset)
    if q_offset + q_length != kv_offset + kv_length:
        raise NotImplementedError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} needs the keys to end at the last query (no cache or a "
            f"dynamic cache); got queries [{q_offset}, {q_offset + q_length}) and keys "
            f"[{kv_offset}, {kv_offset + kv_length}) (a static cache?)")


# --------------------------------------------------------------------------------------------------
# attention function (AttentionInterface)

_warned = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=3)


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"attn_implementation={ATTN_IMPLEMENTATION!r} does not support {what}; use another "
                               "attention implementation for this model")


def flashmask_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                scaling: Optional[float] = None, dropout: float = 0.0,
                                **kwargs) -> Tuple[torch.Tensor, None]:
    """transformers attention function: ``(module, query, key, value, attention_mask, ...)``.

    Args:
        module: the calling attention module (``is_causal`` is read from it unless ``is_causal`` is
            passed).
        query: ``[B, Hq, Sq, Dqk]``; key: ``[B, Hk, Sk, Dqk]``; value: ``[B, Hk, Sk, Dv]`` (GQA handled
            by the kernels, no repeat). ``Dv`` may differ from ``Dqk`` (MLA: DeepSeek-V2/V3 and
            others): value is used as it is, unpadded (one padded with zero columns gives an output
            whose extra columns are zero).
        attention_mask: ``None``, a 2-D padding mask ``[B, Sk]`` (True/1 = real token), or a 4-D
            dense mask supplied by the user (converted exactly when it has a column-interval form,
            else ``ValueError``).
        scaling: softmax scale (default ``Dqk ** -0.5``).
        dropout: must be 0.
        **kwargs: ``attn_mask_startend_row_indices``, ``cu_seq_lens_q``/``cu_seq_lens_k``,
            ``position_ids``, ``sliding_window``, ``is_causal``, ``softcap`` (Gemma 2), ``s_aux``
            (attention sinks ``[Hq]``, GPT-OSS); see the module docstring.

    Returns:
        ``(attn_output [B, Sq, Hq, Dv], None)``.
    """
    _reject_unsupported(kwargs, dropout)
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"expected query/key/value [B, H, S, D], got {tuple(query.shape)} and {tuple(key.shape)}")
    bsz, _, sq, _ = query.shape
    sk = key.shape[2]
    startend = _layer_mask(kwargs, attention_mask, _chunk_size(module), causal, bsz, sq, sk, query.device)

    window = None
    sliding_window = _sliding_window(kwargs, causal, sk)
    if sliding_window is not None:
        window = (sliding_window - 1, 0)
        explicit = kwargs.get(MASK_KWARG)
        if explicit is not None and kwargs.get("position_ids") is not None and sq == sk:
            _check_window_positions(startend, kwargs["position_ids"], sliding_window, explicit)

    softcap, sinks = softcap_and_sinks(kwargs)
    out = flashmask_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), startend,
                              causal=causal, softmax_scale=scaling, window_size=window, softcap=softcap, sinks=sinks)
    return out, None


# The layers' masks of the most recent batches, by what they were built from: each layer of a forward
# then passes the kernels the same tensor, whose metadata they compute once (and its windowed form
# once per window).
_layer_masks = Recent(4)
_MASK_INPUTS = (MASK_KWARG, "cu_seq_lens_q", "cu_seq_lens_k", "position_ids")


def _layer_mask(kwargs: dict, attention_mask, chunk: Optional[int], causal: bool, bsz: int, sq: int, sk: int,
                device) -> Optional[torch.Tensor]:
    """The FlashMask tensor of a layer (None for plain causal/full), the same tensor for every layer
    given the same inputs while they stay unchanged (an in-place change builds it again)."""
    inputs = [kwargs.get(name) for name in _MASK_INPUTS] + [attention_mask]

    def build():
        startend = _build_layer_mask(kwargs, attention_mask, chunk, causal, bsz, sq, sk, device)
        # Weak references: a dense 4-D mask is O(S^2), not to be kept alive past its batch.
        return startend, [None if t is None else weakref.ref(t) for t in inputs]

    def same_inputs(value) -> bool:  # a freed input's memory may hold a new tensor of the same key
        return all((t is None) == (ref is None) and (t is None or ref() is t) for t, ref in zip(inputs, value[1]))

    if torch.compiler.is_compiling() or any(t is not None and not isinstance(t, torch.Tensor) for t in inputs):
        return build()[0]
    names = [None if t is None else tensor_key(t) for t in inputs]
    if any(n is None and t is not None for n, t in zip(names, inputs)):  # inference tensors
        return build()[0]
    return _layer_masks.get((*names, chunk, causal, bsz, sq, sk, device), build, same_inputs)[0]


def _build_layer_mask(kwargs: dict, attention_mask, chunk: Optional[int], causal: bool, bsz: int, sq: int,
                      sk: int, device) -> Optional[torch.Tensor]:
    # A 4-D mask is the whole truth (as in transformers): position_ids then only drive RoPE.
    dense_4d = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
    starts = None
    if _is_segments(attention_mask):
        starts, attention_mask = _split_segments(attention_mask, bsz, sk, device)
    chunked = chunk is not None and chunk < sk
    explicit = kwargs.get(MASK_KWARG) is not None
    if chunked and not explicit and starts is None:
        raise _unsupported(f"chunked attention (attention_chunk_size={chunk}) without the model's mask "
                           "(this backend reads the chunks from it)")
    startend = _resolve_mask(kwargs, causal, bsz, sq, sk, device, use_position_ids=not dense_4d,
                             segment_starts=starts)
    if chunked and explicit:
        # A document mask gives each token's position in its document, from which the chunks are
        # counted (any transformers). Other layouts (DPO's shared prompt) have no chunk form.
        _check_once(_checked_chunk_mask, kwargs[MASK_KWARG], (bool(causal), chunk),
                    lambda: _check_document_mask(startend, causal, chunk))
        startend = merge_chunks(startend, chunk, sk, _document_positions(startend[:, 0, :, 0]))
    if attention_mask is not None:
        startend = _apply_attention_mask(startend, attention_mask, causal, bsz, sq, sk, device)
    return startend


def _sliding_window(kwargs: dict, causal: bool, sk: int, unsupported=None) -> Optional[int]:
    """A layer's ``sliding_window`` (transformers: query i sees key j iff i - window < j <= i) where it
    hides keys, i.e. is shorter than the ``sk`` keys; else None. Raises for a window on non-causal
    attention (``unsupported(what)`` makes that error; default: this backend's) or one below 1."""
    window = kwargs.get("sliding_window")
    if window is None:
        return None
    if not causal:
        raise (unsupported or _unsupported)("a sliding window on a non-causal (bidirectional) attention")
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    return window if window < sk else None


def softcap_and_sinks(kwargs: dict) -> Tuple[float, Optional[torch.Tensor]]:
    """``(softcap, sinks)`` for :func:`flashmask.flashmask_attention` from the keyword arguments a
    transformers attention module passes: ``softcap`` (None: off) and ``s_aux`` (or ``sinks``)."""
    softcap = kwargs.get("softcap")
    sinks, s_aux = kwargs.get("sinks"), kwargs.get("s_aux")
    if sinks is not None and s_aux is not None:
        raise ValueError("got both s_aux and sinks (the attention sinks); pass one")
    return (0.0 if softcap is None else softcap), (s_aux if sinks is None else sinks)


_window_check_cache: list = []


def _check_window_positions(startend: torch.Tensor, position_ids: torch.Tensor, window: int,
                            key_tensor: torch.Tensor, unsupported=None) -> None:
    """Raise if a sliding window would differ in index space and in position space.

    The kernels apply the window to token indices; transformers means it in positions. The two
    agree inside any span of visible rows where ``index - position`` is constant (packed documents),
    and wherever the visible span is shorter than the window (``index - position`` must then never
    decrease, so that positions are never further apart than indices). A share-question layout
    (rejected positions continue from the prompt, past the chosen span) longer than the window
    fails this: its exact mask has no column-interval form. One host sync, cached per mask.
    ``unsupported(what)`` makes the error (default: this backend's).
    """
    if torch.compiler.is_compiling():
        return
    # The tensors themselves and their contents' keys (an in-place change checks again).
    names = (tensor_key(key_tensor), tensor_key(position_ids))
    for ref, pos_ref, seen, w, ok in _window_check_cache:
        if ref is key_tensor and pos_ref is position_ids and seen == names and w == window:
            if not ok:
                break
            return
    bsz, _, s, c = startend.shape
    pos = position_ids.to(startend.device).reshape(-1, s).expand(bsz, s)
    idx = torch.arange(s, device=startend.device)
    gap = idx - pos  # [B, S]
    change = torch.zeros_like(gap, dtype=torch.bool)
    change[:, 1:] = gap[:, 1:] != gap[:, :-1]
    # first change point after each column (S if none)
    nxt = torch.cat([torch.where(change, idx, s)[:, 1:], torch.full_like(gap[:, :1], s)], 1)
    next_change = nxt.flip(-1).cummin(-1).values.flip(-1)  # [B, S]
    lts = startend[..., 0].long()  # [B, Hm, S]
    if c == 2:  # causal (LTS, LTE): rows from LTE on see the column again
        end = torch.where(startend[..., 1].long() < s, s, lts)
    else:
        end = lts
    nondecreasing = (gap[:, 1:] >= gap[:, :-1]).all(-1)  # [B]
    constant = next_change[:, None, :] >= end
    short = (end - idx) <= window
    ok_cols = constant | (short & nondecreasing[:, None, None])
    ok = bool(ok_cols.all())
    _window_check_cache[:] = [(key_tensor, position_ids, names, window, ok)]
    if not ok:
        raise (unsupported or _unsupported)(
            f"this {MASK_KWARG} mask with sliding_window={window}: its position_ids jump inside spans of tokens "
            "that see each other (e.g. a share-question DPO layout) and the window would then hide different tokens "
            "than in separate sequences. Use sequences shorter than the window, or a model without sliding windows")


def _reject_unsupported(kwargs: dict, dropout: float) -> None:
    if dropout:
        raise _unsupported(f"attention dropout (got dropout={dropout}; set config.attention_dropout=0.0)")
    if kwargs.get("head_mask") is not None:
        raise _unsupported("head_mask")
    if kwargs.get("position_bias") is not None:
        raise _unsupported("an additive position bias")
    if kwargs.get("cache") is not None:
        raise _unsupported("paged KV caches")
    if kwargs.get("output_attentions", False):
        _warn_once(f"attn_implementation={ATTN_IMPLEMENTATION!r} does not return attention weights "
                   "(output_attentions gives None)")


def _is_segments(attention_mask) -> bool:
    """Whether the attention mask is the segment ids of :func:`padding_mask_function` (int32, 2-D)."""
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and \
        attention_mask.dtype == torch.int32


def _split_segments(segments: torch.Tensor, bsz: int, sk: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Segment ids ``[B, Sk]`` -> (bool segment starts, bool padding mask: True = real token)."""
    if segments.shape[-1] != sk or segments.shape[0] not in (1, bsz):
        raise ValueError(f"2-D attention_mask has shape {tuple(segments.shape)}, expected [{bsz}, {sk}]")
    segments = segments.to(device).expand(bsz, sk)
    return _changes(segments), segments != 0


def _chunk_size(module) -> Optional[int]:
    """The chunk of a chunked-attention layer (Llama 4: ``config.attention_chunk_size`` on the layers
    whose ``config.layer_types`` entry is "chunked_attention"), else None."""
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    types, idx = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if chunk is None or types is None or idx is None or types[idx] != "chunked_attention":
        return None
    return int(chunk)


def _resolve_mask(kwargs: dict, causal: bool, bsz: int, sq: int, sk: int, device,
                  use_position_ids: bool = True, segment_starts: Optional[torch.Tensor] = None
                  ) -> Optional[torch.Tensor]:
    """The FlashMask tensor for this call (before padding), or None for plain causal/full.
    ``segment_starts`` (from the model's own mask, :func:`padding_mask_function`) split the
    documents of cu_seq_lens or position_ids further; an explicit mask is returned as it is."""
    startend = kwargs.get(MASK_KWARG)
    if startend is not None:
        check_mask_tensor(startend, batch_size=bsz, name=MASK_KWARG)  # the rule of flashmask_attention
        if startend.device != device:
            startend = startend.to(device)
        _check_user_mask_once(kwargs[MASK_KWARG], startend, causal, sq)
        return startend.contiguous()

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be given together")
        if cu_k is not cu_q and (cu_k.shape != cu_q.shape or not torch.equal(cu_k.to(cu_q.device), cu_q)):
            raise _unsupported("different query and key documents (cu_seq_lens_q != cu_seq_lens_k)")
        if sq != sk:
            raise _unsupported("cu_seq_lens_q/k together with a KV cache")
        _check_once(_checked_cu, cu_q, (bsz * sq,), lambda: check_cu_seqlens(cu_q, bsz * sq, "cu_seq_lens_q"))
        starts = cu_seqlens_starts(cu_q, bsz, sq, device)
    else:
        starts = None
        position_ids = kwargs.get("position_ids")
        if use_position_ids and position_ids is not None and sq == sk and sq > 1 and position_ids.dim() in (1, 2) \
                and position_ids.shape[-1] == sq:
            pos = position_ids.to(device).reshape(-1, sq)
            if pos.shape[0] != bsz:
                pos = pos.expand(bsz, -1)
            starts = document_starts(pos)
    if segment_starts is not None:
        starts = segment_starts if starts is None else starts | segment_starts
    return None if starts is None else from_starts(starts, causal)


# (weak reference to the user's tensor, (its version counter, *arguments)) of the last tensor that
# passed each check: the mask's values, and cu_seq_lens_q's.
_checked_mask: list = []
_checked_cu: list = []


def _check_once(cache: list, user_tensor: torch.Tensor, args: tuple, check) -> None:
    """Run ``check()`` on a tensor from the user once per batch, not once per layer.

    Every layer of a forward pass gets the same tensor object, so only the first layer checks it
    (one device sync per batch); an in-place change bumps the tensor's version and makes the next
    call check again, and a tensor that fails is never remembered. Under ``torch.compile`` the
    check is left to eager runs.
    """
    if torch.compiler.is_compiling():
        return
    # None for inference-mode tensors: no version counter (and they cannot change in place).
    key = (tensor_key(user_tensor),) + tuple(args)
    if cache and cache[0]() is user_tensor and cache[1] == key:
        return
    check()
    cache[:] = [weakref.ref(user_tensor), key]


_checked_chunk_mask: list = []


def _check_document_mask(startend: torch.Tensor, causal: bool, chunk: int) -> None:
    """Raise unless ``startend`` is a causal document mask (C=1, each key hidden from the rows past
    its document, documents contiguous), the only explicit mask a chunked layer takes."""
    what = f"chunked attention (attention_chunk_size={chunk}) with a {MASK_KWARG} other than a causal document mask"
    if not causal or startend.shape[-1] != 1:
        raise _unsupported(f"{what} (got causal={causal}, C={startend.shape[-1]})")
    lts = startend[..., 0]  # [B, Hm, S]
    if not torch.equal(lts, lts[:, :1].expand_as(lts)):
        raise _unsupported(f"{what} (its mask heads differ)")
    if not torch.equal(from_starts(_changes(lts[:, 0]), True)[:, 0, :, 0], lts[:, 0]):
        raise _unsupported(what)


def _changes(x: torch.Tensor) -> torch.Tensor:
    """bool ``[B, S]``: where ``x`` ``[B, S]`` differs from the token before (the first token included):
    the segment starts of segment ids, the document starts of a causal document mask's column."""
    starts = torch.ones_like(x, dtype=torch.bool)
    starts[:, 1:] = x[:, 1:] != x[:, :-1]
    return starts


def _document_positions(lts: torch.Tensor) -> torch.Tensor:
    """``[B, S]``: each token's position in its document, of a causal document mask's column."""
    t = torch.arange(lts.shape[-1], device=lts.device).expand_as(lts)
    return t - torch.where(_changes(lts), t, 0).cummax(-1).values


def _check_user_mask_once(user_tensor: torch.Tensor, startend: torch.Tensor, causal: bool, sq: int) -> None:
    """Check the values of a mask that came from the user, once per batch (:func:`_check_once`)."""
    def check():
        try:
            _validate_mask(startend, causal, sq)
        except ValueError as e:
            raise ValueError(f"{MASK_KWARG}: {e}") from None

    _check_once(_checked_mask, user_tensor, (bool(causal), sq), check)


def _apply_attention_mask(startend: Optional[torch.Tensor], attention_mask: torch.Tensor, causal: bool,
                          bsz: int, sq: int, sk: int, device) -> Optional[torch.Tensor]:
    if not isinstance(attention_mask, torch.Tensor):
        raise _unsupported(f"an attention_mask of type {type(attention_mask).__name__} (e.g. a flex BlockMask)")
    if attention_mask.dim() == 4:
        if startend is not None:
            raise ValueError(f"got both a 4-D attention_mask and a flashmask mask ({MASK_KWARG} or cu_seq_lens); "
                             "pass only one")
        return _from_dense_4d(attention_mask, causal, bsz, sq, sk)
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D [B, Sk] (padding) or 4-D, got {tuple(attention_mask.shape)}")
    if attention_mask.shape[-1] != sk or attention_mask.shape[0] not in (1, bsz):
        raise ValueError(f"2-D attention_mask has shape {tuple(attention_mask.shape)}, expected [{bsz}, {sk}]")
    pad = ~attention_mask.to(device=device, dtype=torch.bool).expand(bsz, sk)  # True on padded keys
    if startend is None:
        lts = torch.where(pad, 0, sq).to(torch.int32)
        cols = [lts] if causal else [lts, torch.zeros_like(lts)]
        return torch.stack(cols, -1).unsqueeze(1)
    # Hide padded key columns from every row; leave every other column exactly as it was.
    pad = pad[:, None, :]  # broadcast over mask heads
    out = startend.clone()
    out[..., 0] = torch.where(pad, 0, out[..., 0])
    if out.shape[-1] == 4 or (causal and out.shape[-1] == 2):  # an LTE column: extend it to Sq
        out[..., 1] = torch.where(pad, sq, out[..., 1])
    return out


def _from_dense_4d(mask: torch.Tensor, causal: bool, bsz: int, sq: int, sk: int) -> torch.Tensor:
    try:
        from masks import from_dense
    except ImportError as e:  # pragma: no cover
        raise _unsupported(f"4-D dense attention masks (pass {MASK_KWARG} instead)") from e
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask == 0
        if (~allowed & (mask > torch.finfo(mask.dtype).min / 2)).any():
            raise _unsupported("4-D float attention masks with values other than 0 and -inf (an additive bias)")
    if allowed.shape[-2:] != (sq, sk):
        raise ValueError(f"4-D attention_mask has shape {tuple(mask.shape)}, expected [B, 1, {sq}, {sk}]")
    if allowed.shape[1] != 1:
        raise _unsupported("4-D attention masks that differ per head")
    return from_dense(allowed.expand(bsz, 1, sq, sk), causal=causal)


register()
