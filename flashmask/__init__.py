"""flashmask: exact attention with FlashMask column-interval masks at FlashAttention speed.

``flashmask_attention(q, k, v, startend_row_indices, causal=...)`` is the entry point; the mask
families and conversions live in :mod:`masks` (also reachable as ``flashmask.masks``).
"""
import masks  # noqa: F401  (re-exported as flashmask.masks)
from flashmask import _cuda as cuda
from flashmask.attention import flashmask_attention
from flashmask.modules import FlashMaskAttention, FlashMaskSelfAttention, RotaryEmbedding
from flashmask.reference import reference_attention
from masks.format import to_dense, validate

__version__ = "0.1.0"
__all__ = ["flashmask_attention", "reference_attention", "FlashMaskAttention", "FlashMaskSelfAttention",
           "RotaryEmbedding", "masks", "to_dense", "validate", "cuda"]
