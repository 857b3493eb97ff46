"""Each Qwen-style family's preprocessing against its own transformers processor, on the CPU
(GLM's, which sizes images its own way, are in tests/test_glm_preprocess.py).

Images: the family's image processor class (`Family.image_processor`, PIL backend: CI has no
torchvision), built from the same preprocessor_config.json the server reads, must give the same
grid and the same pixels (to float32 rounding) as the server's preprocessing. The description must
name the class transformers itself maps the model_type to. Videos: the sampling rule is that of the
family's video processor class (Qwen2VLVideoProcessor or Qwen3VLVideoProcessor, per transformers'
own mapping); tests/test_video_hf_processors.py runs those classes where torchvision exists (the
GPU machine). A family without videos refuses them with a 422.
"""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import pytest
import transformers
from PIL import Image

from models.config import ProcessorConfig
from models.families import FAMILIES
from models.loader import processor_config_from_folder
from models.presets import PRESETS
from service.media.errors import MediaError
from service.media.image_preprocess import preprocess_image_bytes
from service.media.video_preprocess import preprocess_video_bytes
from tests.videos import make_video

# One tiny preset per family: its preprocessor configs are the released ones with smaller bounds.
QWEN_STYLE = sorted(name for name, family in FAMILIES.items() if family.image_sizing == "qwen2"
                    and family.image_resize == "pil")  # classes with a PIL backend (CI has no torchvision)
PRESET_OF = {}
for _name, _preset in PRESETS.items():
    if _name.startswith("tiny-") and _preset.family in QWEN_STYLE:
        PRESET_OF.setdefault(_preset.family, _name)
# transformers' video processor class for each model_type (video_processing_auto, which CI cannot
# import without torchvision): the sampling rule the description must name.
VIDEO_RULES = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen2_5_omni": "qwen2", "qwen3_omni_moe": "qwen2",
               "exaone4_5": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3", "qwen3_5": "qwen3",
               "qwen3_5_moe": "qwen3", "lfm3_vl": "qwen3", "dots3_note": "qwen3",
               "ernie4_5_vl_moe": "ernie", "hy_v4_vl": "hy_v4_vl", "video_llama_3": "video_llama_3",
               "qwen4_exp": "qwen3", "cosmos3_omni": "qwen3", "hyperclovax_vision_v2": "qwen2"}
SIZES = [(97, 143), (300, 500), (37, 810), (64, 64)]  # (width, height)


def image_bytes(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(out, format="PNG")
    return out.getvalue()


def family_processor(family: str, folder):
    """The family's own image processor class (PIL backend), from the folder's preprocessor_config.json."""
    name = FAMILIES[family].image_processor + "Pil"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, name).from_pretrained(str(folder))


@pytest.mark.parametrize("family", sorted(PRESET_OF))
def test_image_grids_and_pixels_equal_the_familys_processor(family: str, tmp_path) -> None:
    preset = PRESETS[PRESET_OF[family]]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preset.preprocessor))
    cfg = processor_config_from_folder(tmp_path, family)
    reference = family_processor(family, tmp_path)
    for seed, (width, height) in enumerate(SIZES):
        data = image_bytes(width, height, seed)
        ours = preprocess_image_bytes(data, cfg)
        out = reference(Image.open(io.BytesIO(data)), return_tensors="np")
        assert ours.grid_thw == tuple(int(v) for v in out["image_grid_thw"][0])
        pixels = np.asarray(out["pixel_values"])
        assert pixels.shape == ours.pixels.shape
        assert float(np.abs(cfg.normalize(ours.pixels) - pixels).max()) <= 1e-5


@pytest.mark.parametrize("family", QWEN_STYLE)
def test_the_description_names_transformers_own_processor_classes(family: str) -> None:
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    spec = FAMILIES[family]
    mapped = IMAGE_PROCESSOR_MAPPING_NAMES.get(family)
    if mapped is not None:  # some model types leave it to the checkpoint's image_processor_type
        assert mapped["torchvision"] == spec.image_processor
    base = family.removesuffix("_thinker")
    if spec.video:
        assert spec.video_sampling == VIDEO_RULES[base]
    assert spec.video_timestamps <= (spec.video_sampling == "qwen3")  # timestamps come with Qwen3-VL's rule


def test_a_family_without_videos_refuses_them() -> None:
    cfg = ProcessorConfig.from_dicts("cohere_compass", PRESETS["tiny-cohere-compass"].preprocessor)
    data = make_video(4, fps=2, width=64, height=64)
    with pytest.raises(MediaError) as err:
        preprocess_video_bytes(data, cfg)
    assert err.value.code == "unsupported_format" and "images only" in err.value.reason
