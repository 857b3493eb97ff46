"""The scope of one tower forward, for what attention backends derive from a forward's boundaries.

A tower's blocks all attend over the same `cu_seqlens` tensors, so what a backend computes from them (cuDNN's
per-segment lengths and ragged offsets, models/attention_cudnn.py) is needed once per forward, not once per
block. `TowerBase.__call__` opens the scope; a backend keeps a `PerForward` beside the buffers it fills.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_forward = threading.local()


@contextmanager
def one_forward() -> Iterator[None]:
    """One tower forward: within it, what a backend derives from a `cu_seqlens` tensor (cuDNN's lengths
    and offsets) is computed at its first call and reused by the next blocks', not once per block. A
    forward captured in a CUDA graph captures that first computation, so every replay redoes it."""
    outer = getattr(_forward, "token", None)
    _forward.token = object()
    try:
        yield
    finally:
        _forward.token = outer


class PerForward:
    """Remembers which `cu_seqlens` tensor a backend's derived buffers were last filled from within the
    current `one_forward`. Within one forward the boundaries never change in place; outside one, nothing
    is remembered."""

    def __init__(self) -> None:
        self._held: tuple[object, weakref.ref] | None = None

    def filled(self, cu_seqlens: torch.Tensor) -> bool:
        """Whether the buffers already hold what `cu_seqlens` gives, in this forward."""
        token = getattr(_forward, "token", None)
        held = self._held
        return token is not None and held is not None and held[0] is token and held[1]() is cu_seqlens

    def fill(self, cu_seqlens: torch.Tensor) -> None:
        """Record that the buffers were just filled from `cu_seqlens`."""
        token = getattr(_forward, "token", None)
        self._held = None if token is None else (token, weakref.ref(cu_seqlens))
