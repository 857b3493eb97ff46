"""ERNIE-4.5-VL (`ernie4_5_vl_moe`): a Qwen2-VL ViT over one frame per patch row, and a resampler beside it.

The tower: a bias-free Linear over each patch row (one frame: channels x 14 x 14), Qwen2-VL's blocks
(LayerNorm, one qkv projection, quick-GELU MLP) with its 2D rotary, attention within each frame, and a
LayerNorm after the blocks (`ln`). The resampler (`model.resampler_model.` in the checkpoints,
models.resamplers.TemporalPairResampler): an MLP over each 2x2 block, one over each pair of frames (an
image's one frame paired with itself), a Linear to the text width and an RMSNorm with the text model's eps.
A video of t frames (even: the processor repeats the last of an odd count; of an odd count the
reference drops the last) gives t//2 * h*w/4 tokens (models.geometries.TemporalPairGeometry). Images are
sized as Qwen2-VL's (`Ernie4_5_VLMoeImageProcessorPil`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from models.config import ProcessorConfig
from models.family import Family, register, standard_dims
from models.geometries import TemporalPairGeometry
from models.layers import make_norm
from models.patches import LinearPatches, PatchProjection
from models.protocol import Capacity, Geometry, Grid, TowerOutput
from models.resamplers import TemporalPairResampler, temporal_pair_metadata
from models.tower import QwenTower


class ErnieTower(QwenTower):
    """The shared blocks with a Linear patch embedding, the LayerNorm after the blocks and the resampler."""

    def __init__(self, family: Family, vision_config: Any, processor: ProcessorConfig, backend: str) -> None:
        super().__init__(family, vision_config, processor, backend)
        cfg, dims = vision_config, self.dims
        del self.merger  # the resampler takes its place
        p = processor
        linear = LinearPatches(p.in_channels, p.temporal_patch_size, p.patch_size, dims.hidden, "chw", p.patch_layout,
                               bias=False)
        self.patch_embed = PatchProjection(linear)
        self.ln = make_norm(family.norm, dims.hidden, cfg.rms_norm_eps)
        self.resampler_model = TemporalPairResampler(dims.hidden, self.merge_unit, dims.out, cfg.rms_norm_eps,
                                                     cfg.text_rms_norm_eps)

    def make_geometry(self) -> Geometry:
        return TemporalPairGeometry(self.merge)

    def required_capacity(self, grids: Sequence[Grid], modality: str = "image") -> Capacity:
        if modality == "video" and any(t < 2 for t, _, _ in grids):  # output rows are bounded by half the blocks
            raise ValueError(f"{self.family} videos have at least two frames; got grids {list(grids)}")
        return super().required_capacity(grids, modality)

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        meta = super().build_metadata(grids, cap)
        meta.update(temporal_pair_metadata(grids, cap, self.merge_unit, self.geometry.output_rows(cap)))
        return meta

    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        x = self.patch_embed(self.normalize(pixels))
        x, _ = self.run_blocks(x, meta, cap)
        return TowerOutput(self.resampler_model(self.ln(x), meta), [])


def reference_features(model: Any, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """transformers' features for packed pixels (the benchmarks' and GPU tests' reference): its vision model,
    then its resampler, without `get_image_features`' per-item split (which counts an image's rows only)."""
    inner = model.model
    return inner.resampler_model(inner.vision_tower(pixels, grid_thw).last_hidden_state, grid_thw)


ERNIE4_5_VL_MOE = register(Family(
    "ernie4_5_vl_moe", "ERNIE-4.5-VL", dims=standard_dims,
    # the released checkpoints keep the vision model at the top level, transformers' save_pretrained under model.
    # The resampler sits beside the vision model (`model.resampler_model.`).
    prefixes=("vision_model.", "model.vision_model.", ("model.resampler_model.", "resampler_model.")),
    vision_extras={
        "temporal_patch_size": lambda config: 1,  # a patch row is one frame
        "out_hidden_size": lambda config: config.text_config.hidden_size,
        "text_rms_norm_eps": lambda config: config.text_config.rms_norm_eps,
    },
    # Ernie4_5_VLMoeVideoProcessor's own settings: no frame rate (every frame, 16 to 180), frames sized alone
    # between `size`'s bounds, each frame's time drawn on it in the font that ships with the checkpoint.
    processor_defaults={"image": {"temporal_patch_size": 1, "patch_size": 14, "merge_size": 2},
                        "video": {"fps": 0, "min_frames": 16, "max_frames": 180, "draw_on_frames": True,
                                  "font": "Roboto-Regular.ttf",
                                  "size": {"shortest_edge": 299 * 28 * 28, "longest_edge": 1196 * 28 * 28}}},
    image_processor="Ernie4_5_VLMoeImageProcessor", hf_class="Ernie4_5_VLMoeForConditionalGeneration",
    video_sampling="ernie", video_resize="torch", tower=ErnieTower, vllm_embedding_parts=False,
    extra={"reference_features": reference_features},
))
