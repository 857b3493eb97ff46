"""Build a tower from a local Hugging Face checkpoint folder or a built-in preset.

The checkpoint's `model_type` picks the family (models/families/), which says where the vision config
sits in config.json and which key prefixes hold the vision tensors (e.g. `visual.*` in Qwen2-VL and
Qwen2.5-VL releases, `model.visual.*` in later ones and in transformers 5 `save_pretrained`,
`thinker.visual.*` in the Omni models, flat `blocks.*` / `merger.*` in Cosmos3-Omni's, a projection beside
the vision model in HyperCLOVAX's, each renamed to the tower's names: `Family.prefixes`). Only those tensors
are read, lazily through `safe_open`, from one file or from the shards a `model.safetensors.index.json` names.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.attention import backend_problem, check_backend_name, resolve_backend
from models.blas import batch_invariant_products
from models.config import ProcessorConfig
from models.families import FAMILIES, Family
from models.kernels import enable_triton
from models.presets import PRESETS, Preset
from models.quantization import dequantize_checkpoint, fp8_scale_names
from models.tower import QwenTower

log = logging.getLogger("vitserve.models")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be served, with every reason found."""


def resolve_device(device: str) -> torch.device:
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if dev.type == "cuda" and dev.index is None:  # name the device: set_device and streams need an index
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}") from None


def build_tower(family: str, vision_config: Any, processor: ProcessorConfig, backend: str) -> QwenTower:
    """An uninitialised tower on the meta device (no memory), ready for `to_empty`."""
    spec = family_of(family)
    with torch.device("meta"):
        return (spec.tower or QwenTower)(spec, vision_config, processor, backend)


def family_of(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise CheckpointError(f"unsupported model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def load_tower(
    model: str, device: str = "auto", dtype: str = "auto", attention: str = "auto", seed: int = 0,
    batch_invariant: bool = True,
) -> QwenTower:
    """`model`: a checkpoint folder or a preset name (see models/presets.py). `attention`: a
    backend of models/attention.py, chosen once the tower's head shape is known. `batch_invariant`:
    matrix products whose rows do not depend on the batch (models/blas.py)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    check_backend_name(attention, dev)  # a bad name fails before any weight is read
    batch_invariant_products(dev, batch_invariant)  # before any graph is captured
    enable_triton(dev)
    interim = "varlen" if dev.type == "cuda" else "sdpa"
    if model in PRESETS:
        tower = _random_tower(model, PRESETS[model], dev, dt, interim, seed)
    else:
        tower = _checkpoint_tower(Path(model), dev, dt, interim)
    tower.set_attention(resolve_backend(attention, dev, dt, tower.heads, tower.head_dim))
    tower.name = model
    return tower.eval().requires_grad_(False)


def preset_tower(preset: Preset, backend: str) -> QwenTower:
    """A preset's tower on the meta device."""
    from models.presets import full_config

    processor = family_processor_config(preset.family, preset.preprocessor, preset.video_preprocessor)
    return build_tower(preset.family, family_of(preset.family).vision_config(full_config(preset)), processor, backend)


def _random_tower(name: str, preset: Preset, dev: torch.device, dt: torch.dtype, backend: str, seed: int):
    tower = preset_tower(preset, backend)
    tower.to_empty(device=dev)
    init_random(tower, seed)
    tower.to(dt)
    tower.reset_buffers()
    log.warning("model %s has RANDOM weights (seed %d): its embeddings are meaningless", name, seed)
    return tower


@torch.no_grad()
def init_random(module: nn.Module, seed: int) -> None:
    """Seeded weights on the CPU (identical on every device), then copied in place."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            value = torch.randn(p.shape, generator=gen) * 0.02
        elif p.dim() == 1:  # norm scales
            value = 1 + torch.randn(p.shape, generator=gen) * 0.02
        else:
            value = torch.randn(p.shape, generator=gen) * 0.02
        p.copy_(value)


def _read_checkpoint_config(folder: Path) -> tuple[str, Any, ProcessorConfig]:
    """(family, vision config, processor) of a checkpoint folder, or CheckpointError saying what is wrong."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a preset name ({', '.join(PRESETS)}) nor a folder")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: not a preset name ({', '.join(PRESETS)}) nor a folder with config.json")
    from transformers import AutoConfig  # seconds to import: only for a folder

    try:
        named = _family_named_otherwise(folder)
        if named is not None:  # a model_type transformers' registry does not know: the family's own config class
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            cfg = CONFIG_MAPPING[named.model_type].from_pretrained(str(folder), local_files_only=True)
        else:
            cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable, not JSON, unknown model_type
        raise CheckpointError(f"{folder}/config.json cannot be read: {_one_line(exc)}") from None
    family = cfg.model_type
    if family not in FAMILIES:
        raise CheckpointError(f"{folder}: unsupported model_type {family!r}; supported: {', '.join(FAMILIES)}")
    try:
        vision_config = FAMILIES[family].vision_config(cfg)
    except AttributeError as exc:
        raise CheckpointError(f"{folder}/config.json has no vision config: {_one_line(exc)}") from None
    if not any((folder / name).is_file() for name in ("preprocessor_config.json", "processor_config.json")):
        raise CheckpointError(f"{folder}: preprocessor_config.json is missing (nor is there a processor_config.json)")
    try:
        processor = processor_config_from_folder(folder, family)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{folder}: a preprocessor config cannot be read: {_one_line(exc)}") from None
    font = processor.video.timestamp_font
    if font and not Path(font).is_file():  # as transformers, which cannot load such a video processor
        raise CheckpointError(f"{folder}: the video processor draws timestamps with the font {Path(font).name!r}, "
                              "which is not in the folder")
    return family, vision_config, processor


def _family_named_otherwise(folder: Path) -> Family | None:
    """The family whose releases' config.json names it by another model_type (Family.config_model_types), if
    this one does; JSON errors are left to transformers' reading, which reports them."""
    try:
        named = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return next((f for f in FAMILIES.values() if named in f.config_model_types), None)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _checkpoint_tower(folder: Path, dev: torch.device, dt: torch.dtype, backend: str) -> QwenTower:
    family, vision_config, processor = _read_checkpoint_config(folder)
    tower = build_tower(family, vision_config, processor, backend)
    tensors = read_vision_tensors(folder, FAMILIES[family].prefixes, FAMILIES[family].renames)
    try:  # an FP8 checkpoint's weights times their scales
        tensors = dequantize_checkpoint(tensors, dt, weight_block_size(folder))
    except ValueError as exc:
        raise CheckpointError(f"{folder}: {exc}") from None
    tower.to_empty(device=dev).to(dt)
    load_state(tower, tensors, folder)  # copies, converting to the serving dtype
    tower.reset_buffers()
    log.info("loaded %s vision tower from %s (%d tensors)", family, folder, len(tensors))
    return tower


def check_model(model: str) -> str:
    """What loading `model` would refuse, found without reading a weight: a preset name, or a folder
    with a readable config.json of a supported family, its preprocessor config, and safetensors whose
    vision tensors have exactly the names and shapes that config needs (read from the files' headers).
    Returns the family; raises CheckpointError."""
    if model in PRESETS:
        return PRESETS[model].family
    folder = Path(model)
    family, vision_config, processor = _read_checkpoint_config(folder)
    tower = build_tower(family, vision_config, processor, "sdpa")  # on the meta device: shapes only
    try:
        shapes = vision_tensor_shapes(folder, FAMILIES[family].prefixes, FAMILIES[family].renames)
    except (OSError, ValueError) as exc:  # safetensors' own errors are both
        raise CheckpointError(f"{folder}: the safetensors cannot be read: {_one_line(exc)}") from None
    scales = fp8_scale_names(shapes)  # an FP8 checkpoint's, read with their weights
    shapes = {k: v for k, v in shapes.items() if k not in scales}
    problems = weight_problems({k: tuple(v.shape) for k, v in tower.state_dict().items()}, shapes)
    if problems:
        raise CheckpointError(f"{folder}: vision weights do not match the config ({' | '.join(problems)})")
    return family


def weight_block_size(folder: Path) -> tuple[int, int] | None:
    """config.json's quantization_config.weight_block_size (fine-grained FP8 checkpoints), if it has one."""
    block = ((_read_json(folder / "config.json") or {}).get("quantization_config") or {}).get("weight_block_size")
    return (int(block[0]), int(block[1])) if block else None


def check_attention(model: str, device: str, dtype: str, attention: str) -> None:
    """ValueError naming why `attention` cannot serve `model` in `dtype` on `device`, found without reading a
    weight (the tower is built on the meta device for its head dim); `auto` always finds a backend."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    check_backend_name(attention, dev)
    if attention == "auto":
        return
    if model in PRESETS:
        tower = preset_tower(PRESETS[model], "sdpa")
    else:
        tower = build_tower(*_read_checkpoint_config(Path(model)), "sdpa")
    problem = backend_problem(attention, dev.type, dt, tower.head_dim)
    if problem:
        raise ValueError(problem)


Prefixes = tuple[str | tuple[str, str | None], ...]  # models.family.Family.prefixes
Renames = tuple[tuple[str, str], ...]  # models.family.Family.renames


def tower_name(key: str, prefixes: Prefixes, renames: Renames = ()) -> str | None:
    """The tower's name for checkpoint tensor `key`: after the first prefix it starts with, that prefix
    replaced by the tower's ("" for a plain prefix), then each of `renames` (old, new) replaced where it
    occurs; None for a tensor the tower does not read."""
    for prefix in prefixes:
        source, target = (prefix, "") if isinstance(prefix, str) else prefix
        if key.startswith(source):
            if target is None:
                return None
            name = target + key[len(source) :]
            for old, new in renames:
                name = name.replace(old, new)
            return name
    return None


def checkpoint_files(folder: Path, prefixes: Prefixes) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted({f for k, f in weight_map.items() if tower_name(k, prefixes) is not None})
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise CheckpointError(f"{folder}: no safetensors weights found" + (f" (missing {missing})" if missing else ""))
    return files


def read_vision_tensors(folder: Path, prefixes: Prefixes, renames: Renames = ()) -> dict[str, torch.Tensor]:
    """Vision tensors keyed without their prefix, read lazily (text, audio and other weights are never loaded)."""
    return _read_vision(folder, prefixes, lambda f, key: f.get_tensor(key), renames)


def vision_tensor_shapes(folder: Path, prefixes: Prefixes, renames: Renames = ()) -> dict[str, tuple[int, ...]]:
    """The vision tensors' shapes, from the safetensors headers alone."""
    return _read_vision(folder, prefixes, lambda f, key: tuple(f.get_slice(key).get_shape()), renames)


def _read_vision(folder: Path, prefixes: Prefixes, read: Any, renames: Renames = ()) -> dict[str, Any]:
    from safetensors import safe_open

    out: dict[str, Any] = {}
    for path in checkpoint_files(folder, prefixes):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = tower_name(key, prefixes, renames)
                if name is not None:
                    out[name] = read(f, key)
    return out


def weight_problems(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> list[str]:
    """Missing, unexpected and mis-shaped tensors, by name (at most 20 of each)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = sorted(f"{k}: checkpoint {found[k]} vs model {expected[k]}"
                    for k in set(expected) & set(found) if found[k] != expected[k])
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {', '.join(missing[:20])}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:20])}")
    if shapes:
        problems.append(f"mis-shaped {len(shapes)}: {'; '.join(shapes[:20])}")
    return problems


def load_state(tower: QwenTower, tensors: dict[str, torch.Tensor], source: Path | str) -> None:
    expected = {k: tuple(v.shape) for k, v in tower.state_dict().items()}
    problems = weight_problems(expected, {k: tuple(v.shape) for k, v in tensors.items()})
    if problems:
        raise CheckpointError(f"{source}: vision weights do not match the config ({' | '.join(problems)})")
    tower.load_state_dict(tensors)


def processor_config_from_folder(folder: str | Path, family: str) -> ProcessorConfig:
    """The processor configs in transformers' order: `processor_config.json`'s nested `image_processor` /
    `video_processor` (all transformers 5's `save_pretrained` writes), else `preprocessor_config.json` /
    `video_preprocessor_config.json`."""
    folder = Path(folder)
    nested = _read_json(folder / "processor_config.json") or {}
    image = nested.get("image_processor") or _read_json(folder / "preprocessor_config.json")
    if image is None:
        raise FileNotFoundError(f"{folder} has neither preprocessor_config.json nor a processor_config.json "
                                "holding an image_processor")
    if "patch_size" not in image and isinstance(image.get("vision_config"), dict):
        # a folder laid out for vLLM's dots3-note processor, which reads the image settings from this section
        image = image["vision_config"]
    video = nested.get("video_processor") or _read_json(folder / "video_preprocessor_config.json")
    spec = FAMILIES.get(family)
    # transformers' video processors (Qwen3-VL's, GLM's) read preprocessor_config.json when theirs is missing;
    # Qwen2-VL's videos follow qwen-vl-utils, whose defaults are VideoConfig's
    if video is None and spec is not None and spec.video_sampling != "qwen2":
        video = image
    processor = family_processor_config(family, image, video)
    font = processor.video.timestamp_font
    if font:  # the font ships beside the configs (ERNIE-4.5-VL)
        processor = replace(processor, video=replace(processor.video, timestamp_font=str(folder / font)))
    return processor


def family_processor_config(family: str, image: dict[str, Any], video: dict[str, Any] | None) -> ProcessorConfig:
    """`ProcessorConfig.from_dicts`, or the family's own reading of its processor configs where its keys differ
    (`Family.extra["processor_config"]`, same arguments)."""
    spec = FAMILIES.get(family)
    read = spec.extra.get("processor_config") if spec else None
    return (read or ProcessorConfig.from_dicts)(family, image, video)


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None
