"""The models of the examples: a randomly initialised Llama or Qwen2 preset with the byte-level
tokenizer (nothing downloaded), or a local Hugging Face causal LM directory (any family the
flashmask backend runs: Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3, GPT-OSS, DeepSeek-V3, ...; see
the README's table); then activation checkpointing, chunked MLPs and, with several processes, the
context-parallel backend and FSDP2."""
from __future__ import annotations

import os
from typing import Optional

import torch

from training_examples import byte_tokenizer
from training_examples.parallel import Parallel

# name -> (hidden, intermediate, layers, heads, kv heads)
MODEL_SIZES = {
    "tiny": (64, 128, 2, 4, 2),          # ~0.1M parameters: CPU tests
    "small": (256, 688, 4, 8, 2),        # ~3M
    "0.5b": (896, 4864, 24, 14, 2),      # Qwen2-0.5B shape (byte vocabulary): ~360M
    "1b": (2048, 8192, 16, 32, 8),       # Llama-3.2-1B shape (byte vocabulary): ~1B
    "3b": (3072, 8192, 28, 24, 8),       # Llama-3.2-3B shape (byte vocabulary): ~3B, head dim 128
}


def build_model(arch: str, size: str, *, attn_implementation: str, max_length: int, vocab_size: int,
                dtype: torch.dtype, device, seed: int = 0, sliding_window: Optional[int] = None):
    """A randomly initialised Llama or Qwen2 causal LM (transformers), on ``device`` in ``dtype``."""
    import transformers

    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(MODEL_SIZES)}")
    hidden, inter, layers, heads, kv = MODEL_SIZES[size]
    common = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=vocab_size, max_position_embeddings=max(max_length, 2048),
                  rope_theta=1_000_000.0, tie_word_embeddings=True, pad_token_id=byte_tokenizer.PAD,
                  bos_token_id=byte_tokenizer.BOS, eos_token_id=byte_tokenizer.EOS)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        extra = {}
        if sliding_window is not None:
            extra = dict(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0)
        cfg = transformers.Qwen2Config(**common, **extra)
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}; choose 'llama' or 'qwen2'")
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation=attn_implementation)
    return model.to(device=device, dtype=dtype)


def load_pretrained(path: str, *, attn_implementation: str, dtype: torch.dtype, device, tokenizer: bool = True):
    """``(model, tokenizer)`` of a local Hugging Face causal LM directory (tokenizer None if not wanted)."""
    import transformers
    from packaging import version
    from transformers.utils import logging as hf_logging

    # transformers renamed torch_dtype to dtype in 4.56.
    key = "dtype" if version.parse(transformers.__version__).release >= (4, 56) else "torch_dtype"
    quiet = int(os.environ.get("RANK", "0")) > 0  # one progress bar, not one per process
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn_implementation,
                                                                  **{key: dtype})
    finally:
        if quiet:
            hf_logging.enable_progress_bar()
    tok = transformers.AutoTokenizer.from_pretrained(path) if tokenizer else None
    return model.to(device), tok


def load_model_and_tokenizer(args, attn_implementation: str):
    """``(model, tokenizer)``: from ``--resume`` (a checkpoint), ``--model``, or a random preset."""
    path = args.resume or args.model
    if path is not None:
        model, tok = load_pretrained(path, attn_implementation=attn_implementation, dtype=args.dtype,
                                     device=args.device)
        desc = os.path.basename(os.path.normpath(path))
    else:
        tok = byte_tokenizer.byte_tokenizer()
        model = build_model(args.arch, args.model_size, attn_implementation=attn_implementation,
                            max_length=args.max_length, vocab_size=byte_tokenizer.VOCAB_SIZE, dtype=args.dtype,
                            device=args.device, seed=args.seed, sliding_window=args.sliding_window)
        desc = f"{args.arch}-{args.model_size} (random init)"
    if tok.pad_token_id is None:  # many causal LMs have none; padding is never attended or scored
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.convert_ids_to_tokens(0)
    model.train()
    nparams = sum(p.numel() for p in model.parameters())
    args.model_desc = f"{desc}, {nparams / 1e6:.2f}M params, {args.dtype}"
    return model, tok


def prepare_model(model, args, par: Parallel, *, train: bool = True):
    """Activation checkpointing of every layer (``--gradient-checkpointing`` / ``--offload``, when
    ``train``); the MLPs in chunks (``--mlp-chunk``; also for a frozen model, whose forward without
    grad then holds one chunk's temporaries); with several processes the context-parallel attention
    backend (``fm_cp``) and FSDP2. Create the optimizer after this (it must see the sharded parameters)."""
    if train and (args.gradient_checkpointing or args.offload != "off"):
        from flashmask.checkpointing import enable_activation_checkpointing
        enable_activation_checkpointing(model, offload={"off": False, "on": True, "auto": "auto"}[args.offload])
    if args.mlp_chunk:
        from flashmask.checkpointing import chunk_mlp
        chunk_mlp(model, args.mlp_chunk)
    if par.distributed:
        import flashmask.distributed.hf as cp_hf
        from flashmask.distributed import fsdp as fm_fsdp
        cp_hf.use_context_parallel(model)
        fm_fsdp.apply_fsdp2(model, par.mesh)
    return model


def attention_options(model) -> list:
    """The attention options of ``model`` that the CUDA kernels do not take yet: ``"softcap"`` (Gemma 2's
    ``attn_logit_softcapping``) and ``"sinks"`` (GPT-OSS's per-head sinks)."""
    from flashmask import _cuda

    cfg = getattr(model, "config", None)
    found = []
    if getattr(cfg, "attn_logit_softcapping", None):
        found.append("softcap")
    if any(n.endswith("self_attn.sinks") for n, _ in model.named_parameters()):
        found.append("sinks")
    return [o for o in found if o not in _cuda.KERNEL_OPTIONS]


def backend_note(device: torch.device, dtype: torch.dtype, model=None) -> str:
    import flashmask

    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flashmask.cuda.available():
        options = attention_options(model) if model is not None else []
        if options:
            return f"flashmask reference path: the CUDA kernels do not take {' and '.join(options)} yet"
        return "flashmask CUDA kernels"
    return "flashmask reference path (pure PyTorch)"
