"""Media whose encoded size walks across every limit of the data path, over one real server (uvloop, as
`vitserve serve` runs): every item is served, equal to the same bytes encoded in this process, and the
server is ready and at full capacity afterwards.

The limits crossed: the request body parsed on the event loop or on a parse thread (`PARSE_HERE_BYTES`),
media inside the job's message or in a segment (`INLINE_MEDIA_BYTES`), the pipe's socket buffer (about
208 KiB: a message above it goes in parts), the segment pool's smallest file (64 KiB) and the sizes of
megabytes. The walks:
- every 2 KB from 120 KB to 340 KB in BMP and PNG, whose size follows the pixels exactly;
- sizes a few bytes either side of 64 KiB, 208 KiB, 256 KiB and 1 MiB (BMP, padded to the byte);
- from 1 KB to 16 MB in steps of x1.25 in every format Pillow writes (JPEG, PNG, WebP, GIF, BMP, TIFF).
Up to 2 MB the bytes are mostly noise pixels; above, a 1 MB image carries format-legal filler that every
decoder must skip (JPEG comments, a private PNG chunk, WebP XMP metadata, a GIF comment, a gap before
BMP pixels, TIFF bytes no directory points at): noise pixels at 16 MB cost seconds to write and read in
every format, where the limits under test only see bytes.
Items up to 1 MB go as base64 JSON, larger ones as multipart files. Each image is resized to at most
112x112 pixels (`max_pixels`), so the engine's share stays small.
"""

from __future__ import annotations

import functools
import io
import json
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from graphs.runner import GraphRunner, plan_for
from models.loader import load_tower
from service.media.image_preprocess import preprocess_image_bytes
from service.media.video_preprocess import preprocess_video_bytes
from tests.http_helpers import SubprocessServer, b64, settings
from tests.videos import make_video

KB, KIB, MIB = 1000, 1024, 1024 * 1024
MAX_PIXELS = 112 * 112
REAL_PIXELS_UP_TO = 2 * KB * KB
BASE_FOR_PADDING = 1_000_000
CLIENTS = 4


def noise(pixels: int, channels: int = 3, seed: int = 0, width: int | None = None) -> np.ndarray:
    width = width or max(8, int(pixels ** 0.5))
    height = max(8, pixels // width)
    return np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)


def save(arr: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    if fmt == "GIF":
        Image.fromarray(arr[..., 0], "L").save(buf, format="GIF")
    elif fmt == "JPEG":
        Image.fromarray(arr).save(buf, format="JPEG", quality=100)
    elif fmt == "PNG":  # noise escapes compression at any level: the fastest one
        Image.fromarray(arr).save(buf, format="PNG", compress_level=1)
    elif fmt == "WEBP":
        Image.fromarray(arr).save(buf, format="WEBP", lossless=True, method=0, quality=0)
    else:
        Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


# Encoded bytes per noise pixel, measured: a first guess of the pixels for a size, refined once.
BYTES_PER_PIXEL = {"JPEG": 2.0, "PNG": 3.0, "WEBP": 3.0, "GIF": 1.37, "BMP": 3.0, "TIFF": 3.0}


def near(fmt: str, target: int, seed: int) -> bytes:
    """Noise in `fmt` of about `target` bytes (within a few per cent; small files, whose headers weigh,
    are measured and made again)."""
    pixels = max(64, int(target / BYTES_PER_PIXEL[fmt]))
    data = save(noise(pixels, seed=seed), fmt)
    if target < 64 * KB:
        pixels = max(64, int(pixels * target / len(data)))
        data = save(noise(pixels, seed=seed), fmt)
        while len(data) > target and pixels > 64:  # a small JPEG's size jumps with its blocks
            pixels = max(64, int(pixels * 0.8))
            data = save(noise(pixels, seed=seed), fmt)
    return data


@functools.cache
def base_for_padding(fmt: str) -> bytes:
    return near(fmt, BASE_FOR_PADDING, 99)


def padded(fmt: str, data: bytes, target: int) -> bytes:
    """`data` grown to exactly `target` bytes (when it can: a few bytes over for GIF's block framing) with
    filler its decoders skip."""
    need = target - len(data)
    if need <= 0:
        return data
    if fmt == "JPEG":  # comment segments after SOI, each at most 65533 bytes of payload
        segments = bytearray()
        while need > 4:
            n = min(need - 4, 65533)
            if need - 4 - n in (1, 2, 3):  # leave room for a whole last segment
                n -= 4
            segments += b"\xff\xfe" + struct.pack(">H", n + 2) + b"\0" * n
            need -= n + 4
        return data[:2] + bytes(segments) + data[2:] + b"\0" * need  # (bytes after EOI are ignored)
    if fmt == "PNG":  # a private, ancillary, safe-to-copy chunk before IEND
        body = b"\0" * (need - 12)
        chunk = struct.pack(">I", len(body)) + b"vsPd" + body + struct.pack(">I", zlib.crc32(b"vsPd" + body))
        return data[:-12] + chunk + data[-12:]
    if fmt == "GIF":  # a comment extension before the trailer: sub-blocks of up to 255 bytes
        blocks = bytearray(b"\x21\xfe")
        left = need - 3
        while left > 0:
            n = min(255, max(1, left - 1))
            blocks += bytes([n]) + b"\0" * n
            left -= n + 1
        return data[:-1] + bytes(blocks) + b"\0" + data[-1:]
    if fmt == "BMP":  # a gap between the headers and the pixels: the file header says where they start
        size, offset = struct.unpack_from("<I", data, 2)[0], struct.unpack_from("<I", data, 10)[0]
        out = bytearray(data[:offset] + b"\0" * need + data[offset:])
        struct.pack_into("<I", out, 2, size + need)
        struct.pack_into("<I", out, 10, offset + need)
        return bytes(out)
    if fmt == "TIFF":  # bytes at the end that no directory points at
        return data + b"\0" * need
    if fmt == "WEBP":  # XMP metadata in the extended format: the container's chunks say how long it is
        img = Image.open(io.BytesIO(data))

        def with_xmp(n: int) -> bytes:
            buf = io.BytesIO()
            img.save(buf, format="WEBP", lossless=True, method=0, quality=0, xmp=b" " * n)
            return buf.getvalue()

        return with_xmp(max(2, target - (len(with_xmp(2)) - 2)))  # (chunks are padded to even sizes)
    raise ValueError(fmt)


def image_of(fmt: str, target: int, seed: int) -> bytes:
    """About `target` bytes of `fmt`: mostly noise pixels up to `REAL_PIXELS_UP_TO` (made a little small,
    then padded to the size), padding above."""
    if target <= REAL_PIXELS_UP_TO:
        return padded(fmt, near(fmt, int(target * 0.9), seed), target)
    return padded(fmt, base_for_padding(fmt), target)


def bmp_exact(target: int, seed: int) -> bytes:
    """A noise BMP of exactly `target` bytes: rows of 600 bytes, the rest as a gap before the pixels."""
    rows = max(1, (target - 54) // 600)
    return padded("BMP", save(noise(rows * 200, seed=seed, width=200), "BMP"), target)


def png_rows(target: int, seed: int) -> bytes:
    """A noise PNG of about `target` bytes (rows of 301 bytes before compression, which noise escapes)."""
    return save(noise(max(1, target // 301) * 100, seed=seed, width=100), "PNG")


def corpus() -> list[tuple[str, str, bytes]]:
    """(name, modality, bytes) of every item of the sweep."""
    items: list[tuple[str, str, bytes]] = []
    for i, target in enumerate(range(120 * KB, 340 * KB + 1, 2 * KB)):
        items.append((f"bmp-walk-{target}", "image", bmp_exact(target, i)))
    for i, target in enumerate(range(119 * KB, 341 * KB, 1800)):  # PNG's size follows its rows within 10%
        items.append((f"png-walk-{target}", "image", png_rows(target, i)))
    for limit in (64 * KIB, 208 * KIB, 256 * KIB, 1 * MIB):
        for delta in (-3, -1, 0, 1, 3):
            items.append((f"bmp-edge-{limit + delta}", "image", bmp_exact(limit + delta, limit + delta)))
    sizes = []
    size = 1 * KB
    while size < 16 * KB * KB:
        sizes.append(int(size))
        size *= 1.25
    sizes.append(16 * KB * KB)
    for fmt in BYTES_PER_PIXEL:
        for i, target in enumerate(sizes):
            items.append((f"{fmt.lower()}-{target}", "image", image_of(fmt, target, 1000 + i)))
    items.append(("mp4-small", "video", make_video(8, fps=4, width=112, height=84)))
    items.append(("webm-small", "video", make_video(8, fps=4, width=112, height=84, codec="libvpx",
                                                    container="webm")))
    rng = np.random.default_rng(7)
    items.append(("mp4-noisy", "video", make_video(8, fps=4, width=320, height=240, options={"qscale": "1"},
                                                   frame_fn=lambda i, w, h: rng.integers(0, 256, (h, w, 3),
                                                                                        dtype=np.uint8))))
    return items


def test_the_sweep_covers_the_limits(items) -> None:
    """The corpus is what the module says: every 2 KB over 120-340 KB, each step of the long walk at most
    x1.25, sizes either side of the channel's limits, several formats decoding to what they hold."""
    sizes = sorted(len(d) for n, _, d in items if n.startswith("png-walk"))
    assert sizes[0] <= 120 * KB and sizes[-1] >= 340 * KB and max(np.diff(sizes)) <= 2 * KB
    sizes = sorted(len(d) for n, _, d in items if n.startswith("bmp-walk"))
    assert sizes[0] <= 120 * KB and sizes[-1] >= 340 * KB and max(np.diff(sizes)) <= 2 * KB
    for fmt in BYTES_PER_PIXEL:
        sizes = sorted(len(d) for n, _, d in items if n.startswith(fmt.lower() + "-") and "walk" not in n
                       and "edge" not in n)
        assert sizes[0] <= 1.25 * KB and sizes[-1] >= 16 * KB * KB, (fmt, sizes[0], sizes[-1])
        assert max(b / a for a, b in zip(sizes, sizes[1:])) <= 1.3, fmt
        for _, _, data in ((n, m, d) for n, m, d in items if n.startswith(fmt.lower() + "-")):
            assert Image.open(io.BytesIO(data)).format == fmt
    for limit in (64 * KIB, 208 * KIB, 256 * KIB, 1 * MIB):
        assert {len(d) for n, _, d in items if n.startswith("bmp-edge")} >= {limit - 1, limit, limit + 1}


@pytest.fixture(scope="module")
def items() -> list[tuple[str, str, bytes]]:
    return corpus()


class Reference:
    """The same bytes preprocessed and encoded in this process, by the served checkpoint."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # a runner's static buffers serve one batch at a time
        cfg = settings()
        self.tower = load_tower(cfg.model, device="cpu", dtype="float32")
        self.runner = GraphRunner(self.tower, torch.device("cpu"), plan_for(self.tower, cfg.max_batch_tokens))
        self.runner.capture()

    def encode(self, modality: str, data: bytes) -> np.ndarray:
        if modality == "image":
            visual = preprocess_image_bytes(data, self.tower.processor, None, MAX_PIXELS)
        else:
            visual = preprocess_video_bytes(data, self.tower.processor, fps=2.0)
        with self.lock:
            return self.runner.encode([visual])[0].embeds.numpy()


def options(modality: str) -> dict[str, Any]:
    return {"max_pixels": MAX_PIXELS} if modality == "image" else {"fps": 2.0}


def post(client: httpx.Client, modality: str, data: bytes) -> httpx.Response:
    if len(data) <= MIB:
        item = {"type": modality, modality: b64(data), **options(modality)}
        return client.post("/encode", json={"items": [item], "encoding_format": "base64"})
    return client.post("/encode", files=[("files", ("item", data, "application/octet-stream"))],
                       data={"options": json.dumps({"items": [options(modality)], "encoding_format": "base64"})})


def decoded(entry: dict[str, Any]) -> np.ndarray:
    import base64

    return np.frombuffer(base64.b64decode(entry["embedding"]), np.float32).reshape(entry["shape"])


def test_every_size_is_served_and_equals_the_in_process_encode(items) -> None:
    reference = Reference()
    flags = ["--preprocess-workers", "2", "--request-timeout-s", "60", "--max-payload-bytes", str(64 * MIB),
             "--log-level", "warning"]
    failures: list[str] = []
    with SubprocessServer(*flags) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        def one(entry: tuple[str, str, bytes]) -> None:
            name, modality, data = entry
            if len(failures) >= 10:  # enough to tell; the rest may each wait for the request timeout
                return
            try:
                r = post(client, modality, data)
            except httpx.HTTPError as exc:  # a dropped connection is a failure too
                failures.append(f"{name} ({len(data)} bytes): {type(exc).__name__}: {exc}")
                return
            if r.status_code != 200:
                failures.append(f"{name} ({len(data)} bytes): {r.status_code} {r.text[:200]}")
                return
            got, want = decoded(r.json()["data"][0]), reference.encode(modality, data)
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-5):
                diff = np.abs(got - want).max() if got.shape == want.shape else "-"
                failures.append(f"{name} ({len(data)} bytes): differs from the in-process encode: shapes "
                                f"{got.shape} and {want.shape}, largest difference {diff}")

        with ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(one, items))
        assert client.get("/ready").status_code == 200
        workers = client.get("/info").json()["workers"]
    assert not failures, f"{len(failures)} of {len(items)} failed (the sweep stops at 10):\n" + "\n".join(failures[:40])
    assert workers["states"] == {"idle": 2, "busy": 0, "starting": 0, "dying": 0}, workers
    assert workers["restarts"] == 0, workers
