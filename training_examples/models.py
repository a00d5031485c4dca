"""The models of the examples: a randomly initialised Llama, Qwen2, Gemma 2, Gemma 3, GPT-OSS or DeepSeek-V3 preset
with the byte-level tokenizer (nothing downloaded), or a local Hugging Face causal LM directory (any
family the flashmask backend runs: Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3, GPT-OSS, DeepSeek-V3,
...; see the README's table); then activation checkpointing, chunked MLPs and, with several
processes, the context-parallel backend and FSDP2."""
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

# Gemma 3 text models. A layer attends globally when its number (from 1) is a multiple of
# ``global_every`` and through a causal sliding window of ``sliding_window`` tokens otherwise.
GEMMA3_SIZES = {
    # CPU tests: layer 0 slides, layer 1 attends globally
    "tiny": dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=1, head_dim=16, sliding_window=16,
                 global_every=2),
    # Gemma-3-1B shape: 22 sliding layers of 512 tokens, global attention on layers 6, 12, 18, 24
    "1b": dict(hidden=1152, intermediate=6912, layers=26, heads=4, kv_heads=1, head_dim=256, sliding_window=512,
               global_every=6),
}

# Gemma 2: head dim 256, grouped-query attention, logit soft-capping (50 on the attention scores, 30 on
# the final logits), a causal sliding window on every other layer (layers 1, 3, ... counting from 1).
GEMMA2_SIZES = {
    # CPU tests: layer 0 slides, layer 1 attends globally
    "tiny": dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, sliding_window=16,
                 attn_softcap=50.0, final_softcap=30.0),
    # Gemma-2-2B's widths and heads with 8 of its 26 layers (4 sliding, 4 global)
    "2b": dict(hidden=2304, intermediate=9216, layers=8, heads=8, kv_heads=4, head_dim=256, sliding_window=4096,
               attn_softcap=50.0, final_softcap=30.0),
}

# GPT-OSS: attention sinks (one learnable logit per query head), head dim 64, 8 query heads per
# key/value head, a 128-token sliding window on every other layer, YaRN RoPE, biased projections.
# Its mixture of experts is reduced to one expert, routed to by every token (top-1 of 1), run as a
# dense MLP of GPT-OSS's clamped SwiGLU (:func:`dense_single_expert`), so that neither routing, nor
# the experts' token gathers, nor the weights of 32 experts weigh on a comparison of attention backends.
GPT_OSS_SIZES = {
    # CPU tests: layer 0 slides, layer 1 attends globally
    "tiny": dict(hidden=64, intermediate=64, layers=2, heads=8, kv_heads=2, head_dim=16, sliding_window=16,
                 experts=1, experts_per_token=1),
    # GPT-OSS-20B's widths and heads with 8 of its 24 layers (4 sliding, 4 global)
    "20b": dict(hidden=2880, intermediate=2880, layers=8, heads=64, kv_heads=8, head_dim=64, sliding_window=128,
                experts=1, experts_per_token=1),
}

# DeepSeek-V3 attention (multi-head latent attention: queries through a rank-1536 projection, keys
# and values through a shared rank-512 latent; q/k head dim 128 + 64 RoPE = 192, v head dim 128)
# with fewer heads than the real model's 128, e.g. the 16 (or 32) heads one GPU holds with 8-way
# (4-way) tensor parallelism, and a hidden size to match. Every layer has a dense MLP (the real
# model's first 3 do), about 2.6 x hidden as in those layers (18432 / 7168), so that neither routing
# nor the experts' weights weigh on a comparison of attention backends.
DEEPSEEK_V3_SIZES = {
    # CPU tests: q/k head dim 16 + 8, v head dim 12
    "tiny": dict(hidden=64, intermediate=128, layers=2, heads=4, q_lora_rank=48, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12),
    "16h": dict(hidden=2048, intermediate=5376, layers=8, heads=16, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    "32h": dict(hidden=4096, intermediate=10752, layers=8, heads=32, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
}

# Llama 4 attention (Scout and Maverick: 40 query and 8 key/value heads of 128; three layers in four
# attend within chunks of 8192 tokens with RoPE, the fourth globally without RoPE), with a dense MLP
# on every layer in place of the mixture of experts: 16384 wide, the routed expert and the shared
# one (8192 each) that a Scout token goes through.
LLAMA4_SIZES = {
    # CPU tests: layers 0-2 chunked, layer 3 global
    "tiny": dict(hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, head_dim=16, chunk=16),
    "scout": dict(hidden=5120, intermediate=16384, layers=8, heads=40, kv_heads=8, head_dim=128, chunk=8192),
}

_LLAMA_FIELDS = ("hidden", "intermediate", "layers", "heads", "kv_heads")
ARCHS = ("llama", "qwen2", "gemma2", "gemma3", "gpt_oss", "deepseek_v3", "llama4")
#: The preset each arch builds when no size is named.
DEFAULT_SIZE = {"llama": "0.5b", "qwen2": "0.5b", "gemma2": "2b", "gemma3": "1b", "gpt_oss": "20b",
                "deepseek_v3": "16h", "llama4": "scout"}
#: The archs whose sliding window ``build_model(sliding_window=...)`` replaces (qwen2: adds one on every layer).
WINDOW_ARCHS = ("qwen2", "gemma2", "gemma3", "gpt_oss")


def arch_sizes(arch: str) -> dict:
    """The presets of ``arch``: name -> dict of its dimensions."""
    if arch in ("llama", "qwen2"):
        return {k: dict(zip(_LLAMA_FIELDS, v)) for k, v in MODEL_SIZES.items()}
    if arch == "gemma2":
        return GEMMA2_SIZES
    if arch == "gemma3":
        return GEMMA3_SIZES
    if arch == "gpt_oss":
        return GPT_OSS_SIZES
    if arch == "deepseek_v3":
        return DEEPSEEK_V3_SIZES
    if arch == "llama4":
        return LLAMA4_SIZES
    raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")


def gemma3_layer_types(layers: int, global_every: int) -> list:
    """Gemma 3's layer pattern: global attention on every ``global_every``-th layer, sliding elsewhere."""
    return ["full_attention" if (i + 1) % global_every == 0 else "sliding_attention" for i in range(layers)]


def alternating_layer_types(layers: int) -> list:
    """Gemma 2's and GPT-OSS's layer pattern: sliding on layers 1, 3, ... (from 1), global on 2, 4, ..."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def build_model(arch: str, size: str, *, attn_implementation: str, max_length: int, vocab_size: int,
                dtype: torch.dtype, device, seed: int = 0, sliding_window: Optional[int] = None,
                num_layers: Optional[int] = None):
    """A randomly initialised causal LM (transformers) of preset ``size`` of ``arch`` (see
    :func:`arch_sizes`), on ``device`` in ``dtype``.

    ``sliding_window``: qwen2: a window of that many tokens on every layer; gemma2, gemma3, gpt_oss:
    replaces the preset's window (its sliding layers stay the same). ``num_layers`` replaces the
    preset's depth (gemma3 keeps its pattern: with fewer than ``global_every`` layers every layer
    slides; gemma2 and gpt_oss alternate from a sliding layer).
    """
    import transformers

    sizes = arch_sizes(arch)
    if size not in sizes:
        raise ValueError(f"unknown model size {size!r} for arch {arch!r}; choose from {sorted(sizes)}")
    if num_layers is not None and int(num_layers) < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if sliding_window is not None:
        if arch not in WINDOW_ARCHS:
            raise ValueError(f"sliding_window={sliding_window}: only the {', '.join(WINDOW_ARCHS)} presets have "
                             f"sliding windows, got arch {arch!r}")
        if int(sliding_window) < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    dims = sizes[size]
    layers = int(num_layers) if num_layers is not None else dims["layers"]
    tokens = dict(vocab_size=vocab_size, max_position_embeddings=max(max_length, 2048), pad_token_id=byte_tokenizer.PAD,
                  bos_token_id=byte_tokenizer.BOS, eos_token_id=byte_tokenizer.EOS)
    if arch in ("llama", "qwen2"):
        common = dict(hidden_size=dims["hidden"], intermediate_size=dims["intermediate"], num_hidden_layers=layers,
                      num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
                      rope_theta=1_000_000.0, tie_word_embeddings=True, **tokens)
        if arch == "llama":
            cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
        else:
            extra = {}
            if sliding_window is not None:
                extra = dict(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0)
            cfg, cls = transformers.Qwen2Config(**common, **extra), transformers.Qwen2ForCausalLM
    elif arch == "gemma3":
        # RoPE bases of the release: 1M on the global layers, 10K on the sliding ones (the config's defaults).
        cfg = transformers.Gemma3TextConfig(
            hidden_size=dims["hidden"], intermediate_size=dims["intermediate"], num_hidden_layers=layers,
            num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"],
            query_pre_attn_scalar=dims["head_dim"], sliding_window=sliding_window or dims["sliding_window"],
            layer_types=gemma3_layer_types(layers, dims["global_every"]), attention_dropout=0.0,
            tie_word_embeddings=True, **tokens)
        cls = transformers.Gemma3ForCausalLM
    elif arch == "gemma2":
        cfg = transformers.Gemma2Config(
            hidden_size=dims["hidden"], intermediate_size=dims["intermediate"], num_hidden_layers=layers,
            num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"],
            query_pre_attn_scalar=dims["head_dim"], sliding_window=sliding_window or dims["sliding_window"],
            layer_types=alternating_layer_types(layers), attn_logit_softcapping=dims["attn_softcap"],
            final_logit_softcapping=dims["final_softcap"], attention_dropout=0.0, tie_word_embeddings=True,
            **tokens)
        cls = transformers.Gemma2ForCausalLM
    elif arch == "gpt_oss":
        # RoPE: the config's default, the release's YaRN (factor 32 over 4096 positions, base 150K), with
        # the release's 131072 positions, which that factor implies.
        tokens["max_position_embeddings"] = max(max_length, 131072)
        cfg = transformers.GptOssConfig(
            hidden_size=dims["hidden"], intermediate_size=dims["intermediate"], num_hidden_layers=layers,
            num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"],
            sliding_window=sliding_window or dims["sliding_window"], layer_types=alternating_layer_types(layers),
            num_local_experts=dims["experts"], num_experts_per_tok=dims["experts_per_token"], attention_dropout=0.0,
            tie_word_embeddings=False, **tokens)
        cls = transformers.GptOssForCausalLM
    elif arch == "llama4":
        # RoPE: the config's default base (500K), without the release's scaling; the NoPE layers'
        # attention temperature as released (from 8192 tokens on).
        cfg = transformers.Llama4TextConfig(
            hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
            intermediate_size_mlp=dims["intermediate"], num_hidden_layers=layers, num_attention_heads=dims["heads"],
            num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"], attention_chunk_size=dims["chunk"],
            no_rope_layers=[int((i + 1) % 4 != 0) for i in range(layers)], moe_layers=[], use_qk_norm=True,
            attention_dropout=0.0, tie_word_embeddings=False, **tokens)
        cls = transformers.Llama4ForCausalLM
    else:
        # Dense MLPs on every layer (first_k_dense_replace = layers); plain RoPE, not the release's YaRN.
        cfg = transformers.DeepseekV3Config(
            hidden_size=dims["hidden"], intermediate_size=dims["intermediate"], num_hidden_layers=layers,
            num_attention_heads=dims["heads"], num_key_value_heads=dims["heads"], q_lora_rank=dims["q_lora_rank"],
            kv_lora_rank=dims["kv_lora_rank"], qk_nope_head_dim=dims["qk_nope_head_dim"],
            qk_rope_head_dim=dims["qk_rope_head_dim"], v_head_dim=dims["v_head_dim"], first_k_dense_replace=layers,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, rope_theta=10_000.0,
            attention_dropout=0.0, tie_word_embeddings=False, **tokens)
        cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation=attn_implementation)
    if arch == "gpt_oss":
        dense_single_expert(model)
    return model.to(device=device, dtype=dtype)


def _single_expert_forward(self, hidden_states, router_indices=None, routing_weights=None):
    """GPT-OSS's experts with one expert: every token through it, weighted by its routing weight."""
    gate_up = hidden_states @ self.gate_up_proj[0] + self.gate_up_proj_bias[0]
    out = self._apply_gate(gate_up) @ self.down_proj[0] + self.down_proj_bias[0]
    return (out * routing_weights[:, :1]).to(hidden_states.dtype)


def dense_single_expert(model) -> None:
    """Run each one-expert GPT-OSS experts module of ``model`` as a dense MLP (in place).

    transformers' expert loop gathers each expert's tokens and adds its output back by index, whose
    backward (a sorted index accumulation) took about half of a GPT-OSS-shaped training step even
    with one expert. With one expert routed to by every token the gather is the identity: the dense
    forward computes the same values with the same parameters. Checked on a few tokens against the
    model's own forward (raises ``RuntimeError`` if they differ, e.g. in another transformers version).
    """
    import types

    for layer in model.model.layers:
        experts = layer.mlp.experts
        if experts.num_experts != 1:
            continue
        if experts.gate_up_proj.is_meta:  # no values to check
            experts.forward = types.MethodType(_single_expert_forward, experts)
            continue
        h = torch.randn(5, experts.hidden_size, generator=torch.Generator().manual_seed(0), device="cpu")
        h = h.to(experts.gate_up_proj.device, experts.gate_up_proj.dtype)
        weights = torch.ones(5, 1, dtype=h.dtype, device=h.device)
        with torch.no_grad():
            want = experts(h, torch.zeros(5, 1, dtype=torch.long, device=h.device), weights)
            experts.forward = types.MethodType(_single_expert_forward, experts)
            got = experts(h, None, weights)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise RuntimeError("the dense one-expert MLP differs from this transformers version's GPT-OSS experts")


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
    ``train``; ``--keep-attention`` keeps the attention outputs); the MLPs in chunks (``--mlp-chunk``;
    also for a frozen model, whose forward without grad then holds one chunk's temporaries); with
    several processes the context-parallel attention backend (``fm_cp``) and FSDP2. Create the
    optimizer after this (it must see the sharded parameters)."""
    if train and (args.gradient_checkpointing or args.offload != "off"):
        from flashmask.checkpointing import enable_activation_checkpointing
        enable_activation_checkpointing(model, offload={"off": False, "on": True, "auto": "auto"}[args.offload],
                                        keep_attention=args.keep_attention)
    if args.mlp_chunk:
        from flashmask.checkpointing import chunk_mlp
        chunk_mlp(model, args.mlp_chunk)
    if par.distributed:
        import flashmask.distributed.hf as cp_hf
        from flashmask.distributed import fsdp as fm_fsdp
        cp_hf.use_context_parallel(model)
        fm_fsdp.apply_fsdp2(model, par.mesh)
    return model


def backend_note(device: torch.device, dtype: torch.dtype) -> str:
    import flashmask

    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flashmask.cuda.available():
        return "flashmask CUDA kernels"
    return "flashmask reference path (pure PyTorch)"
