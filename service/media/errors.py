"""The one exception media decoding and preprocessing raise for bad input.

Images and videos share it so the API layer can map every client-side media problem to one
4xx response carrying a stable machine code and a human readable reason.
"""

from __future__ import annotations

# Codes used by the image path; the video path adds its own (e.g. "corrupt_video").
EMPTY = "empty"
UNSUPPORTED_FORMAT = "unsupported_format"
CORRUPT_IMAGE = "corrupt_image"
TOO_LARGE = "too_large"
TOO_SMALL = "too_small"
ASPECT_RATIO = "aspect_ratio"
INVALID_PIXEL_BOUNDS = "invalid_pixel_bounds"


class MediaError(ValueError):
    """Input media that cannot be used: corrupt, unsupported, too large, badly shaped...

    reason: human readable, safe to return to the client.
    code: short machine code, stable across releases (see the constants in this module).
    """

    client_error = True  # the input's fault: worker processes hand it back as it is

    def __init__(self, reason: str, code: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code

    def __str__(self) -> str:
        return f"{self.reason} [{self.code}]"

    def __reduce__(self) -> tuple[type[MediaError], tuple[str, str]]:
        # Keep both fields when pickled across process pools.
        return (type(self), (self.reason, self.code))

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "reason": self.reason}

