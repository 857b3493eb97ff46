"""A model family as data: which parts its vision tower has, what the checkpoint calls them, where its
config and tensors live, and which preprocessing and hand-off rules it follows.

A family module (models/families/) is one `Family(...)`, usually a `derive` of a relative that names
what differs; `models/tower.py` builds any of them from the shared layers. A family whose tower
needs a part none of the others has gives its own `tower` subclass that adds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal


@dataclass(frozen=True)
class Dims:
    """The sizes a tower is built with, read from its vision config."""

    hidden: int  # residual width
    heads: int
    kv_heads: int  # == heads unless the attention groups its keys and values
    mlp: int  # MLP intermediate width
    depth: int  # blocks
    out: int  # merged-token width (the LLM's hidden size)


def standard_dims(cfg: Any) -> Dims:
    """Qwen2.5-VL and later: hidden_size, intermediate_size, out_hidden_size."""
    heads = cfg.num_heads
    return Dims(hidden=cfg.hidden_size, heads=heads, kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                mlp=cfg.intermediate_size, depth=cfg.depth, out=cfg.out_hidden_size)


@dataclass(frozen=True)
class Family:
    """One model family. Every field but `model_type` and `title` has the common Qwen-VL default."""

    model_type: str  # the `model_type` of the whole model's config.json
    title: str  # in logs and the README: "Qwen2.5-VL"
    # Other `model_type`s a release's config.json carries for this family, which transformers' registry does not
    # know (its own config class reads them): HyperCLOVAX-SEED's says "vlm".
    config_model_types: tuple[str, ...] = ()
    # Where things are: the vision config's path inside the model config, and the prefixes of the vision
    # tensors in the checkpoints (releases and transformers' save_pretrained; tried in order, only these
    # tensors are read).
    # An empty path hands the tower the whole model's config (a projector outside the vision model reads its
    # sizes there). A prefix may be a pair (checkpoint prefix, the tower's prefix for it), the tower's prefix
    # None to leave those tensors unread (heads a release carries that the served path never runs).
    config_path: tuple[str, ...] = ("vision_config",)
    prefixes: tuple[str | tuple[str, str | None], ...] = ("model.visual.", "visual.")
    # Parts of tensor names to replace, (checkpoint's, tower's), after the prefix: where transformers renames
    # tensors as it loads and writes the reverse names with save_pretrained.
    renames: tuple[tuple[str, str], ...] = ()
    dims: Callable[[Any], Dims] = standard_dims
    # The tower's parts.
    norm: Literal["layer", "rms"] = "layer"  # every norm of the tower
    patch_bias: bool = False  # the patch embedding's Conv3d has a bias
    separate_qkv: bool = False  # `attn.q`, `attn.k`, `attn.v` rather than one `attn.qkv`
    mlp: Literal["plain", "gated"] = "plain"  # fc2(act(fc1(x))) or down(act(gate(x)) * up(x))
    mlp_names: tuple[str, str] = ("fc1", "fc2")  # a plain MLP's two projections
    norm_eps: float = 1e-6  # the blocks' norms
    qkv_bias: bool = True  # biases of the attention's input projection(s), its output one, the MLP's
    proj_bias: bool = True
    mlp_bias: bool = True
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotary (`attn.q_norm`, `attn.k_norm`)
    windows: bool = False  # window attention (`window_size`, `fullatt_block_indexes` in the config)
    learned_positions: bool = False  # a `pos_embed` table resampled bilinearly to each grid
    merger: Literal["mlp", "linear_fc"] = "mlp"  # parameter layout of the mergers (models.layers.Merger)
    deepstack: str | None = None  # attribute holding the DeepStack mergers; None: no DeepStack
    # Preprocessing and hand-off.
    # How images are sized: Qwen2VLImageProcessor's smart_resize (bounds on H*W), Glm4vImageProcessor's
    # (an image is a clip of temporal_patch_size frames: bounds on T*H*W), Glm5NextImageProcessor's (the same
    # bounds, sides rounded up, the content shrunk into that canvas and zero-padded) or the family's own.
    # Videos: qwen-vl-utils' rules, Qwen3VLVideoProcessor's, GLM's video processors' or the family's own
    # (service/media/rules.py, service/media/video_sampling.py).
    image_sizing: Literal["qwen2", "glm4v", "glm5", "paddleocr_vl", "kimi", "muse"] = "qwen2"
    video_sampling: Literal["qwen2", "qwen3", "glm4v", "glm46v", "glmga", "glm5", "kimi", "muse", "minimax", "ernie",
                            "hy_v4_vl", "video_llama_3"] = "qwen2"
    video: bool = True  # the model takes videos
    video_timestamps: bool = False  # vLLM wants `timestamps` with video embeddings
    # The seconds each temporal grid step spans, in vLLM 0.33's M-RoPE for video embeddings: its parser takes
    # `second_per_grid_ts` with them (`video_second_per_grid`: the Omni thinkers); without the field, or
    # where the parser drops it (Qwen2.5-VL), the position code assumes `vllm_video_seconds`. None: vLLM's
    # positions for the family take no time from the part.
    video_second_per_grid: bool = False
    vllm_video_seconds: float | None = None
    # transformers' image processor class whose output the server reproduces (the reference in tests)
    image_processor: str = "Qwen2VLImageProcessor"
    # How that processor lays out pixel rows (models/config.py ProcessorConfig.patch_layout / patch_order): an
    # item's rows in "block" order (each merge block's patches contiguous, Qwen-VL's) or "raster" (row by row,
    # however the tower merges: PaddleOCR-VL, HunyuanOCR, Hy4).
    patch_layout: Literal["chw", "hwc"] = "chw"
    patch_order: Literal["block", "raster"] = "block"
    # The defaults the family's processor classes hold where they differ from Qwen2-VL's, for the keys a
    # checkpoint's processor configs leave out: {"image": {...}, "video": {...}} (the image processor's and the
    # video processor's, e.g. VideoLLaMA3's images are not merged; ProcessorConfig.from_dicts puts them under
    # what a config says).
    processor_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    # vLLM's processor for the family takes `image_embeds` / `video_embeds` parts. vLLM 0.33's GLM-4.1V takes
    # none (nor does HyperCLOVAX's), so its hand-off part keeps the media and names the cached encoder output by
    # uuid.
    vllm_embedding_parts: bool = True
    # The media vLLM 0.33 takes for the family as vitserve encodes them: none where vLLM does not serve the
    # family, images alone where its videos take a path of their own; the others' parts carry a warning.
    vllm_media: tuple[str, ...] = ("image", "video")
    # transformers' class of the whole model (what save_pretrained writes; the reference in tests and bench)
    hf_class: str = ""
    # The tower class; a family with parts of its own gives a subclass of models.tower.QwenTower.
    tower: Any = None
    extra: dict[str, Any] = field(default_factory=dict)  # what a family's own tower class reads
    # What the tower reads from the whole model's config beyond its vision config (the text width of a
    # projector, a setting the vision config leaves implicit): attribute name -> function of the whole config.
    vision_extras: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    # How images are resized: "pil" (PIL bicubic on uint8, as the *ImageProcessorPil classes) or "torch"
    # (torchvision's bicubic with antialias on uint8 tensors, as the processors that exist only with torchvision).
    image_resize: Literal["pil", "torch"] = "pil"
    # The same for video frames: transformers' video processors all resize with torchvision; "pil" is the
    # Qwen-VL families' close approximation (docs/video.md), "torch" that exact kernel.
    video_resize: Literal["pil", "torch"] = "pil"

    def derive(self, **changes: Any) -> Family:
        """This family with `changes`: how a relative is described."""
        return replace(self, **changes)

    def vision_config(self, config: Any) -> Any:
        """The vision config inside a whole model's config (nested: `thinker_config.vision_config`)."""
        whole = config
        for name in self.config_path:
            config = getattr(config, name)
        if self.vision_extras:
            config = ConfigView(config, **{name: read(whole) for name, read in self.vision_extras.items()})
        return config


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.model_type in FAMILIES:
        raise ValueError(f"model_type {family.model_type!r} is registered twice")
    FAMILIES[family.model_type] = family
    return family


class ConfigView:
    """A config read with some attributes given or renamed: `ConfigView(vision, in_channels=3)` answers
    `in_channels` with 3 and everything else from `vision`. For a family whose vision config names a value
    otherwise than the shared tower reads it, or keeps it elsewhere in the model's config."""

    def __init__(self, config: Any, **values: Any) -> None:
        self._config, self._values = config, values

    def __getattr__(self, name: str) -> Any:
        values, config = self.__dict__.get("_values"), self.__dict__.get("_config")
        if values is None:  # not initialised (a copy being made)
            raise AttributeError(name)
        return values[name] if name in values else getattr(config, name)
