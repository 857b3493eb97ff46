"""Qwen-VL vision towers: CPU metadata builders and sync-free, fixed-shape device forwards."""

from models.config import ProcessorConfig, VisualInput
from models.loader import CheckpointError, load_tower
from models.protocol import Capacity, TowerOutput, VisionTower

__all__ = ["Capacity", "CheckpointError", "ProcessorConfig", "TowerOutput", "VisionTower", "VisualInput", "load_tower"]
