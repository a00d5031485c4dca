"""Random eviction mask: causal attention where every key is evicted at a random later row.

Simulates KV-cache eviction during training: key j is visible from its own row j up to a
random row ``e[j] - 1`` and evicted afterwards, ``e[j]`` uniform in ``(j, S]`` (``e[j] = S``:
never evicted). Definition: i attends j iff ``j <= i < e[j]``. Causal, C=1: LTS = e.

::

    S = 6, seed = 0      LTS = [6, 5, 4, 6, 6, 6]
    #.....
    ##....
    ###...
    ####..       key 2 is evicted from row 4 on,
    ##.##.       key 1 from row 5 on
    #..###

The draws come from ``torch.rand`` on the CPU with the given ``seed`` (or ``generator``), so
the same seed gives the same mask on every device, and ``random_eviction_mask_mod`` with the
same seed describes the same mask.

Example::

    >>> m = random_eviction(6, seed=0)
    >>> bool(((m[0, 0, :, 0] > torch.arange(6)) & (m[0, 0, :, 0] <= 6)).all())
    True
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _spec

CAUSAL = True


def eviction_rows(seqlen: int, *, batch_size: int = 1, seed: Optional[int] = None,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The random eviction row ``e[b, j]`` in ``(j, seqlen]`` of every key, int64 ``[B, S]`` (CPU)."""
    s = _spec.check_seqlen(seqlen)
    bsz = _spec.check_batch_size(batch_size)
    if seed is not None and generator is not None:
        raise ValueError("give either seed or generator, not both")
    if seed is not None:
        if not _spec.is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        generator = torch.Generator().manual_seed(int(seed))
    j = torch.arange(s)
    u = torch.rand(bsz, s, generator=generator, dtype=torch.float64)  # fp64: exact for any S < 2**52
    # (S - j) choices j+1 .. S, equally likely; the clamp guards against u rounding up to 1.
    return torch.minimum(j + 1 + (u * (s - j)).long(), torch.tensor(s))


def random_eviction(seqlen: int, *, batch_size: int = 1, seed: Optional[int] = None,
                    generator: Optional[torch.Generator] = None, device=None, validate: bool = True) -> torch.Tensor:
    """int32 ``[batch_size, 1, seqlen, 1]`` with LTS[j] drawn uniformly from ``(j, seqlen]``."""
    e = eviction_rows(seqlen, batch_size=batch_size, seed=seed, generator=generator)
    return _spec.finish([e.to(device)], CAUSAL, int(seqlen), validate)


def random_eviction_mask_mod(seqlen: int, *, batch_size: int = 1, seed: Optional[int] = None,
                             generator: Optional[torch.Generator] = None, device=None):
    """Predicate: ``kv_idx <= q_idx < e[b, kv_idx]`` (pass the builder's ``seed`` to match it)."""
    e = eviction_rows(seqlen, batch_size=batch_size, seed=seed, generator=generator).to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < e[b, kv_idx])

    return mask_mod
