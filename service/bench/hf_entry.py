"""transformers' reference for the towers whose checkpoint names are not their transformers module names
(HunyuanOCR, Hy4, VideoLLaMA3: models/vit_tower.py), carrying a built tower's weights, for the GPU parity tests
and the benchmark.

transformers renames those checkpoints' tensors when it loads them; its own reverse mapping (what
`save_pretrained` writes) says which module parameter each checkpoint name is, so the tower's state dict, keyed
by checkpoint names after the family's prefixes, loads into the whole model. The model is then called through its
own entry point, `get_image_features`, whose output is the tower's: merged tokens with any learned tokens laid
out, after any projector.
"""

from __future__ import annotations

import torch
from torch import nn

from models.presets import PRESETS, full_config

# transformers' Hy4 runs no sdpa (its text attention's sinks)
ATTENTION = {"hy_v4_vl": "eager"}


class EntryPoint(nn.Module):
    """`visual(pixel_values, grid_thw=...)` -> the rows of every image, as transformers' vision models are called."""

    def __init__(self, model: nn.Module, family: str) -> None:
        super().__init__()
        self.model, self.family = model, family

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        kwargs = {}
        if self.family == "video_llama_3":  # images are not merged
            kwargs["image_merge_sizes"] = torch.ones(len(grid_thw), dtype=torch.long, device=grid_thw.device)
        out = self.model.model.get_image_features(pixel_values, grid_thw, **kwargs)
        return torch.cat(list(out.pooler_output))


def checkpoint_names(model: nn.Module) -> dict[str, str]:
    """checkpoint name -> the model's parameter name, by transformers' own reverse conversion."""
    from transformers.core_model_loading import revert_weight_conversion

    tagged = {name: torch.empty(0) for name in model.state_dict()}
    owner = {id(t): name for name, t in tagged.items()}
    return {ckpt: owner[id(t)] for ckpt, t in revert_weight_conversion(model, dict(tagged)).items()}


def entry_point_reference(tower) -> EntryPoint:
    import transformers

    spec = tower.spec
    cfg = full_config(PRESETS[tower.name])
    dev, dtype = tower.device, tower.dtype
    with torch.device("meta"):
        model = getattr(transformers, spec.hf_class)._from_config(
            cfg, dtype=dtype, attn_implementation=ATTENTION.get(spec.model_type, "sdpa"))
    model = model.to_empty(device=dev)
    names = checkpoint_names(model)
    state = {}
    for key, value in tower.state_dict().items():
        found = [names[p + key] for p in spec.prefixes if p + key in names]
        if not found:
            raise KeyError(f"{key}: no parameter of {spec.hf_class} under the prefixes {spec.prefixes}")
        state[found[0]] = value
    missing = {n for n in names.values() if ".language_model." not in n and not n.startswith("lm_head")} - set(state)
    if missing:
        raise KeyError(f"the tower leaves {sorted(missing)[:5]} of {spec.hf_class} unset")
    model.load_state_dict(state, strict=False)  # the text model stays uninitialised: never run
    for m in model.modules():  # non-persistent rotary buffers were left empty by to_empty
        if isinstance(getattr(m, "inv_freq", None), torch.Tensor) and hasattr(m, "compute_axial_rope_parameters"):
            m.inv_freq = m.compute_axial_rope_parameters(m.config)[0].to(dev)
    return EntryPoint(model, spec.model_type).eval()


def vision_checkpoint_shapes(model: nn.Module, prefixes: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors `save_pretrained` writes under the vision prefixes, keyed without them: what a
    tower named after the checkpoint must hold."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    out = {}
    for ckpt, name in checkpoint_names(model).items():
        prefix = next((p for p in prefixes if ckpt.startswith(p)), None)
        if prefix is not None:
            out[ckpt[len(prefix):]] = shapes[name]
    return out
