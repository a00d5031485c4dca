"""Checkpoints: ``save_pretrained`` model and tokenizer (loadable with ``--model``) plus what
``--resume`` needs (optimizer, position in the data, loss history, RNG state), whole tensors written
by rank 0 so that a checkpoint resumes under any number of processes."""
from __future__ import annotations

import glob
import os
import re
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from training_examples.parallel import Parallel

if TYPE_CHECKING:
    from training_examples.packing import PackedStream
    from training_examples.train_log import LossLog

TRAINER_STATE = "trainer_state.pt"


def find_checkpoint(path: str) -> str:
    """``path`` if it is a checkpoint, else the checkpoint-STEP directory with the largest STEP in it."""
    if os.path.isfile(os.path.join(path, TRAINER_STATE)):
        return path
    found = [d for d in glob.glob(os.path.join(path, "checkpoint-*"))
             if re.fullmatch(r"checkpoint-\d+", os.path.basename(d)) and os.path.isfile(os.path.join(d, TRAINER_STATE))]
    if not found:
        raise FileNotFoundError(f"--resume {path}: neither a checkpoint nor a directory holding checkpoint-STEP/")
    return max(found, key=lambda d: int(d.rsplit("-", 1)[1]))


def _full_model_state(model, par: Parallel) -> Optional[Dict]:
    """With FSDP2: the whole state dict gathered to CPU on rank 0 (a collective; other ranks get
    ``{}``). One process: ``None`` (``save_pretrained`` takes the model's own)."""
    if not par.distributed:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _barrier(par: Parallel) -> None:
    if par.distributed:
        import torch.distributed as dist
        dist.barrier()


def save_pretrained(model, path: str, par: Optional[Parallel] = None) -> None:
    """``model.save_pretrained(path)`` without transformers' progress bar, which would cut through ours.
    With FSDP2 every rank must call it (the parameters are gathered); rank 0 writes."""
    from transformers.utils import logging as hf_logging

    par = par or Parallel()
    state = _full_model_state(model, par)
    if par.main:
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(path, state_dict=state)
        finally:
            hf_logging.enable_progress_bar()
    _barrier(par)


def optimizer_state(model, optimizer, par: Parallel) -> Dict:
    """The optimizer state keyed by parameter name (whole tensors on rank 0 under FSDP2, a collective),
    so that a checkpoint resumes under any number of processes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    opts = StateDictOptions(full_state_dict=par.distributed, cpu_offload=par.distributed)
    return get_optimizer_state_dict(model, optimizer, options=opts)


def load_optimizer_state(model, optimizer, state: Dict, par: Parallel) -> None:
    if state["state"] and all(isinstance(k, int) for k in state["state"]):  # written by optimizer.state_dict()
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=par.distributed))


def save_checkpoint(directory: str, step: int, model, tok, optimizer, stream: PackedStream, log: LossLog,
                    par: Optional[Parallel] = None) -> str:
    """``<directory>/checkpoint-<step>``: ``save_pretrained`` model and tokenizer (loadable with
    ``--model``), plus the optimizer, data position and loss history for ``--resume``. With several
    processes every rank calls it and rank 0 writes whole (unsharded) tensors."""
    par = par or Parallel()
    path = os.path.join(directory, f"checkpoint-{step}")
    opt_state = optimizer_state(model, optimizer, par)
    save_pretrained(model, path, par)
    if par.main:
        tok.save_pretrained(path)
        torch.save({"step": step, "optimizer": opt_state, "stream": stream.state_dict(),
                    "history": log.rows, "torch_rng": torch.get_rng_state()}, os.path.join(path, TRAINER_STATE))
    _barrier(par)
    return path


def restore(path: str, model, optimizer, stream: PackedStream,
            par: Optional[Parallel] = None) -> Tuple[int, List[Dict]]:
    """Load what :func:`save_checkpoint` wrote besides the model (every rank reads it); returns
    ``(step, history)``."""
    state = torch.load(os.path.join(path, TRAINER_STATE), map_location="cpu", weights_only=True)
    load_optimizer_state(model, optimizer, state["optimizer"], par or Parallel())
    stream.load_state_dict(state["stream"])
    torch.set_rng_state(state["torch_rng"])
    return state["step"], state["history"]
