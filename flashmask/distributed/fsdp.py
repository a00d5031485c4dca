"""FSDP2 with context parallelism: a 2-D DeviceMesh, ``fully_shard`` per layer, the loss of a rank.

Mesh ``(dp, cp)``: ``dp`` groups of ranks see different batches; the ``cp`` ranks of a group
share one batch, each holding ``S / cp`` of its tokens (:func:`shard_packed_batch`). Parameters
are replicated across both dimensions in plain data parallelism, so FSDP2 shards them over the
flattened ``dp x cp`` mesh (as torchtitan does): every rank holds ``1 / (dp * cp)`` of every
parameter, gathers a layer's parameters for its forward and backward, and reduce-scatters the
gradients. Each cp rank's gradients are its *part* of the gradient of its group's batch (the
loss of a rank is its tokens' share of the batch loss), so they must be summed over ``cp`` and
averaged over ``dp``: :func:`apply_fsdp2` sets FSDP2's gradient divide factor to ``dp``
(instead of ``dp * cp``).

Example (torchrun --nproc-per-node 2, one node; dp=1, cp=2)::

    mesh = init_mesh(dp=1, cp=2, device_type="cuda")
    model = build_model(...).cuda()
    cp_hf.use_context_parallel(model)                    # attention over mesh["cp"]
    apply_fsdp2(model, mesh)
    for batch in loader:                                 # the same batch on the cp ranks of a dp group
        local, plan = shard_packed_batch(batch, group=cp_group(mesh))
        with cp_hf.context_parallel(plan):
            loss = lm_loss(model, local)                 # this rank's share of the batch loss
            loss.backward()
        opt.step(); opt.zero_grad()
        print(float(reduce_loss(loss, mesh)))            # the batch loss (mean over dp groups)
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from flashmask.losses import causal_lm_loss, decoder_of, final_logit_softcap

__all__ = ["init_mesh", "cp_group", "dp_group", "fsdp_mesh", "apply_fsdp2", "lm_loss", "reduce_loss",
           "decoder_layers", "sum_gradients", "install_forward_method"]

_LOSS_METHOD = "flashmask_lm_loss"


def init_mesh(dp: int, cp: int, device_type: str = "cuda"):
    """A DeviceMesh ``(dp, cp)`` over ``dp * cp`` ranks, dimensions named ``"dp"`` and ``"cp"``
    (torch.distributed must be initialised with that world size). Ranks ``[i * cp, (i + 1) * cp)``
    form one cp group: keep them on one node (NVLink) and put the dp dimension across nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if dp * cp != world:
        raise ValueError(f"dp * cp = {dp} * {cp} must equal the world size {world}")
    return init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))


def cp_group(mesh):
    """The context-parallel process group of this rank."""
    return mesh["cp"].get_group()


def dp_group(mesh):
    return mesh["dp"].get_group()


def fsdp_mesh(mesh):
    """The 1-D ``dp x cp`` mesh FSDP2 shards over (the mesh itself if it is 1-D)."""
    if mesh.ndim == 1:
        return mesh
    flat = getattr(mesh["dp", "cp"], "_flatten", None)
    if flat is None:  # pragma: no cover - torch without DeviceMesh._flatten
        raise RuntimeError("this torch cannot flatten a DeviceMesh; use torch >= 2.6")
    return flat("dp_cp")


def decoder_layers(model: torch.nn.Module) -> list:
    """The decoder layers of a transformers causal LM (``model.model.layers``), or raise."""
    try:
        dec = decoder_of(model)
    except ValueError:
        dec = None
    layers = getattr(dec, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}; pass layers=...")
    return list(layers)


def apply_fsdp2(model: torch.nn.Module, mesh, *, layers: Optional[Iterable[torch.nn.Module]] = None,
                mp_policy=None, reshard_after_forward: bool = True, offload_policy=None) -> torch.nn.Module:
    """``fully_shard`` every decoder layer, then the root (embeddings, final norm, LM head), on the
    flattened ``dp x cp`` mesh; gradients summed over cp and averaged over dp. Returns ``model``.

    Args:
        mesh: from :func:`init_mesh` (2-D), or a 1-D mesh (plain FSDP, no context parallelism).
        layers: the modules to shard one by one (default :func:`decoder_layers`).
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (e.g. bf16 parameters,
            fp32 gradient reduction), or None.
        reshard_after_forward, offload_policy: passed to ``fully_shard``.
    """
    from torch.distributed.fsdp import fully_shard

    flat = fsdp_mesh(mesh)
    kw = {"mesh": flat, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if offload_policy is not None:
        kw["offload_policy"] = offload_policy
    for layer in (decoder_layers(model) if layers is None else layers):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    if mesh.ndim == 2:
        dp = mesh["dp"].size()
        # gloo has no PREMUL_SUM (what NCCL uses for a custom factor): plain sums and a separate scaling
        sum_only = dist.get_backend(flat.get_group()) == "gloo"
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(float(dp))
                if sum_only and hasattr(m, "set_force_sum_reduction_for_comms"):
                    m.set_force_sum_reduction_for_comms(True)
    _install_loss_method(model)
    return model


def install_forward_method(model: torch.nn.Module, name: str, fn) -> None:
    """Bind ``fn(model, *args, **kwargs)`` as ``model.<name>`` and register it as an FSDP2 forward
    method: the root's parameters (embeddings, final norm, tied LM head) are gathered around it and
    their gradients reduce-scattered after the backward, as for ``model.forward``. Use it for a
    computation that calls the decoder and the LM head itself (the chunked LM loss, DPO's per-token
    log-probabilities). A no-op registration on a model that is not sharded with FSDP2."""
    setattr(model, name, fn.__get__(model, type(model)))
    try:
        from torch.distributed.fsdp import register_fsdp_forward_method
        register_fsdp_forward_method(model, name)  # a no-op unless model is an FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        pass


def _install_loss_method(model: torch.nn.Module) -> None:
    if getattr(model, "_flashmask_loss_installed", False):
        return

    def method(self, input_ids, position_ids, shift_labels, num_items_in_batch, chunk_size):
        hidden = decoder_of(self)(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return causal_lm_loss(hidden, self.get_output_embeddings(), shift_labels=shift_labels,
                              num_items_in_batch=num_items_in_batch, chunk_size=chunk_size,
                              logit_softcap=final_logit_softcap(self))

    install_forward_method(model, _LOSS_METHOD, method)
    model._flashmask_loss_installed = True


def lm_loss(model: torch.nn.Module, local: dict, *, chunk_size: int = 4096) -> torch.Tensor:
    """This rank's share of the causal-LM loss of its batch: the sum of its tokens' cross-entropy
    over ``local["num_items_in_batch"]`` (the targets of the whole batch), chunked so that no
    ``[S, vocab]`` logits exist (:func:`flashmask.losses.causal_lm_loss`). ``local`` comes from
    :func:`shard_packed_batch`; the model runs ``attn_implementation="fm_cp"`` inside
    ``context_parallel(plan)``. Works with and without FSDP2 (:func:`apply_fsdp2`)."""
    _install_loss_method(model)
    num = local.get("num_items_in_batch")
    if num is None:
        raise ValueError("local has no num_items_in_batch: shard a batch that has labels")
    return getattr(model, _LOSS_METHOD)(local["input_ids"], local["position_ids"], local["shift_labels"], num,
                                        chunk_size)


def reduce_loss(loss: torch.Tensor, mesh=None, group=None) -> torch.Tensor:
    """The batch loss for logging: the sum of the ranks' shares over cp, averaged over dp."""
    t = loss.detach().clone()
    if mesh is not None:
        dist.all_reduce(t, group=cp_group(mesh))
        if mesh.ndim == 2 and mesh["dp"].size() > 1:
            dist.all_reduce(t, group=dp_group(mesh))
            t /= mesh["dp"].size()
    elif group is not None or (dist.is_available() and dist.is_initialized()):
        dist.all_reduce(t, group=group)
    return t


def sum_gradients(model: torch.nn.Module, group=None) -> None:
    """Without FSDP (every rank holds the whole model): sum the parameter gradients over the
    context-parallel ``group`` after the backward, so that each rank holds the batch's gradient."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
