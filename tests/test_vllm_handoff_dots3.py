"""dots3-note's hand-off judged by vLLM 0.33.0's own code. vLLM serves dots3-note (`Dots3NoteForCausalLM`) on
CUDA only and its processor takes no embedding parts (it declares pixel fields only), so a `vllm_ref` part is the
client's media part with the uuid, as for GLM-4.1V: vLLM sizes the placeholder from the media with its own image
processor and, as an encoder-cache consumer, loads vitserve's output by the uuid. What must hold: vLLM's image
processor, given the folder vitserve serves from, makes the grid vitserve made, so its placeholder is as long as
the rows vitserve stored, and the same pixel rows (its tower would see what vitserve's saw). Its videos are a
prompt of its own (frames as images between text timestamps and audio), which vitserve's video outputs do not
fit: an `encoding_format` of `vllm` or `vllm_ref` on a video says so.

Without VITSERVE_VLLM_PYTHON these tests skip (see tests/test_vllm_handoff.py).
"""

from __future__ import annotations

import base64
import json

import numpy as np
import torch
from safetensors.torch import load_file

from models import load_tower
from models.presets import PRESETS
from service.handoff.ec_storage import FILE_NAME
from service.media.image_preprocess import preprocess_image_bytes
from tests.checkpoints import write_checkpoint
from tests.http_helpers import ServerThread, image_bytes, settings
from tests.test_vllm_handoff import run_driver, vllm_python

IMAGES = [image_bytes(160, 120, seed=41, fmt="JPEG"), image_bytes(96, 96, seed=42, fmt="PNG"),
          image_bytes(700, 90, seed=43, fmt="PNG"), image_bytes(30, 45, seed=44, fmt="PNG", mode="RGBA")]


def test_vllm_sizes_and_patches_images_as_vitserve_did(tmp_path):
    vllm_python()
    folder = tmp_path / "dots3"
    write_checkpoint("tiny-dots3-note", folder)
    # the image settings where vLLM's processor reads them (and vitserve too, the top level being empty)
    section = {**PRESETS["tiny-dots3-note"].preprocessor, "image_mean": [0.48145466, 0.4578275, 0.40821073],
               "image_std": [0.26862954, 0.26130258, 0.27577711]}
    (folder / "preprocessor_config.json").write_text(json.dumps({"vision_config": section}))
    (folder / "video_preprocessor_config.json").unlink(missing_ok=True)
    store = tmp_path / "ec"
    cfg = settings(model=str(folder), ec_shared_storage=str(store))
    items = [{"type": "image", "image": base64.b64encode(d).decode()} for d in IMAGES]
    with ServerThread(cfg) as srv, srv.client() as c:
        r = c.post("/encode", json={"items": items, "encoding_format": "vllm_ref"})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    paths = []
    for k, data_bytes in enumerate(IMAGES):
        paths.append(str(tmp_path / f"image{k}"))
        (tmp_path / f"image{k}").write_bytes(data_bytes)
    out = tmp_path / "pixels.safetensors"
    report = run_driver("vllm_dots3_driver.py", {"folder": str(folder), "images": paths, "out": str(out)}, tmp_path)
    pixels = load_file(str(out))
    tower = load_tower(str(folder), device="cpu", dtype="float32")
    for k, (entry, data_bytes) in enumerate(zip(data, IMAGES)):
        part = entry["content_part"]
        assert part == {"type": "image_url", "uuid": part["uuid"]}  # the media part goes with it
        stored = load_file(str(store / part["uuid"] / FILE_NAME))["ec_cache"]
        assert report["grids"][k] == entry["grid_thw"]
        assert report["tokens"][k] == entry["num_tokens"] == stored.shape[0]
        ours = preprocess_image_bytes(data_bytes, tower.processor)
        assert np.abs(tower.processor.normalize(ours.pixels) - pixels[f"pixels.{k}"].numpy()).max() <= 1e-5
        assert torch.isfinite(stored).all()
