"""Text drawn on video frames before they are resized, where a family's processor does so.

ERNIE-4.5-VL's video processor writes each sampled frame's time ("time: HH:MM:SS.ss", from the frame's
index and the video's frame rate) in its top-left corner: black text with a white outline, in the font that
ships with the checkpoint, a tenth of the frame's shorter side high. The same Pillow calls on the same
uint8 RGB frame draw the same pixels.
"""

from __future__ import annotations

from functools import lru_cache

from PIL import Image, ImageDraw, ImageFont

SIZE_FACTOR = 0.1  # text height over the frame's shorter side; outline width over the text height


def time_label(seconds: float) -> str:
    hours, seconds = seconds // 3600, seconds % 3600
    minutes, seconds = seconds // 60, seconds % 60
    return f"time: {int(hours):02d}:{int(minutes):02d}:{seconds:05.02f}"


@lru_cache(maxsize=16)
def _font(path: str, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(path, size)


def draw_label(image: Image.Image, text: str, font_path: str) -> Image.Image:
    """`text` drawn in place on an RGB image (returned)."""
    size = int(min(*image.size) * SIZE_FACTOR)
    ImageDraw.Draw(image).text((0, 0), text, font=_font(font_path, size), fill=(0, 0, 0),
                               stroke_width=int(size * SIZE_FACTOR), stroke_fill=(255, 255, 255))
    return image
