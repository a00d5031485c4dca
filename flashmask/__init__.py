"""flashmask: exact attention with FlashMask column-interval masks at FlashAttention speed.

Public API, one line each (docs/format.md is the mask contract):

Attention
    flashmask_attention     exact attention under a mask: the CUDA kernels, else the reference path
    reference_attention     the pure-PyTorch path, (out, lse) on any device: the tests' oracle
    flash_attn_func, flash_attn_varlen_func  flash-attn 2's functions on flashmask (packed documents)
    cuda                    the kernels' build: cuda.available(), cuda.unavailable_reason()
    python -m flashmask     what this installation runs: versions, GPUs, kernels (flashmask.env_report)

Modules
    FlashMaskAttention      the attention core as an nn.Module (BSHD or BHSD layout)
    FlashMaskSelfAttention  q/k/v/o projections, GQA and rotary around the core
    RotaryEmbedding         RoPE from explicit position ids (packed documents restart them)

Masks: ``masks``, also ``flashmask.masks``
    masks.causal_document, masks.share_question, ...  int32 [B, 1, S, C] builders (masks.FAMILIES)
    masks.from_cu_seqlens, masks.from_position_ids   document masks of packed rows
    to_dense, validate                               expand a mask, check a mask

Data: ``flashmask.data``
    PackedSFTCollator, ShareQuestionCollator         pack samples into rows with their mask
    shared_sequence_logps, response_end_values       DPO log-probabilities, reward-model scores

Losses: ``flashmask.losses``
    linear_cross_entropy, causal_lm_loss, linear_token_logps  the LM head and loss, chunked

Checkpointing: ``flashmask.checkpointing``
    enable_activation_checkpointing, offload_checkpoint, chunk_mlp  checkpoints on the host
    keep_attention_context   checkpointing that keeps the attention outputs (no attention recompute)

Integrations: ``flashmask.integrations.transformers``
    the "fm_colmask" attention backend of Hugging Face transformers; use_flashmask(model)

Distributed: ``flashmask.distributed``
    shard_packed_batch, context_parallel_attention, make_plan  context parallelism
    flashmask.distributed.hf ("fm_cp" backend), flashmask.distributed.fsdp (FSDP2 + CP)

The submodules after "Masks" are imported on demand (``import flashmask.data``), so that
``import flashmask`` stays cheap.
"""
import sys

import masks
from flashmask import _cuda as cuda
from flashmask.attention import flashmask_attention
from flashmask.modules import FlashMaskAttention, FlashMaskSelfAttention, RotaryEmbedding
from flashmask.reference import reference_attention
from masks.format import to_dense, validate

# ``import flashmask.masks`` and ``from flashmask.masks(.packed) import ...`` reach the very modules
# of the top-level ``masks`` package (aliases, not copies).
for _name, _module in list(sys.modules.items()):
    if _name == "masks" or _name.startswith("masks."):
        sys.modules.setdefault(f"{__name__}.{_name}", _module)
del _name, _module


def __getattr__(name: str):
    # flash-attn's functions on first use: their module imports torch._dynamo (torch.compiler.disable),
    # which ``import flashmask`` leaves out.
    if name in ("flash_attn_func", "flash_attn_varlen_func"):
        from flashmask import flash_attn

        return getattr(flash_attn, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"
__all__ = ["flashmask_attention", "reference_attention", "flash_attn_func", "flash_attn_varlen_func",
           "FlashMaskAttention", "FlashMaskSelfAttention",
           "RotaryEmbedding", "masks", "to_dense", "validate", "cuda"]
