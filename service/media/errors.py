"""The one exception media decoding and preprocessing raise for bad input, and its codes.

Images and videos share it so the API layer can map every client-side media problem to one
4xx response carrying a stable machine code and a human readable reason. `HTTP_STATUS` says which
status each code should map to: 413 when the item is well-formed but asks for more than this
server's limits allow (size, frames, decoding work, tokens), 422 when it is invalid or damaged.
"""

from __future__ import annotations

# -- invalid or damaged input (422) ---------------------------------------------------------------
EMPTY = "empty"
UNSUPPORTED_FORMAT = "unsupported_format"
CORRUPT_IMAGE = "corrupt_image"
TOO_SMALL = "too_small"
ASPECT_RATIO = "aspect_ratio"
INVALID_PIXEL_BOUNDS = "invalid_pixel_bounds"
CORRUPT_VIDEO = "corrupt_video"
TRUNCATED_VIDEO = "truncated_video"
NO_VIDEO_STREAM = "no_video_stream"
UNSUPPORTED_CODEC = "unsupported_codec"
TOO_FEW_FRAMES = "too_few_frames"
INVALID_OPTION = "invalid_option"

# -- above a limit of this server (413) -----------------------------------------------------------
TOO_LARGE = "too_large"  # image header above max_image_pixels, or a decompression bomb
TOO_MANY_PIXELS = "too_many_pixels"  # a video frame above max_frame_pixels
TOO_MANY_FRAMES = "too_many_frames"  # the video stream holds more frames than max_stream_frames
TOO_MUCH_WORK = "too_much_work"  # decoding needs more frames or pixels than max_decoded_frames/pixels
TOO_MANY_ITEM_TOKENS = "too_many_item_tokens"  # the item's grid has more merged tokens than max_tokens

HTTP_STATUS: dict[str, int] = {
    **dict.fromkeys(
        (
            EMPTY,
            UNSUPPORTED_FORMAT,
            CORRUPT_IMAGE,
            TOO_SMALL,
            ASPECT_RATIO,
            INVALID_PIXEL_BOUNDS,
            CORRUPT_VIDEO,
            TRUNCATED_VIDEO,
            NO_VIDEO_STREAM,
            UNSUPPORTED_CODEC,
            TOO_FEW_FRAMES,
            INVALID_OPTION,
        ),
        422,
    ),
    **dict.fromkeys((TOO_LARGE, TOO_MANY_PIXELS, TOO_MANY_FRAMES, TOO_MUCH_WORK, TOO_MANY_ITEM_TOKENS), 413),
}


def http_status(code: str) -> int:
    """The HTTP status a media error code maps to (422 for codes this module does not know)."""
    return HTTP_STATUS.get(code, 422)


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

    @property
    def status(self) -> int:
        """The HTTP status this error should be answered with (see `HTTP_STATUS`)."""
        return http_status(self.code)

    def __str__(self) -> str:
        return f"{self.reason} [{self.code}]"

    def __reduce__(self) -> tuple[type[MediaError], tuple[str, str]]:
        # Keep both fields when pickled across process pools.
        return (type(self), (self.reason, self.code))

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "reason": self.reason}

