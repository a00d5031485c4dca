"""``nn.Module`` wrappers: the attention core and a multi-head self-attention block."""
from __future__ import annotations

import numbers
from typing import Optional, Tuple, Union

import torch
from torch import nn

from flashmask import _checks
from flashmask.attention import flashmask_attention

LAYOUTS = ("bshd", "bhsd")


class FlashMaskAttention(nn.Module):
    """The attention core as a module: ``out = FlashMaskAttention(...)(q, k, v, startend_row_indices)``.

    ``layout="bshd"`` takes q ``[B, Sq, Hq, Dqk]``, k ``[B, Sk, Hk, Dqk]`` and v ``[B, Sk, Hk, Dv]``
    and returns ``[B, Sq, Hq, Dv]``; ``layout="bhsd"`` takes ``[B, H, S, D]`` tensors (passed to the
    kernels as transposed views, no copy) and returns the output in the same layout. ``Dv`` may
    differ from ``Dqk`` (MLA); ``softmax_scale`` defaults to ``1 / sqrt(Dqk)``.

    ``softcap``: logit soft-capping (Gemma 2), as :func:`flashmask.flashmask_attention`.
    ``sinks``: attention sinks (GPT-OSS): ``True`` makes a learnable parameter ``self.sinks`` of
    ``[num_heads]`` zeros (``num_heads`` = the query heads Hq, then required); a tensor ``[Hq]``
    gives its initial values; ``None`` / ``False``: none.
    """

    def __init__(self, causal: bool = False, softmax_scale: Optional[float] = None,
                 window_size: Optional[Tuple[int, int]] = None, layout: str = "bshd",
                 deterministic: bool = False, backend: str = "auto", softcap: float = 0.0,
                 sinks: Union[None, bool, torch.Tensor] = None, num_heads: Optional[int] = None):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if not isinstance(causal, bool):  # fail at construction, not at the first forward
            raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
        self.causal, self.softmax_scale, self.window_size = causal, softmax_scale, window_size
        self.layout, self.deterministic, self.backend = layout, deterministic, backend
        self.softcap = _checks.softcap_value(softcap)
        self.sinks = _sinks_parameter(sinks, num_heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                startend_row_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        bhsd = self.layout == "bhsd"
        if bhsd:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = flashmask_attention(q, k, v, startend_row_indices, causal=self.causal,
                                  softmax_scale=self.softmax_scale, window_size=self.window_size,
                                  deterministic=self.deterministic, backend=self.backend, softcap=self.softcap,
                                  sinks=self.sinks)
        return out.transpose(1, 2) if bhsd else out

    def extra_repr(self) -> str:
        extra = (f", softcap={self.softcap}" if self.softcap else "") + (
            f", sinks=[{self.sinks.shape[0]}]" if self.sinks is not None else "")
        return (f"causal={self.causal}, layout={self.layout!r}, window_size={self.window_size}, "
                f"backend={self.backend!r}{extra}")


def _sinks_parameter(sinks, num_heads: Optional[int]) -> Optional[nn.Parameter]:
    """The module's sinks parameter for its ``sinks=`` argument (see :class:`FlashMaskAttention`)."""
    if sinks is None or sinks is False:
        return None
    if sinks is True:
        if isinstance(num_heads, bool) or not isinstance(num_heads, numbers.Integral) or num_heads < 1:
            raise ValueError(f"sinks=True needs num_heads, the number of query heads (a positive int), got "
                             f"{num_heads!r}")
        return nn.Parameter(torch.zeros(int(num_heads)))
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.dim() != 1:
        raise TypeError(f"sinks must be None, a bool or a floating-point tensor [num_heads], got "
                        f"{type(sinks).__name__}{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else ''}")
    if num_heads is not None and sinks.shape[0] != num_heads:
        raise ValueError(f"sinks has {sinks.shape[0]} values but num_heads is {num_heads}")
    return sinks if isinstance(sinks, nn.Parameter) else nn.Parameter(sinks.detach().clone())


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the "rotate half" form used by Llama) from explicit position ids,
    so that packed documents restart their positions."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head dim, got {head_dim}")
        # No float buffer: model.to(bfloat16) would round the frequencies (large angle errors at
        # long positions). They are recomputed in float64 on each call instead.
        self.head_dim, self.base = head_dim, base

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x ``[B, S, H, D]``, position_ids ``[B, S]``."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=x.device) / self.head_dim
        inv_freq = 1.0 / (self.base ** exponents)
        angles = position_ids.to(torch.float64).unsqueeze(-1) * inv_freq  # [B, S, D/2]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(2)  # [B, S, 1, D]
        dt = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dt)
        return (xf * angles.cos().to(dt) + rotate_half(xf) * angles.sin().to(dt)).to(x.dtype)


class FlashMaskSelfAttention(nn.Module):
    """Multi-head self-attention (q/k/v/o projections, GQA, optional rotary) under a FlashMask mask.

    ``forward(x [B, S, E], startend_row_indices=None, position_ids=None) -> [B, S, E]``.
    ``position_ids`` (default ``arange(S)``) drive the rotary embedding; for packed documents pass
    positions that restart at each document (see :func:`masks.from_position_ids`). ``head_dim``
    (default ``E / num_heads``) is the query/key head dim, ``head_dim_v`` (default ``head_dim``)
    the value head dim: v_proj gives ``num_kv_heads * head_dim_v`` features and o_proj takes
    ``num_heads * head_dim_v``. ``softcap`` (Gemma 2) and ``sinks=True`` (GPT-OSS: a learnable
    ``attn.sinks`` of ``[num_heads]`` zeros) as :class:`FlashMaskAttention`.

    Example::

        >>> import masks
        >>> attn = FlashMaskSelfAttention(hidden_size=64, num_heads=4, num_kv_heads=2, rotary=True)
        >>> x = torch.randn(2, 12, 64)
        >>> attn(x, masks.causal_document(12, [[5, 7], [12]])).shape
        torch.Size([2, 12, 64])
        >>> mla = FlashMaskSelfAttention(hidden_size=64, num_heads=4, head_dim=24, head_dim_v=16)
        >>> mla(x).shape
        torch.Size([2, 12, 64])
        >>> gpt_oss_like = FlashMaskSelfAttention(hidden_size=64, num_heads=4, sinks=True, window_size=(7, 0))
        >>> gpt_oss_like.attn.sinks.shape
        torch.Size([4])
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, bias: bool = False, causal: bool = True,
                 rotary: bool = True, rope_base: float = 10000.0, window_size: Optional[Tuple[int, int]] = None,
                 backend: str = "auto", head_dim_v: Optional[int] = None, softcap: float = 0.0,
                 sinks: Union[None, bool, torch.Tensor] = None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads}) "
                                 "unless head_dim is given")
            head_dim = hidden_size // num_heads
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        for name, value in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.head_dim_v = head_dim_v
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim_v, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim_v, hidden_size, bias=bias)
        self.rotary = RotaryEmbedding(head_dim, rope_base) if rotary else None
        self.attn = FlashMaskAttention(causal=causal, window_size=window_size, backend=backend, softcap=softcap,
                                       sinks=sinks, num_heads=num_heads)

    def forward(self, x: torch.Tensor, startend_row_indices: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"x must be [B, S, hidden_size], got shape {tuple(x.shape)}")
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim_v)
        if position_ids is not None and position_ids.shape != (b, s):
            raise ValueError(f"position_ids must be [B, S] = {(b, s)}, got {tuple(position_ids.shape)}")
        if self.rotary is not None:
            if position_ids is None:
                position_ids = torch.arange(s, device=x.device).expand(b, s)
            q, k = self.rotary(q, position_ids), self.rotary(k, position_ids)
        out = self.attn(q, k, v, startend_row_indices)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim_v))
