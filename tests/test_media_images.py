"""Image decoding: supported formats round-trip, alpha compositing, and every failure is a MediaError."""

from __future__ import annotations

import io
import pickle
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile, PngImagePlugin

from models.config import ProcessorConfig
from service.media import DEFAULT_MAX_IMAGE_PIXELS, MediaError, decode_image, sniff_format, to_rgb
from service.media.image_preprocess import preprocess_image_bytes


def encode(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kwargs)
    return out.getvalue()


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height with almost no data: a cheap decompression bomb."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + png_chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def rgb_array() -> np.ndarray:
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:48, 0:64]
    base = np.stack([yy * 5, xx * 4, (yy + xx) * 2], -1) + rng.integers(0, 20, (48, 64, 3))
    return np.clip(base, 0, 255).astype(np.uint8)


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize(
    ("fmt", "kwargs"),
    [
        ("PNG", {}),
        ("WEBP", {"lossless": True}),
        ("BMP", {}),
        ("TIFF", {}),
        ("TIFF", {"compression": "tiff_lzw"}),
        ("TIFF", {"compression": "tiff_adobe_deflate"}),
    ],
)
def test_lossless_formats_round_trip(rgb_array: np.ndarray, fmt: str, kwargs: dict) -> None:
    data = encode(Image.fromarray(rgb_array, "RGB"), fmt, **kwargs)
    assert sniff_format(data) == fmt
    image = decode_image(data)
    assert image.mode == "RGB" and image.size == (64, 48)
    np.testing.assert_array_equal(np.asarray(image), rgb_array)


def test_gif_round_trips_exactly_with_few_colours(rgb_array: np.ndarray) -> None:
    paletted = Image.fromarray(rgb_array, "RGB").quantize(200)
    expected = np.asarray(paletted.convert("RGB"))
    image = decode_image(encode(paletted, "GIF"))
    assert image.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(image), expected)


def test_jpeg_round_trips_closely(rgb_array: np.ndarray) -> None:
    data = encode(Image.fromarray(rgb_array, "RGB"), "JPEG", quality=95)
    image = decode_image(data)
    assert image.mode == "RGB" and image.size == (64, 48)
    assert np.abs(np.asarray(image, np.int16) - rgb_array).mean() < 8  # noisy content, q95
    # Same pixels as a plain Pillow decode: we never use draft mode or other shortcuts.
    np.testing.assert_array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def test_lossy_webp_and_grayscale_jpeg(rgb_array: np.ndarray) -> None:
    assert decode_image(encode(Image.fromarray(rgb_array, "RGB"), "WEBP", quality=80)).mode == "RGB"
    gray = decode_image(encode(Image.fromarray(rgb_array[..., 0], "L"), "JPEG"))
    arr = np.asarray(gray)
    assert gray.mode == "RGB" and (arr[..., 0] == arr[..., 1]).all() and (arr[..., 1] == arr[..., 2]).all()


def test_cmyk_jpeg_converts_like_pillow(rgb_array: np.ndarray) -> None:
    data = encode(Image.fromarray(rgb_array, "RGB").convert("CMYK"), "JPEG", quality=95)
    expected = Image.open(io.BytesIO(data)).convert("RGB")
    np.testing.assert_array_equal(np.asarray(decode_image(data)), np.asarray(expected))


def test_gif_first_frame_only() -> None:
    frames = [Image.new("RGB", (16, 8), color) for color in [(255, 0, 0), (0, 0, 255), (0, 255, 0)]]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    arr = np.asarray(decode_image(data))
    assert (arr == [255, 0, 0]).all()


def test_tiff_first_page_only() -> None:
    pages = [Image.new("RGB", (16, 8), (10, 20, 30)), Image.new("RGB", (32, 32), (200, 100, 0))]
    data = encode(pages[0], "TIFF", save_all=True, append_images=pages[1:])
    image = decode_image(data)
    assert image.size == (16, 8) and (np.asarray(image) == [10, 20, 30]).all()


def test_accepts_bytearray_and_memoryview(rgb_array: np.ndarray) -> None:
    data = encode(Image.fromarray(rgb_array, "RGB"), "PNG")
    for buf in (bytearray(data), memoryview(data)):
        np.testing.assert_array_equal(np.asarray(decode_image(buf)), rgb_array)


def test_never_takes_a_path(tmp_path) -> None:
    path = tmp_path / "x.png"
    path.write_bytes(encode(Image.new("RGB", (8, 8)), "PNG"))
    with pytest.raises(TypeError):
        decode_image(str(path))  # type: ignore[arg-type]


# ---------------------------------------------------------------- transparency


def test_rgba_composited_on_white() -> None:
    arr = np.zeros((2, 3, 4), np.uint8)
    arr[0, 0] = (255, 0, 0, 255)  # opaque red stays red
    arr[0, 1] = (255, 0, 0, 0)  # fully transparent -> white
    arr[0, 2] = (0, 0, 0, 128)  # half transparent black -> mid gray
    arr[1] = (0, 100, 200, 255)
    out = np.asarray(decode_image(encode(Image.fromarray(arr, "RGBA"), "PNG")))
    assert tuple(out[0, 0]) == (255, 0, 0)
    assert tuple(out[0, 1]) == (255, 255, 255)
    assert all(126 <= v <= 128 for v in out[0, 2])
    assert (out[1] == (0, 100, 200)).all()


def test_rgba_matches_qwen_vl_utils_paste_compositing() -> None:
    """qwen-vl-utils pastes RGBA on white with the alpha mask; alpha_composite gives the same pixels."""
    arr = np.random.default_rng(4).integers(0, 256, (40, 50, 4), dtype=np.uint8)
    rgba = Image.fromarray(arr, "RGBA")
    pasted = Image.new("RGB", rgba.size, (255, 255, 255))
    pasted.paste(rgba, mask=rgba.split()[3])
    np.testing.assert_array_equal(np.asarray(to_rgb(rgba)), np.asarray(pasted))


def test_la_and_palette_transparency_composited() -> None:
    la = Image.fromarray(np.array([[[50, 255], [50, 0]]], np.uint8), "LA")
    assert np.asarray(decode_image(encode(la, "PNG"))).tolist() == [[[50, 50, 50], [255, 255, 255]]]

    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    pal.putpixel((0, 0), 0)
    pal.putpixel((1, 0), 1)
    for fmt in ("PNG", "GIF"):
        out = np.asarray(decode_image(encode(pal, fmt, transparency=0)))
        assert out.tolist() == [[[255, 255, 255], [10, 20, 30]]], fmt


def test_rgb_png_with_trns_colour_composited() -> None:
    image = Image.new("RGB", (2, 1), (1, 2, 3))
    image.putpixel((1, 0), (9, 9, 9))
    out = np.asarray(decode_image(encode(image, "PNG", transparency=(1, 2, 3))))
    assert out.tolist() == [[[255, 255, 255], [9, 9, 9]]]


# ---------------------------------------------------------------- errors


def assert_media_error(data: bytes, code: str, *words: str, **kwargs: int) -> MediaError:
    with pytest.raises(MediaError) as info:
        decode_image(data, **kwargs)
    err = info.value
    assert err.code == code, (err.code, err.reason)
    for word in words:
        assert word.lower() in err.reason.lower(), err.reason
    return err


def test_empty() -> None:
    assert_media_error(b"", "empty", "empty")


@pytest.mark.parametrize(
    ("data", "word"),
    [
        (b"hello, this is definitely not an image\n", "text"),
        (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nendobj\n", "PDF"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "SVG"),
        (bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)), "unrecognised"),
        (b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00", "AVIF"),
    ],
)
def test_non_images_are_unsupported(data: bytes, word: str) -> None:
    err = assert_media_error(data, "unsupported_format", "unsupported format", word)
    assert "JPEG" in err.reason  # tells the client what would work


def test_corrupt_headers(rgb_array: np.ndarray) -> None:
    jpeg = encode(Image.fromarray(rgb_array, "RGB"), "JPEG")
    assert_media_error(b"\xff\xd8\xff" + b"\x00" * 200, "corrupt_image", "JPEG", "corrupt")
    png = bytearray(encode(Image.fromarray(rgb_array, "RGB"), "PNG"))
    png[20] ^= 0xFF  # inside IHDR: the chunk CRC no longer matches
    assert_media_error(bytes(png), "corrupt_image", "PNG", "corrupt")
    assert_media_error(b"GIF89a" + b"\x00", "corrupt_image", "GIF")
    assert_media_error(b"RIFF\x10\x00\x00\x00WEBPVP8 garbage", "corrupt_image", "WEBP")
    # Scrambled entropy-coded data behind a valid header still decodes to *something* in libjpeg;
    # scrambled PNG image data cannot (zlib checksum).
    png = bytearray(encode(Image.fromarray(rgb_array, "RGB"), "PNG"))
    start = png.index(b"IDAT") + 10
    png[start : start + 40] = bytes(40)
    assert_media_error(bytes(png), "corrupt_image", "PNG")
    assert len(jpeg) > 0


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "TIFF", "BMP"])
def test_truncated_images_fail(rgb_array: np.ndarray, fmt: str) -> None:
    data = encode(Image.fromarray(rgb_array, "RGB"), fmt)
    before = ImageFile.LOAD_TRUNCATED_IMAGES
    assert_media_error(data[: len(data) * 2 // 3], "corrupt_image", fmt)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is before is False


def test_truncated_pixel_data_message_says_truncated() -> None:
    # Big enough that the cut lands in the entropy-coded data, after a complete header.
    noise = np.random.default_rng(1).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    data = encode(Image.fromarray(noise, "RGB"), "JPEG")
    assert_media_error(data[: len(data) // 2], "corrupt_image", "JPEG", "image file is truncated")


def test_decompression_bomb_header_is_refused_before_decoding() -> None:
    # 10^10 pixels: Pillow itself raises DecompressionBombError while reading the header.
    assert_media_error(png_header_only(100_000, 100_000), "too_large", "bomb")


def test_header_above_our_limit_is_refused() -> None:
    # 9000x9000 = 81 MP: under Pillow's limit, over ours; only the header is read.
    err = assert_media_error(
        png_header_only(9000, 9000), "too_large", "9000x9000", str(DEFAULT_MAX_IMAGE_PIXELS)
    )
    assert "limit" in err.reason


def test_limit_is_configurable(rgb_array: np.ndarray) -> None:
    data = encode(Image.fromarray(rgb_array, "RGB"), "PNG")
    assert_media_error(data, "too_large", "64x48", max_image_pixels=64 * 48 - 1)
    assert decode_image(data, max_image_pixels=64 * 48).size == (64, 48)
    with pytest.raises(MediaError) as info:
        preprocess_image_bytes(data, ProcessorConfig(), max_image_pixels=100)
    assert info.value.code == "too_large"


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_pillow_warning_range_is_refused_even_with_a_higher_limit() -> None:
    # 10000^2 = 100 MP: Pillow only warns (89.5 MP < n < 179 MP); we refuse whatever the caller set.
    assert_media_error(png_header_only(10_000, 10_000), "too_large", max_image_pixels=10**9)


def test_pillow_warning_escalated_to_error_is_still_a_media_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        assert_media_error(png_header_only(10_000, 10_000), "too_large", max_image_pixels=10**9)


def test_gif_frame_growing_the_canvas_is_bounded() -> None:
    # Logical screen 8x8, first image descriptor claims 8 x 5000 at offset 0: Pillow grows the canvas.
    header = b"GIF89a" + struct.pack("<HHBBB", 8, 8, 0, 0, 0)
    descriptor = b"," + struct.pack("<HHHHB", 0, 0, 8, 5000, 0)
    data = header + descriptor + b"\x02\x02\x4c\x01\x00;"
    assert_media_error(data, "too_large", max_image_pixels=1000)


def test_aspect_ratio_and_too_small_through_bytes() -> None:
    with pytest.raises(MediaError) as info:
        preprocess_image_bytes(encode(Image.new("RGB", (1, 250)), "PNG"), ProcessorConfig())
    assert info.value.code == "aspect_ratio" and "aspect ratio" in info.value.reason
    with pytest.raises(MediaError) as info:
        preprocess_image_bytes(encode(Image.new("RGB", (5, 5)), "PNG"), ProcessorConfig(), min_pixels=0)
    assert info.value.code == "too_small" and "too small" in info.value.reason


def test_media_error_shape() -> None:
    err = MediaError("the image is broken", "corrupt_image")
    assert isinstance(err, ValueError)
    assert err.reason == "the image is broken" and err.code == "corrupt_image"
    assert "the image is broken" in str(err) and "corrupt_image" in str(err)
    assert err.to_dict() == {"code": "corrupt_image", "reason": "the image is broken"}
    again = pickle.loads(pickle.dumps(err))
    assert (again.reason, again.code) == (err.reason, err.code)


# ---------------------------------------------------------------- data shorter than the header says


def patch_jpeg_size(data: bytes, width: int, height: int) -> bytes:
    """The same JPEG with its frame header (SOF) claiming another size: the entropy data is unchanged."""
    out = bytearray(data)
    pos = 2
    while True:
        marker, length = out[pos + 1], struct.unpack_from(">H", out, pos + 2)[0]
        if marker in (0xC0, 0xC1, 0xC2):
            struct.pack_into(">HH", out, pos + 5, height, width)
            return bytes(out)
        pos += 2 + length


def patch_png_size(data: bytes, width: int, height: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(">II", out, 16, width, height)
    struct.pack_into(">I", out, 29, zlib.crc32(bytes(out[12:29])))
    return bytes(out)


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    rng = np.random.default_rng(7)
    yy, xx = np.mgrid[0:480, 0:640]
    base = np.stack([yy // 2, xx // 3, (yy + xx) // 5], -1) + rng.integers(0, 40, (480, 640, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
def test_jpeg_header_claiming_more_than_its_data_is_corrupt(photo: Image.Image, progressive: bool) -> None:
    data = encode(photo, "JPEG", quality=90, progressive=progressive)
    # The attack: 8000x8000 declared over 640x480 data (Pillow alone returns grey rows).
    lying = patch_jpeg_size(data, 8000, 8000)
    with Image.open(io.BytesIO(lying)) as plain:
        plain.load()
        assert np.asarray(plain)[-1, :3].tolist() == [[128, 128, 128]] * 3
    err = assert_media_error(lying, "corrupt_image", "8000x8000", "ends before")
    assert "blocks need" in err.reason
    # Small lies too: 32 more rows (sequential: exact; progressive: the DC refinement scans still fall short).
    assert_media_error(patch_jpeg_size(data, 640, 512), "corrupt_image", "JPEG")
    assert_media_error(patch_jpeg_size(data, 672, 480), "corrupt_image", "JPEG")
    # And the estimate refuses it from the header, before decoding.
    with pytest.raises(MediaError) as info:
        from service.media.estimate import estimate_image

        estimate_image(lying, ProcessorConfig())
    assert info.value.code == "corrupt_image"


def test_valid_jpegs_still_decode_bit_identically(photo: Image.Image) -> None:
    """The strict decoding changes nothing for complete files: every variant equals Pillow's plain decode."""
    rng = np.random.default_rng(11)
    variants: list[tuple[Image.Image, dict]] = [
        (photo, {"quality": 95}),
        (photo, {"quality": 30, "subsampling": 0}),
        (photo, {"quality": 75, "subsampling": 1, "optimize": True}),
        (photo, {"quality": 85, "progressive": True}),
        (photo, {"quality": 85, "progressive": True, "optimize": True}),
        (photo.convert("L"), {"quality": 80}),
        (photo.convert("CMYK"), {"quality": 80}),
        (photo, {"quality": 90, "restart_marker_blocks": 3}),
        (photo, {"quality": 90, "restart_marker_rows": 1, "progressive": True}),
        (photo.crop((0, 0, 13, 7)), {"quality": 90}),
        (Image.new("RGB", (64, 48), (128, 128, 128)), {"quality": 90}),  # flat grey: the padding colour itself
    ]
    for size in [(1, 1), (9, 17), (250, 3), (33, 301)]:
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        variants.append((Image.fromarray(pixels), {"quality": int(rng.integers(5, 100))}))
    exif = Image.Exif()
    exif[0x010F] = "camera"
    variants.append((photo, {"quality": 90, "exif": exif.tobytes()}))
    for image, kwargs in variants:
        data = encode(image, "JPEG", **kwargs)
        for blob in (data, data + b"trailing garbage after the end-of-image marker" * 10):
            with Image.open(io.BytesIO(blob)) as plain:
                expected = np.asarray(to_rgb(plain.convert(plain.mode)))
            got = np.asarray(decode_image(blob))
            np.testing.assert_array_equal(got, expected, err_msg=str(kwargs))


def test_png_header_claiming_more_rows_than_its_data_is_corrupt(photo: Image.Image) -> None:
    for interlace in (False, True):
        data = encode(photo, "PNG", optimize=False) if not interlace else _interlaced_png(photo)
        lying = patch_png_size(data, 640, 500)
        if not interlace:
            with Image.open(io.BytesIO(lying)) as plain:  # Pillow alone: black rows, no error
                plain.load()
        assert_media_error(lying, "corrupt_image", "PNG", "truncated")
        assert_media_error(patch_png_size(data, 8000, 8000), "corrupt_image", "PNG")
        np.testing.assert_array_equal(np.asarray(decode_image(data)), np.asarray(photo))
    # Every PNG flavour still decodes: palette, grey, 16-bit, alpha, several IDAT chunks, text after the data.
    for mode in ("P", "L", "I;16", "RGBA", "LA", "1"):
        if mode == "I;16":
            image = Image.fromarray(np.asarray(photo)[..., 0].astype(np.uint16) * 257)
        else:
            image = photo.convert(mode)
        data = encode(image, "PNG")
        with Image.open(io.BytesIO(data)) as plain:
            expected = np.asarray(to_rgb(plain))
        np.testing.assert_array_equal(np.asarray(decode_image(data)), expected, err_msg=mode)
    split = _split_idat(encode(photo, "PNG"), 1000)
    np.testing.assert_array_equal(np.asarray(decode_image(split)), np.asarray(photo))


def _interlaced_png(image: Image.Image) -> bytes:
    """An Adam7 PNG written by hand (Pillow does not write interlaced PNGs)."""
    rgb = np.asarray(image.convert("RGB"))
    rows = []
    passes = ((0, 0, 8, 8), (0, 4, 8, 8), (4, 0, 8, 4), (0, 2, 4, 4), (2, 0, 4, 2), (0, 1, 2, 2), (1, 0, 2, 1))
    for y0, x0, dy, dx in passes:
        sub = rgb[y0::dy, x0::dx]
        if sub.size:
            rows += [b"\x00" + row.tobytes() for row in sub]
    ihdr = struct.pack(">IIBBBBB", rgb.shape[1], rgb.shape[0], 8, 2, 0, 0, 1)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b"".join(rows)))
            + png_chunk(b"IEND", b""))


def _split_idat(data: bytes, size: int) -> bytes:
    """The same PNG with its image data in chunks of `size` bytes and a text chunk after them."""
    pos, head, payload, tail = 8, b"", b"", b""
    while pos < len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        chunk = data[pos : pos + 12 + length]
        if kind == b"IDAT":
            payload += data[pos + 8 : pos + 8 + length]
        elif payload:
            tail += chunk
        else:
            head += chunk
        pos += 12 + length
    idats = b"".join(png_chunk(b"IDAT", payload[i : i + size]) for i in range(0, len(payload), size))
    text = png_chunk(b"tEXt", b"Comment\x00after the image data")
    return data[:8] + head + idats + text + tail


def _xmp(zip_: bool, itxt: bool) -> PngImagePlugin.PngInfo:
    info = PngImagePlugin.PngInfo()
    packet = '<x:xmpmeta xmlns:x="adobe:ns:meta/">' + "<rdf:li>keyword</rdf:li>" * 100_000 + "</x:xmpmeta>"
    if itxt:
        info.add_itxt("XML:com.adobe.xmp", packet, zip=zip_)
    else:
        info.add_text("XML:com.adobe.xmp", packet, zip=zip_)
    return info


@pytest.mark.parametrize(
    "metadata",
    [
        {"icc_profile": bytes(range(256)) * 8192},  # 2 MiB profile: over Pillow's 1 MiB per chunk
        {"pnginfo": _xmp(zip_=True, itxt=False)},  # zTXt, 2.4 MB decompressed
        {"pnginfo": _xmp(zip_=True, itxt=True)},  # compressed iTXt, as editors write XMP
    ],
    ids=["iCCP", "zTXt", "iTXt"],
)
def test_png_with_metadata_over_pillows_chunk_limit_is_decoded(rgb_array: np.ndarray, metadata: dict) -> None:
    """A valid PNG whose ICC profile or XMP packet decompresses past PngImagePlugin.MAX_TEXT_CHUNK: Pillow
    refuses the whole file, but no pixel depends on those chunks, so it is read without them."""
    data = encode(Image.fromarray(rgb_array, "RGB"), "PNG", **metadata)
    with pytest.raises(ValueError):  # what Pillow alone makes of it
        Image.open(io.BytesIO(data)).load()
    assert np.array_equal(np.asarray(decode_image(data)), rgb_array)
    # Still strict about the image itself: the same file cut in its pixel data is corrupt.
    cut = data.index(b"IDAT") + 20
    assert_media_error(data[:cut], "corrupt_image", "PNG")
