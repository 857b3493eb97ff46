"""Runs a transformers image processor that exists only with torchvision, in vLLM's environment (which has
torchvision; vitserve's has not), on image files: `tests/test_family_temporal_preprocess.py` compares its
output with vitserve's preprocessing.

Request (JSON on stdin): {"class": transformers' class name, "config": its preprocessor config,
"images": [file paths]}. Writes `processed.npz` (pixel_values_<i>, image_grid_thw_<i>) in the working folder
and prints one JSON line: the versions it ran with.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torchvision
import transformers
from PIL import Image


def main() -> None:
    request = json.loads(sys.stdin.read())
    processor = getattr(transformers, request["class"])(**request["config"])
    out = {}
    for i, path in enumerate(request["images"]):
        with Image.open(path) as image:
            batch = processor(image, return_tensors="pt")
        out[f"pixel_values_{i}"] = batch["pixel_values"].float().numpy()
        out[f"image_grid_thw_{i}"] = batch["image_grid_thw"].numpy()
    np.savez("processed.npz", **out)
    print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                      "torchvision": torchvision.__version__, "class": type(processor).__name__}))


if __name__ == "__main__":
    main()
