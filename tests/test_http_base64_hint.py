"""The "looks like a file path" hint of a malformed base64 media field appears only for values that are paths."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from service.http.errors import ApiError
from service.http.parsing import b64decode, looks_like_path

HINT = "file path"


def jpeg_b64() -> str:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8))
    out = io.BytesIO()
    image.save(out, "JPEG")
    return base64.b64encode(out.getvalue()).decode()


def message(value: str) -> str:
    with pytest.raises(ApiError) as err:
        b64decode(value, 3)
    assert err.value.code == "invalid_base64" and err.value.index == 3 and err.value.status == 422
    return err.value.message


@pytest.mark.parametrize(
    "value",
    [
        "/tmp/photo.jpg",
        "/home/me/My Pictures/cat.png",
        "./photo.jpg",
        "../frames/0001.png",
        "~/Pictures/cat.png",
        "C:\\Users\\me\\cat.png",
        "c:/data/clip.mp4",
        ".\\clip.mp4",
    ],
)
def test_paths_get_the_hint(value: str) -> None:
    assert looks_like_path(value)
    assert HINT in message(value)


def test_broken_jpeg_base64_gets_no_path_hint() -> None:
    good = jpeg_b64()
    assert good.startswith("/9j/")  # what made every broken JPEG look like a path
    assert base64.b64decode(good)[:3] == b"\xff\xd8\xff"
    broken = [
        good[: len(good) - len(good) % 4 - 3],  # cut: a length no padding repairs
        good[:40] + "!" + good[40:],  # a character base64 has not
        good[:20] + "." + good[20:],  # even a dot, as in a file name
        good[:25],  # a short, cut upload
    ]
    for value in broken:
        assert not looks_like_path(value), value[:30]
        text = message(value)
        assert HINT not in text and "base64" in text


@pytest.mark.parametrize(
    "value",
    [
        "not base64 at all!",
        "hello world.",
        "data/photo.jpg",  # relative without ./: could be anything, no guess
        "/" + "A" * 2000 + ".jpg",  # far too long for a path
        "/tmp/a.jpg\n/tmp/b.jpg",  # several lines
    ],
)
def test_other_invalid_values_get_no_hint(value: str) -> None:
    assert not looks_like_path(value)
    assert HINT not in message(value)


def test_valid_base64_still_decodes() -> None:
    good = jpeg_b64()
    assert b64decode(good, 0)[:3] == b"\xff\xd8\xff"
    url_safe = good.replace("+", "-").replace("/", "_").rstrip("=")
    assert b64decode(url_safe, 0) == b64decode(good, 0)
