"""Activation checkpointing per layer, with the checkpoints (the layer inputs) offloaded to host memory.

With every decoder layer checkpointed, what stays on the GPU between forward and backward is one
``[B, S, hidden]`` tensor per layer: 24 layers x 1M tokens x 896 x 2 bytes = 43 GB for the
0.39B benchmark model, more than half an H100. :func:`offload_checkpoint` is
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` that also copies the layer's
input to pinned host memory on a side stream and frees its GPU storage once the layer's forward
has used it; a hook on the layer's output puts it back (host-to-device copy on the compute
stream) just before the backward recomputes the layer. The tensor object stays the same, only
its storage goes away and comes back, so autograd and the checkpoint's recompute see nothing.

It pays when the layer inputs are what does not fit (long context, many layers) and the PCIe
copies (2 x S x hidden x 2 bytes per layer and step, overlapped with compute in the forward)
are small against the layer's compute. Do not combine it with anything that keeps the layer
inputs for reading after the forward (``output_hidden_states=True``).

With the layer inputs on the host, what limits the row length is what one layer creates while it
runs: the MLP's ``[S, intermediate]`` temporaries (gate, up, the activation and their product,
about 10 GB each at 1M tokens x 4864 in bf16, and their gradients in the backward recompute).
:func:`chunk_mlp` runs every MLP ``chunk_tokens`` tokens at a time, each chunk checkpointed, so
that at most one chunk's temporaries exist in the forward, in the layer's recompute and in the
backward. The MLP acts on every token alone, so the results are those of the whole call. The
price is up to one more MLP forward per step where the layer is checkpointed too (the layer's
recompute runs the chunks' forward, and each chunk's backward recomputes it once more).

With ``keep_attention=True`` each checkpointed layer keeps its attention output (and LSE) from
the forward: the backward's recompute of the layer then runs everything but the attention kernel,
whose cost grows with the row's unmasked pairs while the rest grows with its tokens. The price is one
``[B, S, Hq, Dv]`` tensor per layer, about the size of the layer input in most models (Llama:
``Hq * Dv`` = hidden). Under the hood it is PyTorch's selective activation checkpointing with
:func:`keep_attention_policy` (:func:`keep_attention_context` is the ``context_fn``), usable with any
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` call, eager or under ``torch.compile``.

Example (a transformers model)::

    enable_activation_checkpointing(model, offload=True)   # every decoder layer
    chunk_mlp(model, chunk_tokens=65536)                   # every layer's mlp, 64K tokens at a time
    # or: keep the attention outputs, recompute only the rest of each layer
    enable_activation_checkpointing(model, keep_attention=True)
"""
from __future__ import annotations

import functools
from typing import Iterable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["offload_checkpoint", "enable_activation_checkpointing", "chunk_mlp", "keep_attention_policy",
           "keep_attention_context", "ATTENTION_OPS", "OFFLOAD_MIN_BYTES", "MLP_CHUNK_TOKENS"]

#: Inputs smaller than this stay on the device (the copies would cost more than they save).
OFFLOAD_MIN_BYTES = 1 << 20
#: Default tokens per MLP chunk: 64K x 4864 x 2 bytes = 0.6 GB per temporary, GEMMs still large.
MLP_CHUNK_TOKENS = 65536
_streams: dict = {}


def _side_stream(device: torch.device):
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def _offloadable(x, min_bytes: int) -> bool:
    if not isinstance(x, torch.Tensor) or x.numel() == 0 or x._base is not None or not x.is_contiguous():
        return False
    if x.device.type not in ("cuda", "cpu") or x.storage_offset() != 0:
        return False
    nbytes = x.numel() * x.element_size()
    return nbytes >= min_bytes and x.untyped_storage().nbytes() == nbytes  # x owns its whole storage


def _first_tensor(y):
    if isinstance(y, torch.Tensor):
        return y if y.requires_grad else None
    if isinstance(y, (tuple, list)):
        for t in y:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return t
    return None


class _HostCopy:
    """A host copy of ``x``'s storage; ``x``'s device storage is freed until :meth:`restore`."""

    def __init__(self, x: torch.Tensor):
        self.x, self.nbytes = x, x.untyped_storage().nbytes()
        self.event = None
        if x.is_cuda:
            stream = _side_stream(x.device)
            stream.wait_stream(torch.cuda.current_stream(x.device))
            self.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                self.host.copy_(x, non_blocking=True)
                self.event = stream.record_event()
            x.record_stream(stream)  # the freed block is not reused before the copy has read it
        else:
            self.host = x.detach().clone()
        x.untyped_storage().resize_(0)

    def restore(self, *_):
        x = self.x
        if x is None:
            return None
        st = x.untyped_storage()
        if st.nbytes() == 0:
            st.resize_(self.nbytes)
            if x.is_cuda:
                torch.cuda.current_stream(x.device).wait_event(self.event)
                st.copy_(self.host.untyped_storage(), non_blocking=True)
            else:
                st.copy_(self.host.untyped_storage())
        self.x = self.host = None
        return None  # the gradient passes unchanged


# --------------------------------------------------------------------------------------------
# the attention kept, the rest recomputed

#: The ops whose outputs :func:`keep_attention_policy` saves: the attention kernels' forward (the
#: reference path, plain PyTorch ops, is recomputed as before).
ATTENTION_OPS = (torch.ops.flashmask.fwd.default,)


def keep_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpointing policy: save the outputs of :data:`ATTENTION_OPS`, recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def keep_attention_context(extra_ops: Iterable = ()):
    """``context_fn`` of ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` that keeps
    the attention outputs (:func:`keep_attention_policy`) and those of ``extra_ops`` (``OpOverload``s,
    e.g. ``torch.ops.aten._scaled_dot_product_efficient_attention.default`` for other layers)::

        checkpoint(layer, x, use_reentrant=False, context_fn=keep_attention_context)
        model.gradient_checkpointing_enable({"use_reentrant": False, "context_fn": keep_attention_context})
    """
    try:
        extra = tuple(extra_ops)
    except TypeError:
        raise TypeError(f"extra_ops must be an iterable of ops (OpOverload), got {extra_ops!r}") from None
    bad = [op for op in extra if not isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator))]
    if bad:
        raise ValueError(f"extra_ops must hold ops such as torch.ops.aten.mm.default (an OpOverload, not the packet "
                         f"torch.ops.aten.mm), got {bad[0]!r} of type {type(bad[0]).__name__}")
    if not extra:
        return create_selective_checkpoint_contexts(keep_attention_policy)
    return create_selective_checkpoint_contexts(list(ATTENTION_OPS + extra))


def offload_checkpoint(fn, *args, min_bytes: int = OFFLOAD_MIN_BYTES, **kwargs):
    """``checkpoint(fn, *args, use_reentrant=False, **kwargs)``, with ``args[0]`` kept in host memory
    between the forward and the backward (see the module docstring).

    The offload is skipped (plain checkpointing) when gradients are off, when ``args[0]`` is not
    a contiguous tensor owning its storage of at least ``min_bytes``, or when the output has no
    tensor that requires grad. Drop-in for transformers' ``layer._gradient_checkpointing_func``.
    """
    y = checkpoint(fn, *args, use_reentrant=False, **kwargs)
    if not torch.is_grad_enabled() or not args or not _offloadable(args[0], min_bytes):
        return y
    out = _first_tensor(y)
    if out is None:
        return y
    copy = _HostCopy(args[0])
    out.register_hook(copy.restore)
    return y


def enable_activation_checkpointing(model: torch.nn.Module, offload=False, layers=None,
                                    min_bytes: int = OFFLOAD_MIN_BYTES,
                                    auto_fraction: float = 0.25, keep_attention: bool = False) -> torch.nn.Module:
    """Checkpoint every layer of ``model`` (non-reentrant), optionally offloading the checkpoints.

    A transformers model is switched with its own ``activation_checkpointing_enable`` /
    ``gradient_checkpointing_enable`` (FSDP2's hooks stay outside the checkpoint), and with
    ``offload`` every checkpointed layer uses :func:`offload_checkpoint`. Any other model: pass
    ``layers`` (modules whose ``forward(x, ...)`` takes the activations first); their forward is
    wrapped. Returns ``model``.

    ``offload="auto"``: offload only where it pays, i.e. a layer input is moved to the host when
    the inputs of all layers together would take more than ``auto_fraction`` of the GPU's memory
    (``min_bytes`` = that share / number of layers); shorter rows stay on the GPU and pay no copies.

    ``keep_attention``: each layer keeps its attention output for the backward instead of running
    the attention kernel again in its recompute (:func:`keep_attention_context`; the output stays on
    the GPU also with ``offload``).
    """
    if offload not in (True, False, "auto"):
        raise ValueError(f"offload must be True, False or 'auto', got {offload!r}")
    if not isinstance(keep_attention, bool):
        raise ValueError(f"keep_attention must be True or False, got {keep_attention!r}")

    def auto_min_bytes(n_layers: int) -> int:
        p = next(model.parameters(), None)
        if offload != "auto" or p is None or not p.is_cuda:
            return min_bytes
        total = torch.cuda.get_device_properties(p.device).total_memory
        return max(min_bytes, int(auto_fraction * total / max(1, n_layers)))

    # context_fn only where it is needed: torch.compile traces a checkpoint given the default one only
    extra = {"context_fn": keep_attention_context} if keep_attention else {}
    kw = {"use_reentrant": False, **extra}
    if layers is None:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        elif hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        else:
            raise ValueError("pass layers=... for a model that is not a transformers PreTrainedModel")
        if offload:
            try:
                from transformers.modeling_layers import GradientCheckpointingLayer as _Layer
            except ImportError:  # older transformers: every module that got a checkpoint function
                _Layer = None
            targets = [m for m in model.modules() if m is not model and getattr(m, "gradient_checkpointing", False)
                       and hasattr(m, "_gradient_checkpointing_func") and (_Layer is None or isinstance(m, _Layer))]
            if not targets:
                raise ValueError(f"{type(model).__name__} has no checkpointed layers to offload")
            func = functools.partial(offload_checkpoint, min_bytes=auto_min_bytes(len(targets)), **extra)
            for m in targets:
                m._gradient_checkpointing_func = func
        return model
    layers = list(layers)
    threshold = auto_min_bytes(len(layers))
    for layer in layers:
        inner = layer.forward

        def forward(*a, _inner=inner, _layer=layer, **k):
            if not (torch.is_grad_enabled() and _layer.training):
                return _inner(*a, **k)
            if offload:
                return offload_checkpoint(_inner, *a, min_bytes=threshold, **extra, **k)
            return checkpoint(_inner, *a, use_reentrant=False, **extra, **k)

        layer.forward = forward
    return model


# --------------------------------------------------------------------------------------------
# the MLP in chunks of tokens

_MLP_INNER = "_flashmask_mlp_forward"  # the forward a chunked mlp calls per chunk
_MLP_CHUNK = "_flashmask_mlp_chunk_tokens"


def _chunked_forward(module: torch.nn.Module, x: torch.Tensor, *args, **kwargs):
    """``module``'s original forward over ``x`` ``[..., H]`` in chunks of tokens (all leading
    dimensions flattened: the MLP treats every token alone, so a chunk may cross rows). A chunk of
    ``c`` tokens goes in as ``[1, c, H]`` when ``x`` has a batch and a sequence dimension (as some
    mixture-of-experts blocks expect), else as ``[c, H]``. The output is one tensor, or a tuple of it
    and per-token tensors ``[c, ...]`` (GPT-OSS's router scores), each put back together."""
    inner, chunk = getattr(module, _MLP_INNER), getattr(module, _MLP_CHUNK)
    tokens = x.numel() // x.shape[-1] if x.dim() >= 2 and x.shape[-1] else 0
    if tokens <= chunk:
        return inner(x, *args, **kwargs)
    # Non-reentrant checkpoints nest inside the layer's own checkpoint and leave FSDP2's hooks,
    # which sit on the layer, alone. Without grad there is nothing to save, hence nothing to recompute.
    if torch.is_grad_enabled():
        run = functools.partial(checkpoint, inner, use_reentrant=False)
    else:
        run = inner
    outs = []
    for part in x.reshape(tokens, x.shape[-1]).split(chunk):
        c = part.shape[0]
        y = run(part.unsqueeze(0) if x.dim() >= 3 else part, *args, **kwargs)
        parts = y if isinstance(y, tuple) else (y,)
        main = parts[0].reshape(-1, parts[0].shape[-1]) if isinstance(parts[0], torch.Tensor) else None
        if (main is None or main.shape[0] != c or parts[0].dim() != (3 if x.dim() >= 3 else 2)
                or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == c for t in parts[1:])):
            got = [f"{type(t).__name__} {tuple(getattr(t, 'shape', ()))}" for t in parts]
            raise TypeError(f"chunk_mlp: {type(module).__name__} must map the tokens of a chunk to one tensor "
                            f"[tokens, H'] (or a tuple of it and per-token tensors [tokens, ...]), got {got} for "
                            f"{c} tokens")
        outs.append((main,) + tuple(parts[1:]))
    # (the backward of cat only slices: no copy of the gradient per chunk)
    out = torch.cat([o[0] for o in outs])
    out = out.view(*x.shape[:-1], out.shape[-1])
    if len(outs[0]) == 1:
        return out
    return (out,) + tuple(torch.cat([o[i] for o in outs]) for i in range(1, len(outs[0])))


def _find_mlps(model: torch.nn.Module, name: str) -> list:
    """Every submodule registered as ``name``, outermost first, none inside another one."""
    found = []
    for path, m in model.named_modules():
        if path.rsplit(".", 1)[-1] == name and not any(path.startswith(p + ".") for p, _ in found):
            found.append((path, m))
    return [m for _, m in found]


def chunk_mlp(model: torch.nn.Module, chunk_tokens: int = MLP_CHUNK_TOKENS, *, modules=None,
              name: str = "mlp") -> torch.nn.Module:
    """Run every MLP of ``model`` ``chunk_tokens`` tokens at a time, each chunk checkpointed.

    The MLPs are the submodules registered as ``name`` (``"mlp"``: the ``LlamaMLP`` /
    ``Qwen2MLP`` / ... of each decoder layer of a transformers causal LM), or ``modules``. Their
    ``forward`` is replaced on the instance (the parameters, their names and the state dict stay
    as they are, so FSDP2's ``fully_shard`` of the layer, saving and loading see no difference)
    by one that splits the input ``[..., H]`` into chunks of ``chunk_tokens`` tokens and runs the
    original forward on each under ``checkpoint(..., use_reentrant=False)`` (plainly when
    gradients are off). Under context parallelism the MLP sees this rank's tokens: those are
    chunked. Inputs of at most ``chunk_tokens`` tokens take the original forward unchanged.
    Calling it again changes the chunk size. Composes with :func:`enable_activation_checkpointing`
    (either order). Returns ``model``.

    Only for MLPs that act on each token alone: every dense transformer MLP, and mixture-of-experts
    blocks, which route per token (GPT-OSS's, which also returns its per-token router scores,
    DeepSeek-V3's); the output must be one tensor or a tuple of it and per-token tensors (an
    auxiliary loss over all tokens would be split into chunks: not supported).
    """
    if isinstance(chunk_tokens, bool) or not hasattr(chunk_tokens, "__index__") or int(chunk_tokens) < 1:
        raise ValueError(f"chunk_tokens must be a positive number of tokens, got {chunk_tokens!r}")
    targets = list(modules) if modules is not None else _find_mlps(model, name)
    if not targets:
        raise ValueError(f"{type(model).__name__} has no submodule named {name!r} to chunk; pass modules=[...] "
                         "(the MLP of each layer)")
    for m in targets:
        if _MLP_INNER not in m.__dict__:
            m.__dict__[_MLP_INNER] = m.forward  # kept outside _modules/_parameters: no new state
            m.forward = functools.partial(_chunked_forward, m)
        m.__dict__[_MLP_CHUNK] = int(chunk_tokens)
    return model
