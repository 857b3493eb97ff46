"""Runs a transformers image processor that exists only with torchvision, in vLLM's environment (which has
torchvision; vitserve's has not), on image files: `tests/test_family_temporal_preprocess.py` compares its
output with vitserve's preprocessing.

Request (JSON on stdin): {"class": transformers' class name, "config": its preprocessor config,
"images": [file paths]}, and optionally {"video_class", "video_config", "videos": [.npy files of uint8
[T, C, H, W] frames], "video_metadata": [per video: fps, frames_indices, total_num_frames, or null]} (the
video processor on those frames, no sampling of its own), {"sample_frames": [[total_frames, video_fps], ...]}
(the frames the video processor's own `sample_frames` picks) and {"minimax_sampling": [[total_frames,
video_fps, fps], ...]} (the frames vLLM's MiniMax-M3 loader picks). Writes `processed.npz`
(pixel_values_<i>, image_grid_thw_<i>, pixel_values_videos_<i>, video_grid_thw_<i>) in the working folder
and prints one JSON line: the versions it ran with and the sampled frame indices.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torchvision
import transformers
from PIL import Image
from transformers.video_utils import VideoMetadata


def main() -> None:
    request = json.loads(sys.stdin.read())
    processor = getattr(transformers, request["class"])(**request["config"])
    out = {}
    for i, path in enumerate(request["images"]):
        with Image.open(path) as image:
            batch = processor(image, return_tensors="pt")
        out[f"pixel_values_{i}"] = batch["pixel_values"].float().numpy()
        out[f"image_grid_thw_{i}"] = batch["image_grid_thw"].numpy()
    if request.get("videos"):
        videos = getattr(transformers, request["video_class"])(**request["video_config"])
        metadata = request.get("video_metadata") or [None] * len(request["videos"])
        for i, (path, meta) in enumerate(zip(request["videos"], metadata)):
            extra = {"video_metadata": [VideoMetadata(**meta)]} if meta else {}
            batch = videos([torch.from_numpy(np.load(path))], do_sample_frames=False, return_tensors="pt", **extra)
            out[f"pixel_values_videos_{i}"] = batch["pixel_values_videos"].float().numpy()
            out[f"video_grid_thw_{i}"] = batch["video_grid_thw"].numpy()
    sampled = []
    for total, video_fps in request.get("sample_frames") or []:
        videos = getattr(transformers, request["video_class"])(**request["video_config"])
        picked = videos.sample_frames(VideoMetadata(total_num_frames=total, fps=video_fps))
        sampled.append([int(i) for i in picked])
    if request.get("minimax_sampling"):
        from vllm.models.minimax_m3.common.mm_preprocess import MiniMaxM3VideoBackend
        from vllm.multimodal.video_decoders.base import VideoSourceMetadata, VideoTargetMetadata

        for total, video_fps, fps in request["minimax_sampling"]:
            source = VideoSourceMetadata(total_frames_num=total, original_fps=video_fps, duration=total / video_fps)
            target = VideoTargetMetadata(num_frames=-1, fps=fps, max_duration=300)
            sampled.append(MiniMaxM3VideoBackend.compute_frames_index_to_sample(source, target))
    np.savez("processed.npz", **out)
    print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                      "torchvision": torchvision.__version__, "class": type(processor).__name__,
                      "sampled": sampled}))


if __name__ == "__main__":
    main()
