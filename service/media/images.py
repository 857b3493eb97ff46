"""Untrusted bytes -> RGB `PIL.Image`, or a `MediaError` saying why not.

Only bytes are accepted (never a path). The format is sniffed from magic bytes and Pillow is
restricted to that one plugin, so exotic or dangerous decoders (EPS/Ghostscript, ...) are never
reached. Size is checked from the header before any pixel is decoded, and truncated files fail
(`ImageFile.LOAD_TRUNCATED_IMAGES` is left alone).

RGB conversion follows the transformers processors' `convert_to_rgb`: anything with an alpha band
or a `transparency` entry is alpha-composited onto opaque white, everything else goes through
`Image.convert("RGB")`. For RGBA this is pixel-identical to qwen-vl-utils' `to_rgb` (paste with the
alpha mask); qwen-vl-utils drops LA/PA/P-transparency alpha instead, we composite it like the
transformers reference the parity tests compare against.
"""

from __future__ import annotations

import io

from PIL import Image

from service.media.errors import (
    CORRUPT_IMAGE,
    EMPTY,
    TOO_LARGE,
    UNSUPPORTED_FORMAT,
    MediaError,
)

SUPPORTED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")

# 8192 x 8192: generous for real photos, below Pillow's own bomb warning (~89.5 MP).
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192

_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"II+\x00", "TIFF"),  # BigTIFF
    (b"MM\x00+", "TIFF"),
)


def sniff_format(data: bytes | bytearray | memoryview) -> str | None:
    """The supported format the magic bytes announce, or None."""
    head = bytes(data[:16])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    for magic, fmt in _SIGNATURES:
        if head.startswith(magic):
            return fmt
    return None


def _describe_unknown(head: bytes) -> str:
    """Best-effort name for unsupported input, so the error tells the client what it sent."""
    if head.startswith(b"%PDF"):
        return "a PDF document"
    if head[4:8] == b"ftyp":
        return "an ISO-BMFF file (HEIC/AVIF image or MP4/MOV video)"
    if head.startswith(b"\x00\x00\x01\x00"):
        return "an ICO icon"
    if head.startswith(b"8BPS"):
        return "a Photoshop document"
    if head.startswith((b"\x00\x00\x00\x0cjP  ", b"\xff\x4f\xff\x51")):
        return "a JPEG 2000 image"
    if head.startswith(b"PK\x03\x04"):
        return "a ZIP archive"
    stripped = head.lstrip()
    if stripped.startswith((b"<svg", b"<?xml", b"<!DOCTYPE", b"<html", b"<HTML")):
        return "an XML/HTML/SVG document"
    # Retry without up to 3 trailing bytes: the 16-byte window may cut a UTF-8 sequence.
    for cut in range(4):
        try:
            text = head[: len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if all(ch.isprintable() or ch.isspace() for ch in text):
            return "text"
        break
    return "unrecognised binary data"


def has_alpha(image: Image.Image) -> bool:
    """Whether the image carries transparency that has to be composited (reference predicate)."""
    return "A" in image.getbands() or image.info.get("transparency") is not None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB view of `image`: transparency composited onto white, other modes converted.

    Returns `image` itself when it is already plain RGB, avoiding a copy on the hot path.
    """
    if has_alpha(image):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if image.mode == "RGB":
        return image
    return image.convert("RGB")


def _effective_limit(max_image_pixels: int) -> int:
    # Anything Pillow would warn about as a bomb is refused too, whatever the caller asked for.
    pil_limit = Image.MAX_IMAGE_PIXELS
    return max_image_pixels if pil_limit is None else min(max_image_pixels, int(pil_limit))


def _too_large(width: int, height: int, limit: int) -> MediaError:
    return MediaError(
        f"image is {width}x{height} = {width * height} pixels, above the limit of {limit} pixels",
        TOO_LARGE,
    )


def decode_image(
    data: bytes | bytearray | memoryview, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> Image.Image:
    """Decode an encoded image (JPEG, PNG, WebP, GIF first frame, BMP, TIFF first page) to RGB.

    Raises MediaError with code "empty", "unsupported_format", "corrupt_image" (also truncated)
    or "too_large" (header size above `max_image_pixels`, or a Pillow decompression bomb).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        # A str would be a path or base64: both are the caller's job, never ours.
        raise TypeError(f"decode_image takes the encoded bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise MediaError("no image data: the input is empty", EMPTY)
    fmt = sniff_format(data)
    if fmt is None:
        raise MediaError(
            f"unsupported format: input looks like {_describe_unknown(bytes(data[:16]))}, "
            f"expected one of {', '.join(SUPPORTED_FORMATS)}",
            UNSUPPORTED_FORMAT,
        )
    limit = _effective_limit(max_image_pixels)
    try:
        # Lazy: reads only the header; formats=[fmt] keeps every other plugin out of the way.
        image = Image.open(io.BytesIO(data), formats=[fmt])
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(f"image header claims a decompression bomb: {exc}", TOO_LARGE) from exc
    except Exception as exc:  # Pillow raises many types on hostile headers; all mean "corrupt".
        raise MediaError(
            f"{fmt} data is corrupt or truncated: cannot read its header", CORRUPT_IMAGE
        ) from exc

    width, height = image.size
    if width <= 0 or height <= 0:
        raise MediaError(f"{fmt} header declares an empty {width}x{height} image", CORRUPT_IMAGE)
    if width * height > limit:
        raise _too_large(width, height, limit)

    try:
        image.load()  # first frame / page only
        rgb = to_rgb(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(f"image frame is a decompression bomb: {exc}", TOO_LARGE) from exc
    except Exception as exc:
        raise MediaError(f"{fmt} data is corrupt or truncated: {exc}", CORRUPT_IMAGE) from exc
    if rgb.width * rgb.height > limit:  # GIF frames may grow the canvas past the header size
        raise _too_large(rgb.width, rgb.height, limit)
    return rgb
