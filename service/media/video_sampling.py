"""Which frames of a video to sample and how large to make them, before anything is decoded.

The rules follow the reference each model family ships with:

* Qwen2-VL / Qwen2.5-VL, the Omni models, EXAONE 4.5: qwen-vl-utils 0.0.14 `fetch_video` with its
  decord/torchcodec readers (`smart_nframes`, `calculate_video_frame_range`, `torch.linspace(...).round()` indices, the
  per-frame pixel budget of `fetch_video`), resize with `smart_resize` (factor patch*merge).
* Qwen3-VL, Qwen3-VL-MoE, Qwen3.5: transformers' `Qwen3VLVideoProcessor` (`sample_frames`, and its own `smart_resize`
  that bounds T*H*W of the whole clip between size.shortest_edge and size.longest_edge).
* GLM-4.1V, GLM-4.5V, GLM-OCR: transformers' `Glm4vVideoProcessor` (`sample_frames`: frames at fps
  up to `max_duration` seconds, repeats dropped, an odd count padded; the same T*H*W sizing).
* GLM-4.6V: `Glm46VVideoProcessor` (a frame rate chosen by the clip's length, at most 640 frames).
* GLMGA, GLM-5-Next: `GlmgaVideoProcessor`, `Glm5NextVideoProcessor` (a fixed rate up to their max_frames;
  GLM-5's frames shrunk into a canvas bounded in tokens and zero-padded).
* Kimi-K2.x, Muse: `Kimi_K25VideoProcessor`, `MuseGlimmerVideoProcessor` (service/media/navit_sizing.py).
* ERNIE-4.5-VL: `Ernie4_5_VLMoeVideoProcessor` (frames spread over the clip, 16 to 180, each sized alone; the
  frame's time drawn on it before resizing: service.media.frame_labels).
* MiniMax-M3: `MiniMaxM3VLVideoProcessor` takes the frames it is given; they are vLLM's for the model (one a
  second), each sized by `smart_resize` between the video processor's min_pixels and max_pixels.
* Hy4: `HYV4VLVideoProcessor` (frames at fps over the clip, sized along the frame's aspect so that the clip's
  tokens, a newline per row counted, fit its budget; never upscaled).
* VideoLLaMA3: `VideoLlama3VideoProcessor` (frames at fps, the clip's pixel budget shared by its frames).

`service.media.rules` says which of these a family follows.

`VideoOptions` are one item's per-request overrides of the config's video defaults; `plan_sampling`
turns them, the frame count and the frame rate into a `SamplingPlan`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from models.config import ProcessorConfig
from service.media.errors import (
    ASPECT_RATIO,
    INVALID_OPTION,
    TOO_FEW_FRAMES,
    TOO_SMALL,
    UNSUPPORTED_FORMAT,
    MediaError,
)
from service.media.image_preprocess import (
    MAX_ASPECT_RATIO,
    budget_resize,
    clip_smart_resize,
    navit_image_size,
    padded_content,
    smart_resize,
)
from service.media.navit_sizing import kimi_frame_indices, muse_frame_indices
from service.media.rules import takes_video, video_sampling

# qwen-vl-utils' FRAME_FACTOR; it is the temporal_patch_size of every Qwen-VL checkpoint.
FRAME_FACTOR = 2
# Qwen3VLVideoProcessor.max_video_tokens: per-frame token ceiling when cap_pixels_per_frame is on.
QWEN3_MAX_VIDEO_TOKENS = 768


# -- rounding helpers (qwen-vl-utils) -------------------------------------------------------------


def round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor


def ceil_by_factor(number: float, factor: int) -> int:
    return math.ceil(number / factor) * factor


def floor_by_factor(number: float, factor: int) -> int:
    return math.floor(number / factor) * factor


def torch_linspace_round(start: float, end: float, steps: int) -> np.ndarray:
    """`torch.linspace(start, end, steps).round().long()` (default float32) with numpy.

    numpy's float64 linspace rounds differently on long clips. torch's CPU kernel computes the
    first half as start + step*i and the second half as end - step*(steps-1-i), each as one fused
    multiply-add rounded once to float32, with step = (end - start) / (steps - 1) in float32. The
    float64 product and sum are exact here (24-bit step times an index below 2**29), so one cast to
    float32 is that single rounding. Rounding is half to even in both libraries.
    """
    if steps < 1:
        return np.zeros(0, dtype=np.int64)
    s32, e32 = np.float32(start), np.float32(end)
    if steps == 1:
        return np.round(np.asarray([s32])).astype(np.int64)
    step = np.float64(np.float32(e32 - s32) / np.float32(steps - 1))
    i = np.arange(steps, dtype=np.float64)
    head = (np.float64(s32) + step * i).astype(np.float32)
    tail = (np.float64(e32) - step * (steps - 1 - i)).astype(np.float32)
    values = np.where(np.arange(steps) < steps // 2, head, tail)
    return np.round(values).astype(np.int64)


def float32_arange_int(end: int, step: float) -> np.ndarray:
    """`torch.arange(0, end, step).int()` with a float step (float32 values, computed in double on the CPU,
    truncated): ceil(end / step) values."""
    count = math.ceil(end / step)
    return (np.arange(count, dtype=np.float64) * step).astype(np.float32).astype(np.int64)


# -- Qwen2-VL / Qwen2.5-VL: qwen-vl-utils ---------------------------------------------------------


def frame_range(
    total_frames: int, video_fps: float, video_start: float | None = None, video_end: float | None = None
) -> tuple[int, int, int]:
    """(first, last, count) frame indices inside [video_start, video_end] seconds.

    qwen-vl-utils `calculate_video_frame_range`: times are clamped to the clip, the first index is
    ceil(start * fps), the last floor(end * fps) capped at the last frame.
    """
    if video_start is None and video_end is None:
        return 0, total_frames - 1, total_frames
    max_duration = total_frames / video_fps
    first = 0
    if video_start is not None:
        first = math.ceil(max(0.0, min(video_start, max_duration)) * video_fps)
    last = total_frames - 1
    if video_end is not None:
        last = min(math.floor(max(0.0, min(video_end, max_duration)) * video_fps), total_frames - 1)
    if first >= last:
        raise MediaError(
            reason=f"video_start/video_end select no frames: frames {first}..{last} of a "
            f"{max_duration:.2f} s clip ({total_frames} frames at {video_fps:.3f} fps)",
            code=INVALID_OPTION,
        )
    return first, last, last - first + 1


def qwen2_nframes(
    total_frames: int,
    video_fps: float,
    *,
    fps: float = 2.0,
    nframes: int | None = None,
    min_frames: int = 4,
    max_frames: int | None = None,
    default_max_frames: int = 768,
) -> int:
    """qwen-vl-utils `smart_nframes`: how many frames to sample.

    nframes given: round it to FRAME_FACTOR. Otherwise total/video_fps*fps, clamped to
    [ceil2(min_frames), floor2(max_frames)] and to total_frames, then floored to FRAME_FACTOR;
    max_frames defaults to min(default_max_frames, total_frames). The result must lie in
    [FRAME_FACTOR, total_frames].
    """
    if nframes is not None:
        n = round_by_factor(nframes, FRAME_FACTOR)
    else:
        lo = ceil_by_factor(min_frames, FRAME_FACTOR)
        hi = floor_by_factor(
            max_frames if max_frames is not None else min(default_max_frames, total_frames), FRAME_FACTOR
        )
        wanted = total_frames / video_fps * fps
        n = floor_by_factor(min(min(max(wanted, lo), hi), total_frames), FRAME_FACTOR)
    if not FRAME_FACTOR <= n <= total_frames:
        if total_frames < FRAME_FACTOR:
            raise MediaError(
                reason=f"the video has {total_frames} frame(s) in range; at least {FRAME_FACTOR} are needed",
                code=TOO_FEW_FRAMES,
            )
        raise MediaError(
            reason=f"sampling asks for {n} frames; it must lie in [{FRAME_FACTOR}, {total_frames}] "
            f"(frames in range)",
            code=INVALID_OPTION,
        )
    return n


def qwen2_frame_pixel_bounds(
    nframes: int,
    *,
    min_pixels: int,
    frame_max_pixels: int,
    total_pixels: float,
    max_pixels: float | None = None,
) -> tuple[int, float]:
    """qwen-vl-utils `fetch_video` per-frame bounds: the total budget shared by the frames.

    max = max(min(frame_max_pixels, total_pixels / nframes * FRAME_FACTOR), int(min_pixels * 1.05)),
    then lowered (never raised) by a requested max_pixels. frame_max_pixels plays
    VIDEO_MAX_TOKEN_NUM * factor**2 (768 tokens), min_pixels VIDEO_MIN_TOKEN_NUM * factor**2.
    """
    budget = max(min(frame_max_pixels, total_pixels / nframes * FRAME_FACTOR), int(min_pixels * 1.05))
    if max_pixels is not None:
        budget = min(max_pixels, budget)
    return min_pixels, budget


# -- Qwen3-VL: transformers Qwen3VLVideoProcessor -------------------------------------------------


def qwen3_num_frames(
    total_frames: int,
    video_fps: float,
    *,
    fps: float = 2.0,
    num_frames: int | None = None,
    min_frames: int = 4,
    max_frames: int = 768,
) -> int:
    """Qwen3VLVideoProcessor.sample_frames: int(total/video_fps*fps) clamped to [min_frames,
    max_frames] and to total_frames; an explicit num_frames is used as is (no rounding)."""
    if num_frames is not None:
        return int(num_frames)
    n = int(total_frames / video_fps * fps)
    return min(max(n, min_frames), max_frames, total_frames)


def qwen3_smart_resize(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int = 2,
    factor: int = 32,
    min_pixels: float = 128 * 32 * 32,
    max_pixels: float = 32 * 32 * 768,
) -> tuple[int, int]:
    """The Qwen3-VL video `smart_resize`: the clip arithmetic GLM's images use too, at Qwen3-VL's defaults."""
    return clip_smart_resize(num_frames, height, width, temporal_factor=temporal_factor, factor=factor,
                             min_pixels=min_pixels, max_pixels=max_pixels)


def qwen3_max_pixels(
    num_frames: int, *, factor: int, min_pixels: float, max_pixels: float, cap_pixels_per_frame: bool
) -> float:
    """Upper T*H*W bound for `qwen3_smart_resize`; with the optional per-frame cap of
    Qwen3VLVideoProcessor.resize (qwen-vl-utils style), each frame gets at most
    min(768 tokens, max_pixels // T) pixels, floored at int(min_pixels * 1.05)."""
    if not cap_pixels_per_frame:
        return max_pixels
    frame_cap = QWEN3_MAX_VIDEO_TOKENS * factor * factor
    per_frame = max(min(frame_cap, int(max_pixels) // num_frames), int(min_pixels * 1.05))
    return per_frame * num_frames


# -- GLM-4.1V: transformers Glm4vVideoProcessor --------------------------------------------------

GLM_MAX_DURATION = 300.0  # Glm4vVideoProcessor.max_duration, seconds


def even_unique(picked: list[int]) -> np.ndarray:
    """The GLM samplers' last step: int64 indices with repeats dropped and an odd count padded with the last."""
    unique = list(dict.fromkeys(picked))
    if len(unique) % 2:
        unique.append(unique[-1])
    return np.asarray(unique, dtype=np.int64)


def glm_frame_indices(
    total_frames: int,
    video_fps: float,
    *,
    fps: float = 2.0,
    max_duration: float = GLM_MAX_DURATION,
    nframes: int | None = None,
) -> np.ndarray:
    """Glm4vVideoProcessor.sample_frames: int64 indices into `total_frames` frames, an even count.

    Frame i at ceil(i * video_fps / fps) for i < floor(duration * fps), the duration being
    frames / video_fps as transformers' decoders report it; a clip longer than `max_duration` gets
    max_duration * fps frames at evenly spaced times over its whole length instead (all of them when
    it has no more). `nframes` asks for that many at evenly spaced times (GLM's own way to take a
    fixed count). Repeats are dropped; an odd count is padded with the last index.
    """
    last = total_frames - 1
    duration = total_frames / video_fps
    if nframes is not None:
        picked = [min(last, math.ceil(t * video_fps)) for t in np.linspace(0, duration, nframes)]
    elif duration <= max_duration:
        n = max(math.floor(duration * fps), 1)
        picked = [min(last, math.ceil(i * video_fps / fps)) for i in range(n)]
    elif int(max_duration * fps) >= total_frames:
        picked = list(range(total_frames))
    else:
        samples = int(max_duration * fps)
        picked = [min(last, math.ceil(t * video_fps)) for t in np.linspace(0, duration, samples)]
    return even_unique(picked)


# GLM-4.6V: Glm46VVideoProcessor.sample_frames' constants
GLM46V_RATES = ((30, 3.0), (300, 1.0), (2400, 0.5))  # (up to this many seconds, frames pairs per second)
GLM46V_MAX_FRAMES = 640
GLM46V_MAX_DURATION = 2400


def glm46v_frame_indices(total_frames: int, video_fps: float, temporal_patch_size: int = 2) -> np.ndarray:
    """Glm46VVideoProcessor.sample_frames: int64 indices, an even count.

    The rate follows the clip's length (3 temporal patches a second up to 30 s, 1 up to 300 s, 0.5 beyond,
    at most 2400 s counted), giving `extract_t` frames (at most 640): frames are taken each time the clip's
    clock passes the next 1 / (temporal_patch_size * rate) seconds, up to the last whole second; too few or
    too many are replaced by `extract_t` evenly spaced indices. Repeats are dropped; an odd count is padded.
    """
    last = total_frames - 1
    duration = total_frames / video_fps
    effective = min(duration, GLM46V_MAX_DURATION)
    rate = next(r for limit, r in GLM46V_RATES if effective <= limit or limit == GLM46V_RATES[-1][0])
    extract = min(int(effective * rate * temporal_patch_size), GLM46V_MAX_FRAMES)
    if total_frames < extract:
        picked = np.linspace(0, last, extract, dtype=int).tolist()
    else:
        max_second = int(duration)
        picked = _glm_clock(total_frames, video_fps, temporal_patch_size * rate, lambda clock: clock >= max_second)
    return _glm_fixed_count(picked, extract, last)


# GLMGA and GLM-5.x: GlmgaVideoProcessor.sample_frames and Glm5NextVideoProcessor's variant of it
GLMGA_MAX_FRAMES = 640


def _glm_fixed_count(picked: list[int], extract: int, last: int) -> np.ndarray:
    """The last steps GLM's samplers share: too few or too many indices are replaced by `extract` evenly spaced
    ones (`np.linspace(..., dtype=int)`: truncated), repeats dropped, an odd count padded with the last."""
    if len(picked) < extract:
        start, end = (picked[0], picked[-1]) if picked else (0, max(last, 0))
        picked = np.linspace(start, end, extract, dtype=int).tolist()
    elif len(picked) > extract:
        picked = np.linspace(0, last, extract, dtype=int).tolist()
    return even_unique(picked)


def _glm_clock(total_frames: int, video_fps: float, fps: float, stop: Callable[[float], bool]) -> list[int]:
    """Frames taken each time the clip's clock passes the next 1 / fps seconds, until `stop(clock)`."""
    picked, current, per_frame = [], 0.0, 1 / video_fps
    for index in range(total_frames):
        if index * per_frame >= current:
            current += 1 / fps
            picked.append(index)
            if stop(current):
                break
    return picked


def glmga_frame_indices(total_frames: int, video_fps: float, *, fps: float = 2.0,
                        max_frames: int = GLMGA_MAX_FRAMES) -> np.ndarray:
    """GlmgaVideoProcessor.sample_frames: int64 indices, an even count.

    `extract_t` = duration * fps frames (at most `max_frames`); a clip with fewer frames than that takes
    floor(i * frames / extract_t) for each i; otherwise a frame each time the clock passes the next 1 / fps
    seconds, until one step before the end; then `_glm_fixed_count`.
    """
    duration = total_frames / video_fps
    extract = min(int(duration * fps), max_frames)
    if total_frames < extract:
        picked = [math.floor(i * total_frames / extract) for i in range(extract)]
    else:
        picked = _glm_clock(total_frames, video_fps, fps, lambda clock: clock >= duration - 1 / fps)
    return _glm_fixed_count(picked, extract, total_frames - 1)


def glm5_frame_indices(total_frames: int, video_fps: float, *, fps: float = 2.0, max_frames: int = 2048) -> np.ndarray:
    """Glm5NextVideoProcessor.sample_frames (its `max_duration` is 0: no cap): as `glmga_frame_indices`, but a
    short clip takes evenly spaced indices and the clock stops at the last whole second."""
    duration = total_frames / video_fps
    extract = min(int(duration * fps), max_frames)
    last_second = int(duration)
    if total_frames < extract:
        picked = np.linspace(0, total_frames - 1, extract, dtype=int).tolist()
    else:
        picked = _glm_clock(total_frames, video_fps, fps, lambda clock: clock >= last_second)
    return _glm_fixed_count(picked, extract, total_frames - 1)


# -- MiniMax-M3: frames a second apart ----------------------------------------------------------------


def minimax_frame_indices(total_frames: int, video_fps: float, fps: float = 1.0) -> np.ndarray:
    """MiniMax-M3's frames: MiniMaxM3VLVideoProcessor takes the frames it is given (`do_sample_frames` is off),
    and vLLM's loader for the model (`MiniMaxM3VideoBackend`, vLLM 0.33) gives it one every 1/fps seconds of
    presentation time: frame 0, then the first frame at least 1/fps - 1e-4 s after the last one kept."""
    if total_frames <= 0 or video_fps <= 0 or fps <= 0:
        return np.zeros(1 if total_frames > 0 else 0, dtype=np.int64)
    picked: list[int] = []
    kept = -math.inf
    while True:
        frame = 0 if not picked else max(math.ceil((kept + 1.0 / fps - 1e-4) * video_fps), picked[-1] + 1)
        if frame >= total_frames:
            break
        picked.append(frame)
        kept = frame / video_fps
    return np.asarray(picked or [0], dtype=np.int64)


# -- ERNIE-4.5-VL: frames spread over the clip --------------------------------------------------------


def ernie_frame_indices(total_frames: int, video_fps: float, *, fps: float | None = None,
                        num_frames: int | None = None, min_frames: int = 16, max_frames: int = 180) -> np.ndarray:
    """`Ernie4_5_VLMoeVideoProcessor.sample_frames`: `num_frames` (within [min_frames, max_frames]), or the
    clip's frames at `fps` (every frame without one) clamped to [min_frames, max_frames] and the frame count,
    spread as `torch.arange(0, total, total / n).int()` (`float32_arange_int`: its float32 steps decide the
    picks); then an odd count gets its last frame again (the processor repeats the last frame)."""
    if num_frames is not None:
        if not min_frames <= num_frames <= max_frames:
            raise MediaError(reason=f"nframes must be within [{min_frames}, {max_frames}] for this model; "
                             f"got {num_frames}", code=INVALID_OPTION)
        n: float = num_frames
    else:
        n = total_frames / video_fps * fps if fps else total_frames
        n = min(max(n, min_frames), max_frames, total_frames)
    if n > total_frames:
        raise MediaError(reason=f"{n} frames asked of a clip of {total_frames}", code=INVALID_OPTION)
    indices = float32_arange_int(total_frames, total_frames / n)
    return np.concatenate([indices, indices[-1:]]) if len(indices) % 2 else indices


# -- Hy4: transformers HYV4VLVideoProcessor ------------------------------------------------------


def hy4_frame_indices(total_frames: int, video_fps: float, *, fps: float | None = 2.0, num_frames: int | None = None,
                      min_frames: int = 2, max_frames: int = 1024) -> np.ndarray:
    """HYV4VLVideoProcessor.sample_frames: int(duration * fps) frames clamped to [min_frames, max_frames] and to
    the frames there are (or `num_frames` as asked), at np.linspace(0, last, n) rounded (half to even)."""
    if num_frames is None:
        wanted = int(total_frames / video_fps * fps) if fps is not None else total_frames
        num_frames = min(max(wanted, min_frames), max_frames, total_frames)
    return np.linspace(0, total_frames - 1, num_frames).round().astype(np.int64)


def hy4_frame_size(height: int, width: int, num_frames: int, *, factor: int, max_pixels: int,
                   max_frame_pixels: int) -> tuple[int, int]:
    """HYV4VLVideoProcessor.smart_resize: the largest (rows, cols) of merged patches along the frame's aspect
    ray, never upscaled, whose tokens with a newline per row, rows * (cols + 1) per frame, fit the clip's budget
    (max_pixels / factor**2 over all frames) and whose pixels fit `max_frame_pixels`; in pixels."""
    if min(num_frames, height, width, factor, max_pixels, max_frame_pixels) <= 0:
        raise MediaError(f"a {width}x{height} video of {num_frames} frames cannot be sized", TOO_SMALL)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise MediaError(f"aspect ratio {ratio:.1f} of {width}x{height} frames is above the limit of "
                         f"{MAX_ASPECT_RATIO}", ASPECT_RATIO)
    budget = max_pixels // (factor * factor)
    for rows in range(max(1, height // factor), 0, -1):
        # Along the ray, `rows` merged rows go with these columns; a single row takes any narrower width.
        low = 1 if rows == 1 else max(1, width * rows // height)
        high = min(max(1, width // factor), max(1, -(-width * (rows + 1) // height) - 1))
        cols = min(high, budget // (num_frames * rows) - 1 if budget > 0 else 0,
                   max_frame_pixels // (factor * factor * rows))
        if cols >= low:
            return rows * factor, cols * factor
    return factor, factor


# -- VideoLLaMA3: transformers VideoLlama3VideoProcessor ------------------------------------------


def videollama3_frame_indices(total_frames: int, video_fps: float, *, fps: float | None = 1.0,
                              num_frames: int | None = None, min_frames: int = 4, max_frames: int = 180,
                              temporal_patch_size: int = 1) -> np.ndarray:
    """VideoLlama3VideoProcessor.sample_frames: duration * fps frames clamped to [min_frames, max_frames] and to
    the frames there are, floored to the temporal patch (or `num_frames` rounded to it), spread as
    torch.arange(0, total, total / n) truncated; every frame without fps nor num_frames."""
    tps = temporal_patch_size
    if num_frames is not None:
        num_frames = round(num_frames / tps) * tps
    elif fps is not None:
        cap = math.floor(min(max_frames, total_frames) / tps) * tps
        wanted = min(max(total_frames / video_fps * fps, min_frames), cap, total_frames)
        num_frames = math.floor(wanted / tps) * tps
    if num_frames is None:
        return np.arange(total_frames, dtype=np.int64)
    if not 0 < num_frames <= total_frames:
        raise MediaError(reason=f"sampling asks for {num_frames} frames; the video has {total_frames} in range",
                         code=INVALID_OPTION if num_frames > total_frames else TOO_FEW_FRAMES)
    return float32_arange_int(total_frames, total_frames / num_frames)


# -- planning -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingPlan:
    """Which frames to take and how large to make them, before anything is decoded."""

    indices: np.ndarray  # int64 [n] frame indices on the stream's timeline
    sample_fps: float  # frames per second of the sample (qwen-vl-utils' sample_fps)
    size: Callable[[int, int], tuple[int, int]]  # upright (H, W) -> resized (h, w)
    requested_fps: float | None = None  # the fps the count was derived from (None when nframes was given)
    # What moved the count away from duration * requested fps (beyond rounding): "min_frames" raised it,
    # "max_frames" or "frame_count" (fewer frames in range than that fps needs) lowered it; None: nothing.
    fps_adjusted_by: str | None = None
    # The size a frame is resized to before it is zero-padded to `size` (the Kimi and GLM-5 processors'); None:
    # `size`.
    content_size: Callable[[int, int], tuple[int, int]] | None = None


def _fps_adjustment(wanted: float, clamped: float, cap: int, count: int) -> str | None:
    """Which bound the sampling rule clamped `wanted` frames to, if any: min_frames raised it, or the smaller
    of max_frames (`cap`) and the frames in range (`count`) lowered it."""
    if clamped > wanted:
        return "min_frames"
    if clamped < wanted:
        return "max_frames" if cap < count else "frame_count"
    return None


def plan_sampling(
    cfg: ProcessorConfig, total_frames: int, video_fps: float, options: VideoOptions | None = None
) -> SamplingPlan:
    """Frame indices and the resize rule for a video with `total_frames` frames at `video_fps`."""
    o = options or VideoOptions()
    fps, nframes, min_frames, max_frames = o.fps, o.nframes, o.min_frames, o.max_frames
    video_start, video_end = o.video_start, o.video_end
    min_pixels, max_pixels, total_pixels = o.min_pixels, o.max_pixels, o.total_pixels
    if total_frames < 1 or not video_fps > 0:
        raise MediaError(
            reason=f"the video has {total_frames} frames at {video_fps} fps", code=TOO_FEW_FRAMES
        )
    if not takes_video(cfg):
        raise MediaError(reason=f"model family {cfg.family} takes images only, not videos", code=UNSUPPORTED_FORMAT)
    vcfg = cfg.video
    adjusted: str | None = None
    first, last, count = frame_range(total_frames, video_fps, video_start, video_end)
    want_fps = vcfg.fps if fps is None else fps
    lo_px = vcfg.min_pixels if min_pixels is None else min_pixels
    factor = cfg.video_factor
    rules = video_sampling(cfg)
    dynamic = False  # the family's processor chose the rate itself (GLM-4.6V): no requested fps to report
    if rules == "qwen2":
        n = qwen2_nframes(
            count,
            video_fps,
            fps=want_fps,
            nframes=nframes,
            min_frames=vcfg.min_frames if min_frames is None else min_frames,
            max_frames=max_frames,
            default_max_frames=vcfg.max_frames,
        )
        indices = torch_linspace_round(first, last, n)
        if nframes is None:
            cap = vcfg.max_frames if max_frames is None else max_frames
            lo_n = ceil_by_factor(vcfg.min_frames if min_frames is None else min_frames, FRAME_FACTOR)
            hi_n = floor_by_factor(min(cap, count) if max_frames is None else cap, FRAME_FACTOR)
            wanted = count / video_fps * want_fps
            adjusted = _fps_adjustment(wanted, min(min(max(wanted, lo_n), hi_n), count), cap, count)
        lo, hi = qwen2_frame_pixel_bounds(
            n,
            min_pixels=lo_px,
            frame_max_pixels=vcfg.max_pixels,
            total_pixels=vcfg.total_pixels if total_pixels is None else total_pixels,
            max_pixels=max_pixels,
        )
        # A requested max_pixels below the default min_pixels: qwen-vl-utils hands both to smart_resize
        # (large frames shrink to the max, small ones grow to the min), and so does this.

        def size(height: int, width: int) -> tuple[int, int]:
            return smart_resize(height, width, factor, lo, hi)  # type: ignore[arg-type]

    elif rules == "qwen3":
        n = qwen3_num_frames(
            count,
            video_fps,
            fps=want_fps,
            num_frames=nframes,
            min_frames=vcfg.min_frames if min_frames is None else min_frames,
            max_frames=vcfg.max_frames if max_frames is None else max_frames,
        )
        if n < cfg.temporal_patch_size:
            raise MediaError(
                reason=f"{n} frame(s) sampled from {count} in range; Qwen3-VL needs at least "
                f"{cfg.temporal_patch_size}",
                code=TOO_FEW_FRAMES,
            )
        indices = np.linspace(first, last, n).round().astype(np.int64)
        if nframes is None:
            cap = vcfg.max_frames if max_frames is None else max_frames
            adjusted = _fps_adjustment(int(count / video_fps * want_fps), n, cap, count)
        hi_budget: float = vcfg.max_pixels if max_pixels is None else max_pixels
        if total_pixels is not None:
            hi_budget = min(hi_budget, total_pixels)
        hi = qwen3_max_pixels(
            n,
            factor=factor,
            min_pixels=lo_px,
            max_pixels=hi_budget,
            cap_pixels_per_frame=o.cap_pixels_per_frame,
        )
        tps = cfg.temporal_patch_size

        def size(height: int, width: int) -> tuple[int, int]:
            return qwen3_smart_resize(
                n, height, width, temporal_factor=tps, factor=factor, min_pixels=lo_px, max_pixels=hi
            )

    elif rules in ("glm4v", "glm46v", "glmga", "glm5"):
        # GLM's processor has no frame bounds: min_frames does not apply, max_frames (per request) spreads
        # that many frames over the clip when the fps rule would take more (GLMGA's and GLM-5's processors
        # bound the count themselves, by their max_frames).
        dynamic = rules == "glm46v" and nframes is None and fps is None
        bounded = rules in ("glmga", "glm5") and nframes is None
        if dynamic:  # GLM-4.6V's processor picks the rate from the clip's length; a request's fps fixes it
            indices = glm46v_frame_indices(count, video_fps, cfg.temporal_patch_size)
        elif bounded:
            cap = vcfg.max_frames if max_frames is None else max_frames
            sampler = glmga_frame_indices if rules == "glmga" else glm5_frame_indices
            indices = sampler(count, video_fps, fps=want_fps, max_frames=cap)
            wanted = int(count / video_fps * want_fps)
            adjusted = "max_frames" if wanted > cap else "frame_count" if len(np.unique(indices)) < wanted else None
        else:
            indices = glm_frame_indices(count, video_fps, fps=want_fps, nframes=nframes)
        if nframes is None and not dynamic and not bounded:
            if max_frames is not None and len(np.unique(indices)) > max_frames:
                indices, adjusted = glm_frame_indices(count, video_fps, nframes=max_frames), "max_frames"
            elif count / video_fps > GLM_MAX_DURATION:
                adjusted = "max_frames"
            elif len(np.unique(indices)) < max(math.floor(count / video_fps * want_fps), 1):
                adjusted = "frame_count"  # fps above the video's: repeated frames are dropped
        indices = first + indices
        n = len(indices)
        hi_budget = vcfg.max_pixels if max_pixels is None else max_pixels
        if total_pixels is not None:
            hi_budget = min(hi_budget, total_pixels)
        tps = cfg.temporal_patch_size

        def size(height: int, width: int) -> tuple[int, int]:
            if rules == "glm5":
                return budget_resize(n, height, width, temporal_factor=tps, factor=factor, min_pixels=lo_px,
                                     max_pixels=hi_budget)
            return clip_smart_resize(
                n, height, width, temporal_factor=tps, factor=factor, min_pixels=lo_px, max_pixels=hi_budget
            )

        if rules == "glm5":  # the frames shrink into the canvas, zeros pad the rest

            def content(height: int, width: int) -> tuple[int, int]:
                return padded_content(n, height, width, size(height, width), lo_px)

    elif rules in ("kimi", "muse"):
        # The Kimi and Muse processors (service/media/navit_sizing.py): a frame count from the rate, a cap
        # on each frame's patches or tokens (max_pixels, as pixels); min_frames does not apply.
        want = vcfg.max_frames if max_frames is None else max_frames
        if rules == "kimi":
            indices = kimi_frame_indices(count, video_fps, want_fps, nframes)
        else:
            indices = muse_frame_indices(count, video_fps, want_fps, nframes or want, cfg.temporal_patch_size)
        if nframes is None and len(indices) < max(1, int(count / video_fps * want_fps)):
            adjusted = "max_frames" if want < count else "frame_count"
        indices = first + indices
        n = len(indices)
        hi_px = vcfg.max_pixels if max_pixels is None else max_pixels
        if total_pixels is not None:
            hi_px = min(hi_px, total_pixels // max(n, 1))
        video_rules = rules

        def size(height: int, width: int) -> tuple[int, int]:
            return navit_image_size(height, width, cfg, hi_px, video_rules)[1]

        def content(height: int, width: int) -> tuple[int, int]:
            return navit_image_size(height, width, cfg, hi_px, video_rules)[0]

    elif rules == "minimax":
        # Frames a second apart (at the config's fps); a request's nframes, or more frames than max_frames,
        # spread evenly over the clip instead. Each frame is sized alone, as the image rule does.
        cap = vcfg.max_frames if max_frames is None else max_frames
        indices = minimax_frame_indices(count, video_fps, want_fps)
        if nframes is not None or len(indices) > cap:
            adjusted = None if nframes is not None else "max_frames"
            indices = np.linspace(0, count - 1, nframes or cap).round().astype(np.int64)
        elif len(indices) < max(math.floor(count / video_fps * want_fps), 1):
            adjusted = "frame_count"  # fps above the video's
        indices = first + indices
        n = len(indices)
        hi_frame = vcfg.max_pixels if max_pixels is None else max_pixels

        def size(height: int, width: int) -> tuple[int, int]:
            return smart_resize(height, width, factor, lo_px, hi_frame)

    elif rules == "ernie":
        # No rate in the config (0): every frame, within [min_frames, max_frames]; a request's fps sets one.
        rate = want_fps if want_fps and nframes is None else None
        indices = first + ernie_frame_indices(
            count, video_fps, fps=rate, num_frames=nframes,
            min_frames=vcfg.min_frames if min_frames is None else min_frames,
            max_frames=vcfg.max_frames if max_frames is None else max_frames)
        n = len(indices)
        hi_frame = vcfg.max_pixels if max_pixels is None else max_pixels

        def size(height: int, width: int) -> tuple[int, int]:
            return smart_resize(height, width, factor, lo_px, hi_frame)
    elif rules in ("hy_v4_vl", "video_llama_3"):
        lo_frames = vcfg.min_frames if min_frames is None else min_frames
        hi_frames = vcfg.max_frames if max_frames is None else max_frames
        hi_budget = vcfg.max_pixels if max_pixels is None else max_pixels
        if total_pixels is not None:
            hi_budget = min(hi_budget, total_pixels)
        if rules == "hy_v4_vl":
            indices = hy4_frame_indices(count, video_fps, fps=want_fps, num_frames=nframes, min_frames=lo_frames,
                                        max_frames=hi_frames)
        else:
            indices = videollama3_frame_indices(count, video_fps, fps=want_fps, num_frames=nframes,
                                                min_frames=lo_frames, max_frames=hi_frames,
                                                temporal_patch_size=cfg.temporal_patch_size)
        if nframes is None:
            wanted = count / video_fps * want_fps
            adjusted = _fps_adjustment(int(wanted) if rules == "hy_v4_vl" else wanted, len(indices), hi_frames, count)
        indices = first + indices
        n = len(indices)
        frame_cap = vcfg.frame_pixels or hi_budget

        def size(height: int, width: int) -> tuple[int, int]:
            if rules == "hy_v4_vl":  # frames never grow; the clip's tokens (newlines counted) fit its budget
                return hy4_frame_size(height, width, n, factor=factor, max_pixels=int(hi_budget),
                                      max_frame_pixels=frame_cap)
            return smart_resize(height, width, factor, lo_px, int(hi_budget) // n)  # the budget shared by frames

    else:
        raise ValueError(f"no video sampling rules for model family {cfg.family!r}")
    sample_fps = n / max(count, 1e-6) * video_fps
    return SamplingPlan(
        indices=indices,
        sample_fps=sample_fps,
        size=size,
        content_size=content if rules in ("kimi", "muse", "glm5") else None,
        requested_fps=None if nframes is not None or dynamic else float(want_fps),
        fps_adjusted_by=adjusted,
    )


# -- options ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoOptions:
    """One video item's options; None takes the config's video default (see `preprocess_video_bytes`)."""

    fps: float | None = None
    nframes: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    video_start: float | None = None
    video_end: float | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    max_frame_pixels: int | None = None
    cap_pixels_per_frame: bool = False

    def check(self) -> None:
        """Per-request options come from clients: refuse nonsense with a MediaError, not a crash."""
        fps, nframes, min_frames, max_frames = self.fps, self.nframes, self.min_frames, self.max_frames
        video_start, video_end = self.video_start, self.video_end
        min_pixels, max_pixels, total_pixels = self.min_pixels, self.max_pixels, self.total_pixels
        max_frame_pixels = self.max_frame_pixels

        def bad(reason: str) -> MediaError:
            return MediaError(reason=reason, code=INVALID_OPTION)

        def is_int(x: object) -> bool:
            return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return (
                isinstance(x, (int, float, np.integer, np.floating))
                and not isinstance(x, bool)
                and math.isfinite(x)
            )

        if fps is not None and nframes is not None:
            raise bad("give fps or nframes, not both")
        if fps is not None and not (is_num(fps) and fps > 0):
            raise bad(f"fps must be a positive number, got {fps!r}")
        if nframes is not None and not (is_int(nframes) and nframes >= 2):
            raise bad(f"nframes must be an integer >= 2, got {nframes!r}")
        for name, value in (("min_frames", min_frames), ("max_frames", max_frames)):
            if value is not None and not (is_int(value) and value >= 1):
                raise bad(f"{name} must be an integer >= 1, got {value!r}")
        if min_frames is not None and max_frames is not None and min_frames > max_frames:
            raise bad(f"min_frames {min_frames} is above max_frames {max_frames}")
        for name, value in (("video_start", video_start), ("video_end", video_end)):
            if value is not None and not (is_num(value) and value >= 0):
                raise bad(f"{name} must be a number of seconds >= 0, got {value!r}")
        if video_start is not None and video_end is not None and video_start >= video_end:
            raise bad(f"video_start {video_start} must be before video_end {video_end}")
        for name, value in (
            ("min_pixels", min_pixels),
            ("max_pixels", max_pixels),
            ("total_pixels", total_pixels),
            ("max_frame_pixels", max_frame_pixels),
        ):
            if value is not None and not (is_int(value) and value >= 1):
                raise bad(f"{name} must be an integer >= 1, got {value!r}")
        if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
            raise bad(f"min_pixels {min_pixels} is above max_pixels {max_pixels}")
