"""Integrations of flashmask with other libraries.

Each submodule imports its library lazily, so ``import flashmask`` never needs them:

* :mod:`flashmask.integrations.transformers`: a Hugging Face ``transformers`` attention backend
  (``attn_implementation="fm_colmask"``) that takes FlashMask column-interval masks.
"""
