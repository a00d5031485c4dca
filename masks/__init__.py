"""FlashMask mask families and tools for the ``startend_row_indices`` column-interval format.

Every family module (``FAMILIES[name]``) has ``CAUSAL`` (the ``causal=`` flag to use), a builder
``name(seqlen, ...) -> int32 [B, 1, S, C]`` that never builds an S x S tensor, and a dense
FlexAttention-style definition ``name_mask_mod(...) -> (b, h, q_idx, kv_idx) -> bool``.
``import masks`` stays cheap: matplotlib is imported only by ``plot_mask``.

The builder functions shadow their modules as package attributes (``masks.causal`` is the
builder); reach a module through ``FAMILIES["causal"]`` (``from masks.causal import ...`` works
as usual). Pass ``device=`` to a ``*_mask_mod`` factory to put its lookup
tables (document ids, ...) on the device where FlexAttention will evaluate it.
"""
from __future__ import annotations

from . import (
               causal,
               causal_blockwise,
               causal_document,
               document,
               full,
               global_sliding_window,
               prefix_lm_causal,
               prefix_lm_document,
               qk_sparse,
               random_eviction,
               share_question,
               sliding_window,
)
from .causal import causal_mask_mod
from .causal_blockwise import causal_blockwise_mask_mod
from .causal_document import causal_document_mask_mod
from .convert import from_dense, merge_chunks, merge_window, window_to_startend
from .document import document_mask_mod
from .format import Intervals, check_columns, check_tensor, to_dense, unpack, validate
from .full import full_mask_mod
from .global_sliding_window import global_sliding_window_mask_mod
from .packed import document_starts, from_cu_seqlens, from_cu_seqlens_qk, from_position_ids
from .plot import plot_mask, visible_fraction
from .prefix_lm_causal import prefix_lm_causal_mask_mod
from .prefix_lm_document import prefix_lm_document_mask_mod
from .qk_sparse import qk_sparse_mask_mod
from .random_eviction import eviction_rows, random_eviction_mask_mod
from .share_question import share_question_mask_mod
from .sliding_window import sliding_window_mask_mod

# family name -> module (the module, not the builder, so that CAUSAL and the mask_mod come along).
FAMILIES = {m.__name__.rsplit(".", 1)[1]: m for m in (
    full, causal, sliding_window, causal_document, document, share_question, global_sliding_window,
    causal_blockwise, prefix_lm_causal, prefix_lm_document, qk_sparse, random_eviction)}

# The builders shadow their modules as attributes of the package (``masks.causal`` is the
# function); the modules stay reachable through FAMILIES and ``import masks.causal``.
full = full.full
causal = causal.causal
sliding_window = sliding_window.sliding_window
causal_document = causal_document.causal_document
document = document.document
share_question = share_question.share_question
global_sliding_window = global_sliding_window.global_sliding_window
causal_blockwise = causal_blockwise.causal_blockwise
prefix_lm_causal = prefix_lm_causal.prefix_lm_causal
prefix_lm_document = prefix_lm_document.prefix_lm_document
qk_sparse = qk_sparse.qk_sparse
random_eviction = random_eviction.random_eviction

__all__ = [
    "FAMILIES", "Intervals", "check_columns", "check_tensor", "unpack", "to_dense", "validate", "from_dense",
    "window_to_startend", "merge_window", "merge_chunks", "from_cu_seqlens", "from_cu_seqlens_qk",
    "from_position_ids", "document_starts",
    "plot_mask", "visible_fraction", "eviction_rows",
    *FAMILIES, *(f"{n}_mask_mod" for n in FAMILIES),
]
