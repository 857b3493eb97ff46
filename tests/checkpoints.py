"""Small real checkpoints written by transformers, for parity and loader tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.presets import PRESETS, full_config

CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}


def reference_model(preset_name: str, seed: int = 0):
    """transformers' full model for a tiny preset, fp32, seeded random weights, sdpa attention."""
    import transformers

    preset = PRESETS[preset_name]
    cfg = full_config(preset)
    torch.manual_seed(seed)
    cls = getattr(transformers, CLASSES[preset.family])
    model = cls._from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    # Non-trivial norms and biases, so a wrong wiring cannot hide behind ones and zeros.
    with torch.no_grad():
        for p in model.model.visual.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def write_checkpoint(preset_name: str, folder: Path, seed: int = 0, max_shard_size: str | None = None):
    """save_pretrained of the ForConditionalGeneration class plus its preprocessor config."""
    model = reference_model(preset_name, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    preset = PRESETS[preset_name]
    (folder / "preprocessor_config.json").write_text(json.dumps(preset.preprocessor))
    if preset.video_preprocessor:
        (folder / "video_preprocessor_config.json").write_text(json.dumps(preset.video_preprocessor))
    return model
