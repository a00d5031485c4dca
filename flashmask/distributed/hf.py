"""A transformers attention backend for context parallelism: ``attn_implementation="fm_cp"``.

Every rank of the context-parallel group runs the whole model on its share of the tokens (from
:func:`flashmask.distributed.shard_packed_batch`); the decoder layers' projections, norms, MLPs
and RoPE are per token and need nothing, and attention is exchanged by this backend, which runs
:func:`flashmask.distributed.context_parallel_attention` with the plan of the current batch::

    import flashmask.distributed.hf as cp_hf
    cp_hf.use_context_parallel(model)              # registers "fm_cp" and switches the model
    local, plan = shard_packed_batch(batch, group=cp_group)
    with cp_hf.context_parallel(plan):             # forward AND backward (checkpoint recompute)
        hidden = model.model(input_ids=local["input_ids"], position_ids=local["position_ids"]).last_hidden_state
        loss = causal_lm_loss(hidden, model.lm_head, shift_labels=local["shift_labels"],
                              num_items_in_batch=local["num_items_in_batch"])
        loss.backward()

(with FSDP2, run the decoder and the loss through :func:`flashmask.distributed.fsdp.lm_loss`).
The plan (mask, causal flag, process group, chunk layout) is read from :func:`set_plan` /
:func:`context_parallel` at every attention call; the mask keywords the model passes
(``position_ids``, ``attn_mask_startend_row_indices``, ``cu_seq_lens_*``) are ignored, since they
describe the local shard, not the sequence. The mask function registered for the name is the
flashmask backend's (:func:`flashmask.integrations.transformers.padding_mask_function`): no dense
mask is built. Logit soft-capping (``softcap``, Gemma 2) and attention sinks (``s_aux``, GPT-OSS) are
passed through, and a layer's ``sliding_window`` (Mistral, Gemma 2/3, GPT-OSS) runs on the plan
with the window merged into its mask (:meth:`ContextParallelPlan.windowed`, made once per batch and
window), checked against the batch's position ids as the ``fm_colmask`` backend does; Llama 4's
chunked layers on the plan with the chunks of those position ids merged in
(:meth:`ContextParallelPlan.chunked`). Not supported (raises): padding masks, KV caches, dropout,
sliding windows on non-causal attention, chunks on a mask other than causal documents.

The name contains none of "flash", "sdpa", "flex_attention" (transformers 5.x reserves them).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

import flashmask.integrations.transformers as fm_hf
from flashmask.distributed.plan import ContextParallelPlan
from flashmask.distributed.sharding import context_parallel_attention

#: The ``attn_implementation`` name of the context-parallel backend.
ATTN_IMPLEMENTATION = "fm_cp"

__all__ = ["ATTN_IMPLEMENTATION", "register", "use_context_parallel", "set_plan", "get_plan", "context_parallel",
           "cp_attention_forward"]

_state = {"plan": None, "backend": "auto", "head_groups": 2}


def set_plan(plan: Optional[ContextParallelPlan], *, backend: str = "auto", head_groups: int = 2) -> None:
    """Make ``plan`` the one every ``fm_cp`` attention call uses from now on (``None`` to clear).
    Set it once per batch, before the forward; it must still be set during the backward when
    activation checkpointing recomputes the layers."""
    if plan is not None and not isinstance(plan, ContextParallelPlan):
        raise TypeError("plan must be a ContextParallelPlan (flashmask.distributed.make_plan), "
                        f"got {type(plan).__name__}")
    _state.update(plan=plan, backend=backend, head_groups=head_groups)


def get_plan() -> Optional[ContextParallelPlan]:
    return _state["plan"]


@contextlib.contextmanager
def context_parallel(plan: ContextParallelPlan, *, backend: str = "auto", head_groups: int = 2):
    """``with context_parallel(plan): ...``: :func:`set_plan` for the block, the previous plan after it."""
    prev = dict(_state)
    set_plan(plan, backend=backend, head_groups=head_groups)
    try:
        yield plan
    finally:
        _state.clear()
        _state.update(prev)


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"attn_implementation={ATTN_IMPLEMENTATION!r} (context parallel) "
                               f"does not support {what}")


def cp_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                         dropout: float = 0.0, **kwargs):
    """transformers attention function: query ``[B, Hq, L, Dqk]``, key ``[B, Hk, L, Dqk]``, value
    ``[B, Hk, L, Dv]`` of this rank's ``L`` tokens; returns ``(out [B, L, Hq, Dv], None)``."""
    plan = _state["plan"]
    if plan is None:
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} needs the batch's context-parallel plan: "
                           "run the model (forward and backward) inside `with flashmask.distributed.hf."
                           "context_parallel(plan):` or call set_plan(plan) first")
    if dropout:
        raise _unsupported(f"attention dropout (got {dropout})")
    for name in ("head_mask", "position_bias", "cache"):
        if kwargs.get(name) is not None:
            raise _unsupported(name)
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.dim() != 2 or not bool(attention_mask.bool().all()):
            raise _unsupported("an attention_mask (padding or 4-D); pack with a padding document instead")
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if causal != plan.causal:
        raise ValueError(f"the module is {'causal' if causal else 'non-causal'} but the plan was made with "
                         f"causal={plan.causal}")
    if query.shape[2] != plan.local_len or key.shape[2] != plan.local_len:
        raise ValueError(f"the layer got {query.shape[2]} queries and {key.shape[2]} keys but the plan gives "
                         f"{plan.local_len} tokens per rank (a KV cache, or a batch not sharded with this plan?)")
    chunk = fm_hf._chunk_size(module)
    if chunk is not None and chunk < plan.seqlen:
        try:
            plan = plan.chunked(chunk, batch_size=query.shape[0])
        except ValueError as e:
            raise _unsupported(f"chunked attention (attention_chunk_size={chunk}) on this plan's mask: {e}") from None
    sw = kwargs.get("sliding_window")
    if sw is not None and int(sw) < plan.seqlen:  # a window no shorter than the row hides nothing
        sw = fm_hf._sliding_window(kwargs, causal, plan.seqlen, _unsupported)
        if plan.position_ids is not None and plan.startend_row_indices is not None:
            fm_hf._check_window_positions(plan.startend_row_indices, plan.position_ids, sw,
                                          plan.startend_row_indices, unsupported=_unsupported)
        try:
            plan = plan.windowed((sw - 1, 0), batch_size=query.shape[0])
        except ValueError as e:
            raise _unsupported(f"sliding_window={sw} on this plan's mask: {e}") from None
    softcap, sinks = fm_hf.softcap_and_sinks(kwargs)
    out = context_parallel_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), plan,
                                     softmax_scale=scaling, backend=_state["backend"],
                                     head_groups=_state["head_groups"], softcap=softcap, sinks=sinks)
    return out, None


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register :func:`cp_attention_forward` (and the no-dense-mask mask function) under ``name``."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    fm_hf._check_name(name)
    AttentionInterface.register(name, cp_attention_forward)
    AttentionMaskInterface.register(name, fm_hf.padding_mask_function)
    return name


def use_context_parallel(model: torch.nn.Module, name: str = ATTN_IMPLEMENTATION) -> torch.nn.Module:
    """Switch a transformers model to the context-parallel backend (registering it first)."""
    register(name)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # transformers 4.53
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = name
    if model.config._attn_implementation != name:
        raise ValueError(f"could not switch {type(model).__name__} to attn_implementation={name!r}")
    return model


register()
