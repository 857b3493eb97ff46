"""GLM-4.1V's video frame sampling (transformers' `Glm4vVideoProcessor.sample_frames`).

Frames are taken at `fps` from the start, frame i at ceil(i * video_fps / fps), over the clip's duration
(frames / video_fps, as transformers' decoders report it). A clip longer than `max_duration` seconds gets
max_duration * fps frames spread evenly over its whole length instead. Repeated indices (fps above the
video's) are dropped, and an odd count is padded with the last frame, so temporal patches pair frames.
"""

from __future__ import annotations

import math

import numpy as np

GLM_MAX_DURATION = 300.0  # Glm4vVideoProcessor.max_duration, seconds


def glm_frame_indices(
    total_frames: int, video_fps: float, fps: float = 2.0, max_duration: float = GLM_MAX_DURATION
) -> np.ndarray:
    """int64 indices into `total_frames` frames at `video_fps`, an even count (>= 2)."""
    if total_frames < 1 or not video_fps > 0:
        raise ValueError(f"{total_frames} frames at {video_fps} fps")
    last = total_frames - 1
    # transformers: `metadata.duration or round(last / fps) + 1`; its decoders set duration = frames / fps.
    duration = total_frames / video_fps
    if duration <= max_duration:
        n = max(math.floor(duration * fps), 1)
        picked = [min(last, math.ceil(i * video_fps / fps)) for i in range(n)]
    else:
        samples = int(max_duration * fps)
        if samples >= total_frames:
            picked = list(range(total_frames))
        else:
            picked = [min(last, math.ceil(t * video_fps)) for t in np.linspace(0, duration, samples)]
    unique = list(dict.fromkeys(picked))
    if len(unique) % 2:
        unique.append(unique[-1])
    return np.asarray(unique, dtype=np.int64)
