"""Qwen-VL image preprocessing on the host: RGB image -> uint8 patches in the reference row order.

Parity targets: transformers' `Qwen2VLImageProcessorPil` (used by Qwen2-VL, Qwen2.5-VL and Qwen3-VL
checkpoints), `Glm4vImageProcessorPil` (GLM-4.1V, GLM-4.5V, GLM-OCR; Cosmos3-Edge's sizes images the same
way), `Glm5NextImageProcessor` and `PaddleOCRVLImageProcessorPil`, which differ in how they size an image
(`smart_resize`, `clip_smart_resize`, `budget_resize` with the content zero-padded, `upscaled_smart_resize`;
`service.media.rules` picks one) and in how they lay out a
patch row (`ProcessorConfig.patch_layout` / `patch_order`, service/media/patch_layout.py). The
reference converts to RGB, resizes the *uint8* image with PIL bicubic to that size, then
rescales/normalises in float and patchifies. Resizing happens on uint8, so
we can stop before the float work and ship the resized uint8 patches: `ProcessorConfig.normalize`
(host) or the device applies rescale + mean/std afterwards with the same result.

Contract (stable; safe in a worker process): `preprocess_image_bytes(data, cfg, min_pixels=None,
max_pixels=None, *, limits=None) -> VisualInput`, every failure a `MediaError` with a code; `limits`
(`MediaLimits`) bounds the header's size (`max_image_pixels`) and the grid's tokens (`max_tokens`),
both checked before any pixel is decoded. `service.media.estimate.estimate_image` gives the same grid
from the header alone.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from models.config import ProcessorConfig, VisualInput
from service.media.errors import (
    ASPECT_RATIO,
    INVALID_PIXEL_BOUNDS,
    TOO_FEW_FRAMES,
    TOO_MANY_ITEM_TOKENS,
    TOO_SMALL,
    MediaError,
)
from service.media.images import ImageHeader, decode_image, has_alpha, read_header, to_rgb
from service.media.limits import DEFAULT_LIMITS, MediaLimits
from service.media.navit_sizing import kimi_size, muse_size, resize_bicubic_antialias, resize_image
from service.media.patch_layout import image_rows, is_qwen_layout
from service.media.rules import family_extra, image_resize, image_sizing

MAX_ASPECT_RATIO = 200
# Sizings whose content is resized to less than the grid's canvas and zero-padded to it (`resize_image`)
PADDED_SIZINGS = ("kimi", "muse", "glm5")


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels, max_pixels] when the
    aspect ratio allows, aspect ratio kept as closely as possible.

    Same arithmetic as transformers' Qwen2-VL `smart_resize` (Python `round`, i.e. half to even,
    then floor when shrinking and ceil when growing), so token counts match the reference exactly.
    Differences are only where the reference fails or returns an unusable size: a zero input side
    or a zero output side (possible with min_pixels=0) raise MediaError "too_small".
    """
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    if height <= 0 or width <= 0:
        raise MediaError(f"image is {width}x{height}: it has no pixels", TOO_SMALL)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise MediaError(
            f"aspect ratio {ratio:.1f} of a {width}x{height} image is above the limit of {MAX_ASPECT_RATIO}",
            ASPECT_RATIO,
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar <= 0 or w_bar <= 0:
        raise MediaError(
            f"image {width}x{height} is too small: a side rounds to 0 at a multiple of {factor} "
            f"(min_pixels={min_pixels})",
            TOO_SMALL,
        )
    return h_bar, w_bar


def upscaled_smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 384 * 384, max_pixels: int = 1536 * 1536
) -> tuple[int, int]:
    """PaddleOCR-VL's `smart_resize`: a side below `factor` is first scaled up to it, the other side with it
    (Python `round`), then `smart_resize` as Qwen2-VL's."""
    if height <= 0 or width <= 0:
        raise MediaError(f"image is {width}x{height}: it has no pixels", TOO_SMALL)
    if height < factor:
        width, height = round(width * factor / height), factor
    if width < factor:
        height, width = round(height * factor / width), factor
    return smart_resize(height, width, factor, min_pixels, max_pixels)


def clip_smart_resize(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int = 2,
    factor: int = 28,
    min_pixels: float = 112 * 112,
    max_pixels: float = 14 * 14 * 2 * 2 * 2 * 6144,
) -> tuple[int, int]:
    """Target (height, width) of the frames of a clip: multiples of `factor`, with T*H*W (T rounded to
    `temporal_factor`) kept within [min_pixels, max_pixels] by one scale of H and W.

    Same arithmetic as transformers' GLM-4.1V `smart_resize` (images are clips of `temporal_factor`
    frames there) and Qwen3-VL's video one: frames with a side below `factor` are first scaled up so
    that side reaches it (truncating), then rounded as in `smart_resize`, with beta computed from the
    unrounded frame count.
    """
    if num_frames < temporal_factor:
        raise MediaError(f"{num_frames} frame(s); at least {temporal_factor} are needed", TOO_FEW_FRAMES)
    if height <= 0 or width <= 0:
        raise MediaError(f"image is {width}x{height}: it has no pixels", TOO_SMALL)
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / max(min(height, width), 1)
    if ratio > MAX_ASPECT_RATIO or min(height, width) == 0:
        raise MediaError(
            f"aspect ratio {ratio:.1f} of {width}x{height} pixels is above the limit of {MAX_ASPECT_RATIO}",
            ASPECT_RATIO,
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def budget_resize(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int = 2,
    factor: int = 28,
    min_pixels: float = 16 * 2 * 28 * 28,
    max_pixels: float = 8000 * 2 * 28 * 28,
) -> tuple[int, int]:
    """The canvas (height, width) of GLM-5's processors: sides rounded UP to multiples of `factor`, T*H*W (T
    rounded to `temporal_factor`, at least one temporal patch) at least `min_pixels` (scaled up, as in
    `clip_smart_resize`) and at most `max_pixels`: the largest canvas of the content's aspect ratio under that
    bound, found by bisection over the content's height. The content itself keeps its size or shrinks into
    the canvas (`padded_content`); the rest is zero padding.

    Same arithmetic as transformers' Glm5NextImageProcessor `smart_resize`, whose bounds are in tokens of
    temporal_factor * factor**2 pixels: min_image_tokens and max_image_tokens times that.
    """
    if height <= 0 or width <= 0:
        raise MediaError(f"image is {width}x{height}: it has no pixels", TOO_SMALL)
    frames = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)
    h_bar, w_bar = math.ceil(height / factor) * factor, math.ceil(width / factor) * factor
    if frames * h_bar * w_bar < min_pixels:
        scale = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(max(1, math.ceil(height * scale)) / factor) * factor
        w_bar = math.ceil(max(1, math.ceil(width * scale)) / factor) * factor
    if frames * h_bar * w_bar <= max_pixels:
        return h_bar, w_bar
    if max_pixels < frames * factor * factor:
        raise MediaError(
            f"max_pixels={max_pixels:g} is below one {factor}x{factor} patch of {frames} frames", INVALID_PIXEL_BOUNDS
        )
    low, high, best = 1, height, (factor, factor)
    while low <= high:
        content_h = (low + high) // 2
        content_w = max(1, math.floor(width * content_h / height))
        canvas = (math.ceil(content_h / factor) * factor, math.ceil(content_w / factor) * factor)
        if frames * canvas[0] * canvas[1] <= max_pixels:
            best, low = canvas, content_h + 1
        else:
            high = content_h - 1
    return best


def padded_content(num_frames: int, height: int, width: int, canvas: tuple[int, int], min_pixels: float
                   ) -> tuple[int, int]:
    """The (height, width) GLM-5's processors resize the content to before padding it to `canvas` (bottom and
    right, zeros): the canvas's scale for the tighter side, never enlarging unless the clip (num_frames *
    height * width) is below `min_pixels`."""
    scale = min(canvas[0] / height, canvas[1] / width)
    if num_frames * height * width >= min_pixels:
        scale = min(1.0, scale)
    return max(1, min(canvas[0], math.floor(height * scale))), max(1, min(canvas[1], math.floor(width * scale)))


def patchify(image: Image.Image, patch_size: int, merge_size: int, temporal_patch_size: int) -> np.ndarray:
    """uint8 [grid_h*grid_w, 3*T*P*P] patches of an RGB image whose sides are multiples of P*merge.

    Row order is the reference's: merge_size x merge_size blocks contiguous, blocks row-major;
    within a row (C, T, P, P), the single frame repeated T times.
    """
    if image.mode != "RGB":
        raise ValueError(f"patchify needs an RGB image, got mode {image.mode}")
    width, height = image.size
    p, m, t = patch_size, merge_size, temporal_patch_size
    if height % (p * m) or width % (p * m):
        raise ValueError(f"{width}x{height} is not a multiple of patch_size*merge_size={p * m}")
    grid_h, grid_w = height // p, width // p
    blocks_h, blocks_w = grid_h // m, grid_w // m
    out = np.empty((blocks_h, blocks_w, m, m, 3, t, p * p), np.uint8)
    # Move whole patch rows (P contiguous bytes in both layouts) as one opaque item: numpy then
    # copies P x fewer elements than a uint8 gather. Pillow's per-band packer gives the planar
    # layout directly, ~10x faster than tobytes()/np.asarray on RGB followed by a transpose.
    row = np.dtype((np.void, p))
    dst = out.view(row).reshape(blocks_h, blocks_w, m, m, 3, t, p)
    for channel, band in enumerate("RGB"):
        plane = np.frombuffer(image.tobytes("raw", band), dtype=row).reshape(blocks_h, m, p, blocks_w, m)
        # (bh, mh, ph, bw, mw) -> (bh, bw, mh, mw, ph), written to the first temporal slot.
        dst[:, :, :, :, channel, 0] = plane.transpose(0, 3, 1, 4, 2)
    # The other temporal slots repeat the frame: copy whole P*P patches, not rows.
    patches = out.view(np.dtype((np.void, p * p)))[..., 0]
    for k in range(1, t):
        patches[..., k] = patches[..., 0]
    return out.reshape(grid_h * grid_w, 3 * t * p * p)


def image_grid(
    height: int, width: int, cfg: ProcessorConfig, min_pixels: int | None = None, max_pixels: int | None = None
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """((resized h, w), grid_thw) of a height x width image under the config's bounds (overridable); for the
    sizings that pad (`PADDED_SIZINGS`), the size the content is resized to, the grid covering the canvas.

    For the GLM families the bounds are the processor's `size.shortest_edge` / `longest_edge`, which bound
    T*H*W with T = temporal_patch_size (an image is a clip of T identical frames there).
    """
    lo, hi = _pixel_bounds(cfg, min_pixels, max_pixels)
    sizing = image_sizing(cfg)
    if sizing in ("kimi", "muse"):
        (new_h, new_w), (pad_h, pad_w) = navit_image_size(height, width, cfg, hi)
        return (new_h, new_w), (1, pad_h // cfg.patch_size, pad_w // cfg.patch_size)
    if sizing == "glm5":  # the content's size on a canvas the grid covers (zeros pad the rest)
        tps = cfg.temporal_patch_size
        canvas = budget_resize(tps, height, width, temporal_factor=tps, factor=cfg.factor, min_pixels=lo,
                               max_pixels=hi)
        return padded_content(tps, height, width, canvas, lo), (1, canvas[0] // cfg.patch_size,
                                                                canvas[1] // cfg.patch_size)
    if sizing == "glm4v":
        tps = cfg.temporal_patch_size
        new_h, new_w = clip_smart_resize(
            tps, height, width, temporal_factor=tps, factor=cfg.factor, min_pixels=lo, max_pixels=hi
        )
    elif sizing == "paddleocr_vl":
        new_h, new_w = upscaled_smart_resize(height, width, cfg.factor, lo, hi)
    else:
        new_h, new_w = smart_resize(height, width, cfg.factor, lo, hi)
    return (new_h, new_w), (1, new_h // cfg.patch_size, new_w // cfg.patch_size)


def navit_image_size(height: int, width: int, cfg: ProcessorConfig, max_pixels: int, rule: str | None = None
                     ) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (padded h, w)) under the Kimi and Muse processors' rules (service/media/navit_sizing.py),
    whose caps are kept as pixels: Kimi's patches of a frame x patch**2, Muse's merged tokens x factor**2."""
    if height <= 0 or width <= 0:
        raise MediaError(f"image is {width}x{height}: it has no pixels", TOO_SMALL)
    if (rule or image_sizing(cfg)) == "kimi":
        p = cfg.patch_size
        side = family_extra(cfg).get("max_side_patches", 512)
        return kimi_size(height, width, p, cfg.merge_size, max(1, max_pixels // (p * p)), side)
    size = muse_size(height, width, cfg.factor, max(1, max_pixels // (cfg.factor * cfg.factor)))
    return size, size


def check_tokens(grid: tuple[int, int, int], cfg: ProcessorConfig, max_tokens: int) -> int:
    """Merged tokens of `grid`; MediaError "too_many_item_tokens" above `max_tokens`."""
    tokens = grid[0] * grid[1] * grid[2] // (cfg.merge_size * cfg.merge_size)
    if tokens > max_tokens:
        raise MediaError(
            f"the image would be {tokens} tokens (grid {grid[1]}x{grid[2]}), above the limit of {max_tokens} "
            "per item: ask for fewer pixels (max_pixels)",
            TOO_MANY_ITEM_TOKENS,
        )
    return tokens


def _pixel_bounds(cfg: ProcessorConfig, min_pixels: int | None, max_pixels: int | None) -> tuple[int, int]:
    lo = cfg.min_pixels if min_pixels is None else int(min_pixels)
    hi = cfg.max_pixels if max_pixels is None else int(max_pixels)
    # Per-request overrides arrive from clients, so they are a media error, not a crash.
    if lo < 0 or hi < 1:
        raise MediaError(
            f"invalid pixel bounds min_pixels={lo}, max_pixels={hi}: need min >= 0 and max >= 1",
            INVALID_PIXEL_BOUNDS,
        )
    return lo, hi


def preprocess_image(
    image: Image.Image,
    cfg: ProcessorConfig,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    max_tokens: int | None = None,
) -> VisualInput:
    """One image -> VisualInput(pixels uint8 [gh*gw, C*T*P*P], grid_thw (1, gh, gw)).

    `min_pixels`/`max_pixels` override the config's bounds for this item only; a grid of more than
    `max_tokens` merged tokens is refused before resizing.
    """
    if cfg.in_channels != 3:
        raise ValueError(f"images are RGB, the config wants {cfg.in_channels} channels")
    width, height = image.size
    (new_h, new_w), grid = image_grid(height, width, cfg, min_pixels, max_pixels)
    if max_tokens is not None:
        check_tokens(grid, cfg, max_tokens)
    if image.mode != "RGB" or has_alpha(image):
        image = to_rgb(image)
    padded = (grid[1] * cfg.patch_size, grid[2] * cfg.patch_size)
    if image_sizing(cfg) in PADDED_SIZINGS:
        image = resize_image(image, image_sizing(cfg), (new_h, new_w), padded)
    elif (new_w, new_h) != (width, height) and image_resize(cfg) == "torch":
        image = Image.fromarray(resize_bicubic_antialias(np.asarray(image), new_h, new_w))
    elif (new_w, new_h) != (width, height):
        # Same call as the reference PIL backend (uint8 RGB, bicubic, no reducing_gap); when the size
        # already fits the reference resizes to the same size, which is a plain copy, so we skip it.
        image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    if is_qwen_layout(cfg):
        pixels = patchify(image, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    else:  # the family's own row layout (service/media/patch_layout.py)
        pixels = image_rows(np.asarray(image), cfg)
    return VisualInput(
        modality="image",
        pixels=pixels,
        grid_thw=grid,
        meta={"orig_size": (height, width), "resized": (new_h, new_w)},
    )


def preprocess_image_bytes(
    data: bytes | bytearray | memoryview,
    cfg: ProcessorConfig,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    *,
    limits: MediaLimits | None = None,
    max_image_pixels: int | None = None,
    header: ImageHeader | None = None,
) -> VisualInput:
    """Decode encoded image bytes and preprocess them; every bad or over-limit input raises MediaError.

    limits: per-item bounds (defaults if None); max_image_pixels, if given, overrides its image size limit.
    The header's size and the grid's tokens are checked before any pixel is decoded. `header`: what
    `read_header` returned for these bytes and that size limit (the estimate's), to skip reading it again.
    """
    limits = limits or DEFAULT_LIMITS
    size_limit = limits.max_image_pixels if max_image_pixels is None else max_image_pixels
    header = header or read_header(data, size_limit)
    _, grid = image_grid(header.height, header.width, cfg, min_pixels, max_pixels)
    check_tokens(grid, cfg, limits.max_tokens)
    image = decode_image(data, size_limit, header=header)
    return preprocess_image(image, cfg, min_pixels, max_pixels, max_tokens=limits.max_tokens)
