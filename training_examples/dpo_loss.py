"""The DPO loss of packed ``[prompt | chosen | rejected]`` rows: the summed log-probabilities of
each response under the policy and the frozen reference (the LM head only at the response tokens,
in chunks; with several processes each rank's share, summed over its context-parallel group), the
loss ``-log sigmoid(beta * margin)`` and the preference accuracy."""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F

from training_examples.parallel import Parallel, parallel_context, shard_batch
from training_examples.trainer import chunk_size, to_device

LOGPS_METHOD = "flashmask_response_logps"


def response_logps(self, inputs: Dict[str, torch.Tensor], targets: torch.Tensor, valid: torch.Tensor,
                   pair: torch.Tensor, num_pairs: int, chunk_size: int) -> torch.Tensor:
    """``[2 * N]``: per triple, the summed log-probabilities of this rank's chosen (first N) and
    rejected (last N) response tokens. The decoder once, the LM head only at the ``valid [2, B, L]`` tokens
    (targets ``[2, B, L]``, triple ``pair [B, L]``), in chunks. Installed on the policy and the
    reference as an FSDP2 forward method (:func:`flashmask.distributed.fsdp.install_forward_method`)."""
    from flashmask.losses import decoder_of, final_logit_softcap, linear_token_logps

    hidden = decoder_of(self)(**inputs, use_cache=False).last_hidden_state
    head = self.get_output_embeddings()
    h = torch.cat([hidden[valid[0]], hidden[valid[1]]])
    lp = linear_token_logps(h, head.weight, torch.cat([targets[0][valid[0]], targets[1][valid[1]]]),
                            getattr(head, "bias", None), chunk_size=chunk_size, logit_softcap=final_logit_softcap(self))
    idx = torch.cat([pair[valid[0]], pair[valid[1]] + num_pairs])
    return lp.new_zeros(2 * num_pairs).index_add(0, idx, lp)  # flat: FSDP2 warns about returned views


def logps_inputs(batch: Dict[str, torch.Tensor], args, par: Parallel):
    """``(inputs, targets, valid, pair, plan)`` for :func:`response_logps` from a collated batch:
    this rank's tokens and the plan of its cp group (one process: the whole rows, plan ``None``).
    Targets and ``valid`` are sharded as tokens; padding added by the sharding is never valid."""
    from flashmask.data import IGNORE_INDEX, MASK_KEY

    parts = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], MASK_KEY: batch[MASK_KEY],
             "pair": batch["pair_index"]}
    for side in ("chosen", "rejected"):
        labels = batch[f"{side}_labels"]
        parts[f"{side}_t"], parts[f"{side}_valid"] = labels.clamp_min(0), labels != IGNORE_INDEX
    parts = to_device(parts, args.device)
    plan = None
    if par.distributed:
        parts, plan = shard_batch(parts, args, par)
    inputs = {k: parts[k] for k in ("input_ids", "position_ids", MASK_KEY) if k in parts}
    targets = torch.stack([parts["chosen_t"], parts["rejected_t"]])
    valid = torch.stack([parts["chosen_valid"], parts["rejected_valid"]])
    return inputs, targets, valid, parts["pair"], plan


def response_counts(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """``[2, N]``: the number of chosen and rejected tokens of every triple."""
    from flashmask.data import IGNORE_INDEX

    n = batch["pair_row"].shape[0]
    rows = []
    for key in ("chosen_labels", "rejected_labels"):
        v = batch[key] != IGNORE_INDEX
        rows.append(torch.zeros(n).index_add(0, batch["pair_index"][v], torch.ones(int(v.sum()))))
    return torch.stack(rows)


class _AllReduceSum(torch.autograd.Function):
    """Sum over a process group, differentiable: the gradient of every rank's input is the sum of
    the ranks' output gradients."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def whole_rows(sums: torch.Tensor, par: Parallel) -> torch.Tensor:
    """``[2, N]`` sums over the whole rows: the ranks' parts summed over the cp group (differentiably)."""
    if par.cp > 1:
        sums = _AllReduceSum.apply(sums, par.group)
    return sums.view(2, -1)


def dpo_step(policy, reference, batch: Dict[str, torch.Tensor], args, par: Parallel):
    """Forward and backward of the DPO loss of a collated batch; returns ``(loss, margin [N])``
    (the same on every rank of a cp group)."""
    n = batch["pair_row"].shape[0]
    inputs, targets, valid, pair, plan = logps_inputs(batch, args, par)
    chunk = chunk_size(args)
    with parallel_context(plan):  # forward and backward (checkpoint recompute)
        with torch.no_grad():
            ref = whole_rows(getattr(reference, LOGPS_METHOD)(inputs, targets, valid, pair, n, chunk), par)
        pol = whole_rows(getattr(policy, LOGPS_METHOD)(inputs, targets, valid, pair, n, chunk), par)
        if args.average_logps:
            counts = response_counts(batch).to(pol.device).clamp_min(1)
            pol, ref = pol / counts, ref / counts
        margin = args.beta * ((pol[0] - ref[0]) - (pol[1] - ref[1]))
        loss = -F.logsigmoid(margin).mean()
        # every cp rank backpropagates the same loss and the all-reduce's backward sums them
        (loss / par.cp).backward()
    return loss.detach(), margin.detach()


def preference_accuracy(margin: torch.Tensor) -> torch.Tensor:
    """The share of pairs whose chosen answer gained on the rejected one against the reference
    (``margin > 0``); a tie counts as half, so that the first step, where the policy is still the
    reference and every margin is 0, reads 0.5 rather than 0."""
    return ((margin > 0).float() + 0.5 * (margin == 0).float()).mean()
