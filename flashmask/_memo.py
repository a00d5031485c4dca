"""A few masks kept by what they were built from, so that the layers of a step pass the kernels the
same mask tensor, whose metadata the binding then computes once (``flashmask.cuda.mask_cache_stats``)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Optional

import torch


def tensor_key(t: torch.Tensor) -> Optional[tuple]:
    """What names ``t``'s current contents: its memory, layout and version counter; None where that
    is not stable (an inference tensor has no version counter, a meta tensor no memory)."""
    if t.is_inference() or t.device.type == "meta":
        return None
    return (t.data_ptr(), t._version, t.device, t.dtype, tuple(t.shape), t.stride())


class Recent:
    """The ``size`` most recently used values by key. Keep the tensors a key names inside the value,
    so that their memory (and so their ``data_ptr``) cannot go to other tensors while the key names
    it; or weak references to them, checked with ``valid``, where holding them would cost memory."""

    def __init__(self, size: int):
        self.size = size
        self._values: "OrderedDict[Hashable, object]" = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], object], valid: Optional[Callable[[object], bool]] = None):
        """The value kept under ``key`` (if ``valid(value)``, when given), else ``build()`` kept under it
        (the least recently used goes)."""
        if key in self._values and (valid is None or valid(self._values[key])):
            self._values.move_to_end(key)
            return self._values[key]
        value = build()
        self._values[key] = value
        while len(self._values) > self.size:
            self._values.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._values)

    def clear(self) -> None:
        self._values.clear()
