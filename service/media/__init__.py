"""Media decoding: untrusted bytes in, RGB images (and, from the video module, frames) out."""

from service.media.errors import MediaError
from service.media.images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    SUPPORTED_FORMATS,
    decode_image,
    sniff_format,
    to_rgb,
)

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "SUPPORTED_FORMATS",
    "MediaError",
    "decode_image",
    "sniff_format",
    "to_rgb",
]
