"""What a collated batch gives the model and what its outputs give the loss: the model's inputs, and
the per-sample log-probabilities and end values of a share-question batch (:mod:`flashmask.data`)."""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from flashmask.data.packing import MASK_KEY
from flashmask.losses import IGNORE_INDEX


def model_inputs(batch: Dict[str, torch.Tensor], device=None) -> Dict[str, torch.Tensor]:
    """The model arguments of a collated batch: ``input_ids``, ``position_ids`` and the mask.

    (A :class:`ShareQuestionCollator` batch also holds loss-side tensors that a model must not
    receive.) ``device`` moves them there.
    """
    keys = ("input_ids", "position_ids", MASK_KEY)
    out = {k: batch[k] for k in keys if k in batch}
    if device is not None:
        out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    return out


def logp_positions(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """bool ``[R, S]``: the columns whose logits :func:`shared_sequence_logps` reads.

    Computing the LM head only there (``lm_head(hidden[logp_positions(batch)])``) saves the
    logits of prompt and padding tokens.
    """
    return (batch["chosen_labels"] != IGNORE_INDEX) | (batch["rejected_labels"] != IGNORE_INDEX)


def shared_sequence_logps(logits: torch.Tensor, batch: Dict[str, torch.Tensor], *, average: bool = False,
                          chunk_size: int = 4096) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-triple log-probabilities of the chosen and rejected responses from one shared forward.

    Args:
        logits: ``[R, S, V]`` (the model's output on a :class:`ShareQuestionCollator` batch), or
            ``[T, V]``: the logits at the ``T`` columns of :func:`logp_positions` (row-major).
        batch: the collated batch (uses ``chosen_labels``, ``rejected_labels``, ``pair_index``,
            ``pair_row``).
        average: mean over each response's tokens instead of the sum.
        chunk_size: rows of logits turned into float32 at a time.

    Returns:
        ``(chosen_logps, rejected_logps)``, float32 ``[N]``: ``sum_t log p(response_t | prompt,
        response_<t)``, equal (up to rounding) to what separate ``prompt + chosen`` and
        ``prompt + rejected`` sequences give. Differentiable in ``logits``.
    """
    need = logp_positions(batch).to(logits.device)
    if logits.dim() == 3:
        if logits.shape[:2] != need.shape:
            raise ValueError(f"logits have shape {tuple(logits.shape)}, the batch is {tuple(need.shape)}")
        logits = logits[need]
    elif logits.dim() == 2:
        t = int(need.sum())
        if logits.shape[0] != t:
            raise ValueError(f"logits [T, V] must have T = logp_positions(batch).sum() = {t} rows, "
                             f"got {logits.shape[0]}")
    else:
        raise ValueError(f"logits must be [R, S, V] or [T, V], got {tuple(logits.shape)}")
    n = batch["pair_row"].shape[0]
    pair = batch["pair_index"].to(logits.device)[need]
    chunks = [torch.logsumexp(logits[i:i + chunk_size].float(), -1) for i in range(0, logits.shape[0], chunk_size)]
    lse = torch.cat(chunks) if chunks else logits.new_zeros(0, dtype=torch.float32)
    outs = []
    for key in ("chosen_labels", "rejected_labels"):
        tgt = batch[key].to(logits.device)[need]
        valid = tgt != IGNORE_INDEX
        idx = valid.nonzero().squeeze(1)
        lp = logits[idx].gather(-1, tgt[idx, None]).squeeze(-1).float() - lse[idx]
        total = torch.zeros(n, dtype=torch.float32, device=logits.device).index_add(0, pair[idx], lp)
        if average:
            cnt = torch.zeros(n, dtype=torch.float32, device=logits.device).index_add(
                0, pair[idx], torch.ones_like(lp))
            total = total / cnt.clamp_min(1)
        outs.append(total)
    return outs[0], outs[1]


def response_end_values(values: torch.Tensor, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reward-model scores: ``values`` at the last token of each chosen and rejected response.

    Args:
        values: ``[R, S]`` or ``[R, S, K]`` per-token outputs (e.g. a value head's scores).
        batch: a :class:`ShareQuestionCollator` batch.

    Returns:
        ``(chosen, rejected)``, each ``[N]`` or ``[N, K]``; each equals the score of the separate
        ``prompt + response`` sequence at its last token.
    """
    row = batch["pair_row"].to(values.device)
    ce = batch["chosen_spans"][:, 1].to(values.device) - 1
    re_ = batch["rejected_spans"][:, 1].to(values.device) - 1
    return values[row, ce], values[row, re_]
