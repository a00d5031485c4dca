"""Training recipes on flashmask: run as modules from the checkout, e.g. ``python -m training_examples.sft_packed``."""
