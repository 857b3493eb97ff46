"""vLLM 0.33's own dots3-note image processor on images vitserve preprocessed; run by
tests/test_vllm_handoff_dots3.py in vLLM's environment.

    <vllm-env>/bin/python tests/vllm_dots3_driver.py < request.json

vLLM serves dots3-note only on CUDA: importing `vllm.models.dots3_note` imports its FlashAttention MLA model.
Its preprocessing (`vllm.models.dots3_note.common`, "platform-independent") is imported here without that
package's own `__init__`, and runs as vLLM's processor runs it: `Dots3NoteImageProcessor(section)` built from
preprocessor_config.json's `vision_config` section, then `preprocess(image)`. The request names the folder,
the image files and a safetensors file for the pixel rows; the report (one JSON line) gives each image's grid
and vLLM's placeholder count for it.
"""

from __future__ import annotations

import json
import os
import sys
import types

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import vllm.models  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


def main() -> None:
    request = json.loads(sys.stdin.read())
    package = types.ModuleType("vllm.models.dots3_note")
    package.__path__ = [os.path.join(os.path.dirname(vllm.models.__file__), "dots3_note")]
    sys.modules["vllm.models.dots3_note"] = package
    from vllm.models.dots3_note.common.processor import Dots3NoteImageProcessor

    with open(os.path.join(request["folder"], "preprocessor_config.json")) as f:
        section = json.load(f)["vision_config"]
    processor = Dots3NoteImageProcessor(section, section.get("image_details"))
    grids, tokens, tensors = [], [], {}
    for k, path in enumerate(request["images"]):
        pixels, grid = processor.preprocess(Image.open(path))
        grids.append(grid.tolist())
        tokens.append(int(grid.prod()) // processor.merge_size**2)
        tensors[f"pixels.{k}"] = pixels.contiguous()
    save_file(tensors, request["out"])
    print(json.dumps({"grids": grids, "tokens": tokens}))


if __name__ == "__main__":
    main()
