"""Qwen-VL vision towers: CPU metadata builders and sync-free, fixed-shape device forwards.

The package's names are loaded on first use: `models.presets` and `models.config` (read by the CLI and
the settings) then import no torch, and `vitserve --help` answers at once."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"ProcessorConfig": "models.config", "VisualInput": "models.config", "CheckpointError": "models.loader",
            "load_tower": "models.loader", "Capacity": "models.protocol", "TowerOutput": "models.protocol",
            "VisionTower": "models.protocol"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
