"""Media decoding: untrusted bytes in, RGB images (and, from the video module, frames) out.

Where things are: `images` / `video` decode, `image_preprocess` / `video_preprocess` turn decoded media
into patches, `estimate` prices an item from its header before decoding, `limits` holds what one item may
cost, `errors` the one exception and its codes (with the HTTP status each maps to). Importing this package
does not import PyAV; the video modules do.
"""

from service.media.errors import HTTP_STATUS, MediaError, http_status
from service.media.images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    SUPPORTED_FORMATS,
    decode_image,
    sniff_format,
    to_rgb,
)
from service.media.limits import DEFAULT_LIMITS, MediaLimits

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "HTTP_STATUS",
    "SUPPORTED_FORMATS",
    "MediaError",
    "MediaLimits",
    "decode_image",
    "http_status",
    "sniff_format",
    "to_rgb",
]
