"""The small synthetic data sets of the examples (``sft.jsonl``, ``dpo.jsonl``) and their generator,
``python -m training_examples.data.make_data``."""
