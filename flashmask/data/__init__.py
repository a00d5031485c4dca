"""Collators that pack training samples into rows with a FlashMask mask (no dense mask anywhere).

Two collators, both callable on a list of tokenized samples (e.g. as a ``DataLoader``
``collate_fn``) and both returning a dict of tensors whose ``attn_mask_startend_row_indices``,
``position_ids`` and ``input_ids`` go straight into a Hugging Face model running the
``"fm_colmask"`` backend (:mod:`flashmask.integrations.transformers`) or into
:func:`flashmask.flashmask_attention`:

* :class:`PackedSFTCollator`: supervised fine-tuning. Documents are packed into rows of at most
  ``max_length`` tokens; each attends causally to itself only (causal-document mask,
  ``LTS[j] = end of j's document``); ``position_ids`` restart at 0 in every document; the label
  of each document's first token is ``-100`` so that no token is trained to predict across a
  document boundary (transformers shifts labels inside the loss: logits at ``t`` predict
  ``labels[t + 1]``).
* :class:`ShareQuestionCollator`: DPO and reward models. Each sample is a prompt with a chosen
  and a rejected response laid out as ``[prompt | chosen | rejected]`` in one sequence, so the
  prompt is encoded once. Rejected tokens cannot see chosen tokens, and the positions of both
  responses continue from the prompt, so every response token sees exactly what it would see in
  its own ``prompt + response`` sequence. Several such triples can be packed into one row.
  :func:`shared_sequence_logps` turns the model's logits into the per-sample log-probabilities
  DPO needs; :func:`response_end_values` picks the per-sample scores a reward model needs.

Padding (appended at the end of a row) forms one extra segment that attends only to itself:
no real token ever sees a padding token or loses sight of a real one, and padding carries label
``-100`` (so the outputs at real tokens are exactly those of an unpadded row).

Example::

    >>> from flashmask.data import PackedSFTCollator
    >>> collate = PackedSFTCollator(max_length=8, pad_token_id=0)
    >>> batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [1, 2, 3, 4]}])
    >>> batch["input_ids"].tolist()      # best-fit decreasing: [4-doc, 3-doc] then [2-doc] + padding
    [[1, 2, 3, 4, 5, 6, 7], [8, 9, 0, 0, 0, 0, 0]]
"""
from flashmask.data.batches import logp_positions, model_inputs, response_end_values, shared_sequence_logps
from flashmask.data.packing import MASK_KEY, PACKING_STRATEGIES, pack_sequences
from flashmask.data.sft import PackedSFTCollator
from flashmask.data.share_question import ShareQuestionCollator
from flashmask.losses import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "MASK_KEY", "PACKING_STRATEGIES", "pack_sequences", "PackedSFTCollator",
           "ShareQuestionCollator", "shared_sequence_logps", "response_end_values", "logp_positions", "model_inputs"]
