"""Untrusted bytes -> RGB `PIL.Image`, or a `MediaError` saying why not.

Only bytes are accepted (never a path). The format is sniffed from magic bytes and Pillow is
restricted to that one plugin, so exotic or dangerous decoders (EPS/Ghostscript, ...) are never
reached. Size is checked from the header before any pixel is decoded, and truncated files fail
(`ImageFile.LOAD_TRUNCATED_IMAGES` is left alone).

Data that ends before the image its header declares is `corrupt_image`, also where Pillow would
accept it: libjpeg fills the missing part of a scan with grey when it meets the end-of-image marker
early (a warning Pillow drops), and Pillow's PNG decoder stops quietly when the zlib stream ends on
a row boundary. So:

* JPEG: the segments are walked (cheap: the entropy-coded data is skipped with one regex search per
  scan). Every Huffman scan must hold at least the bits its blocks need (each block codes at least
  one DC symbol, and one AC symbol in sequential mode, of the shortest code length of its tables):
  a header claiming far more pixels than the data holds fails here, for progressive files too. A
  single-scan sequential file (the common case: cameras, phones, Pillow) is then decoded with its
  end-of-image marker replaced by 8 stuffed 0xFF bytes (all-ones bits, never a valid Huffman code):
  a complete scan never reads them and decodes bit-identically, a short one runs through them
  (2 blocks at most) and out of data, which Pillow reports as truncated. Multi-scan files
  (progressive) keep only the lower bound: libjpeg absorbs every scan before returning a row, and
  a scan short by less than the bound allows still gets grey blocks.
* PNG (not animated): the zlib stream is handed over without its 4-byte Adler-32 trailer, so the
  decoder can only finish by filling every row; a stream that ends early leaves it waiting for data
  and Pillow reports the file as truncated. A header Pillow cannot read because of its metadata (an
  ICC profile or XMP text over its 1 MiB per chunk) is read again without those chunks, which change
  no pixel (`_PNG_METADATA`).

RGB conversion follows the transformers processors' `convert_to_rgb`: anything with an alpha band
or a `transparency` entry is alpha-composited onto opaque white, everything else goes through
`Image.convert("RGB")`. For RGBA this is pixel-identical to qwen-vl-utils' `to_rgb` (paste with the
alpha mask); qwen-vl-utils drops LA/PA/P-transparency alpha instead, we composite it like the
transformers reference the parity tests compare against.
"""

from __future__ import annotations

import io
import re
import struct
import zlib
from dataclasses import dataclass, field

from PIL import Image

from service.media.errors import (
    CORRUPT_IMAGE,
    EMPTY,
    TOO_LARGE,
    UNSUPPORTED_FORMAT,
    MediaError,
)
from service.media.limits import DEFAULT_MAX_IMAGE_PIXELS

SUPPORTED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "SUPPORTED_FORMATS",
    "ImageHeader",
    "decode_image",
    "has_alpha",
    "read_header",
    "sniff_format",
    "to_rgb",
]

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


def _open(data: bytes | bytearray | memoryview, fmt: str) -> Image.Image:
    try:
        # Lazy: reads only the header; formats=[fmt] keeps every other plugin out of the way.
        return Image.open(io.BytesIO(data), formats=[fmt])
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(f"image header claims a decompression bomb: {exc}", TOO_LARGE) from exc
    except Exception as exc:  # Pillow raises many types on hostile headers; all mean "corrupt".
        bare = _png_without_metadata(bytes(data)) if fmt == "PNG" else None
        if bare is not None:
            return _open(bare, fmt)
        raise MediaError(
            f"{fmt} data is corrupt or truncated: cannot read its header", CORRUPT_IMAGE
        ) from exc


# Ancillary PNG chunks that change no pixel as decoded here: an ICC profile (never applied: the
# reference processors ignore it too) and text (XMP, comments). Pillow decompresses each into memory
# and refuses one over PngImagePlugin.MAX_TEXT_CHUNK (1 MiB) as an error of the whole file, so a
# valid image from a camera or an editor with a large profile or XMP packet would be refused as
# corrupt. When a header cannot be read, it is read again without them.
_PNG_METADATA = (b"iCCP", b"tEXt", b"zTXt", b"iTXt")


def _png_without_metadata(data: bytes) -> bytes | None:
    """`data` without its metadata chunks (`_PNG_METADATA`), or None if it has none, or its chunks
    cannot be walked."""
    pos, n = 8, len(data)
    kept = [data[:8]]
    dropped = False
    while pos + 12 <= n:
        length, kind = struct.unpack_from(">I4s", data, pos)
        end = pos + 12 + length
        if end > n:
            return None
        if kind in _PNG_METADATA:
            dropped = True
        else:
            kept.append(data[pos:end])
        pos = end
        if kind == b"IEND":
            break
    return b"".join(kept) if dropped else None


@dataclass(frozen=True)
class ImageHeader:
    """What an image's header says, read without decoding a pixel (`read_header`)."""

    format: str
    width: int
    height: int
    jpeg: _JpegLayout | None = field(default=None, repr=False, compare=False)  # segments of a JPEG


def read_header(
    data: bytes | bytearray | memoryview, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> ImageHeader:
    """Format and size from the header alone, with every check `decode_image` makes before decoding
    (empty, format, header size, and for JPEG the data-versus-header bound); nothing is decoded."""
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
    width, height = _open(data, fmt).size
    if width <= 0 or height <= 0:
        raise MediaError(f"{fmt} header declares an empty {width}x{height} image", CORRUPT_IMAGE)
    if width * height > limit:
        raise _too_large(width, height, limit)
    layout = None
    if fmt == "JPEG":
        layout = _jpeg_layout(bytes(data))
        if layout is not None:
            _check_jpeg_scans(layout)
    return ImageHeader(fmt, width, height, layout)


def decode_image(
    data: bytes | bytearray | memoryview,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    *,
    header: ImageHeader | None = None,
) -> Image.Image:
    """Decode an encoded image (JPEG, PNG, WebP, GIF first frame, BMP, TIFF first page) to RGB.

    Raises MediaError with code "empty", "unsupported_format", "corrupt_image" (also truncated, or
    data ending before the image its header declares) or "too_large" (header size above
    `max_image_pixels`, or a Pillow decompression bomb). `header`: what `read_header` returned for
    these bytes and this limit, to skip reading it again.
    """
    header = header or read_header(data, max_image_pixels)
    fmt = header.format
    limit = _effective_limit(max_image_pixels)
    source: bytes | bytearray | memoryview = data
    if header.jpeg is not None:
        source = _jpeg_strict(bytes(data), header.jpeg)
    elif fmt == "PNG":
        source = _png_strict(bytes(data))
    image = _open(source, fmt)
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


# -- JPEG: does the entropy-coded data cover the declared image? ---------------------------------------

_SOF_SEQUENTIAL = (0xC0, 0xC1)  # baseline and extended sequential, Huffman
_SOF_PROGRESSIVE = 0xC2
_SOF_ALL = (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF)
# The next marker after entropy-coded data: 0xFF not followed by a stuffed 0x00, a restart marker or fill.
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
# In place of the end-of-image marker: stuffed 0xFF bytes decode as all-ones bits, never a valid code.
_JPEG_TAIL = b"\xff\x00" * 8
_MAX_SEGMENTS = 10_000


@dataclass
class _JpegScan:
    components: list[int]  # component ids
    dc_bits: list[int]  # shortest DC code length of each component's table (1 when undefined)
    ac_bits: list[int]
    ss: int
    ah: int
    start: int  # entropy-coded data [start, end)
    end: int


@dataclass
class _JpegLayout:
    sof: int
    width: int
    height: int
    sampling: dict[int, tuple[int, int]]  # component id -> (H, V)
    scans: list[_JpegScan] = field(default_factory=list)


def _jpeg_layout(data: bytes) -> _JpegLayout | None:
    """Frame header and scans of a JPEG's first image, or None where the walk meets something it does not
    model (Pillow then decides alone, as before)."""
    n = len(data)
    pos, segments = 2, 0
    shortest: dict[tuple[int, int], int] = {}  # (class, table id) -> shortest code length
    layout: _JpegLayout | None = None
    while pos + 1 < n:
        segments += 1
        if segments > _MAX_SEGMENTS:
            return None
        if data[pos] != 0xFF:
            nxt = data.find(b"\xff", pos)  # stray bytes between segments: decoders skip them too
            if nxt < 0:
                break
            pos = nxt
            continue
        marker = data[pos + 1]
        if marker == 0xFF:
            pos += 1
            continue
        if marker == 0xD9:  # end of image
            break
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:
            pos += 2
            continue
        if pos + 4 > n:
            break
        (length,) = struct.unpack_from(">H", data, pos + 2)
        if length < 2 or pos + 2 + length > n:
            return layout if layout is not None and layout.scans else None
        body = data[pos + 4 : pos + 2 + length]
        pos += 2 + length
        if marker == 0xC4:
            if not _read_dht(body, shortest):
                return None
        elif marker in _SOF_ALL:
            if layout is not None or len(body) < 6:
                return None
            height, width, count = struct.unpack_from(">HHB", body, 1)
            if len(body) < 6 + 3 * count or count == 0:
                return None
            sampling = {body[6 + 3 * i]: (body[7 + 3 * i] >> 4, body[7 + 3 * i] & 15) for i in range(count)}
            if any(h == 0 or v == 0 for h, v in sampling.values()):
                return None
            layout = _JpegLayout(marker, width, height, sampling)
        elif marker == 0xDA:
            if layout is None or not body:
                return None
            count = body[0]
            if len(body) < 1 + 2 * count + 3:
                return None
            ids = [body[1 + 2 * i] for i in range(count)]
            tables = [body[2 + 2 * i] for i in range(count)]
            ss, _se, a = body[1 + 2 * count], body[2 + 2 * count], body[3 + 2 * count]
            found = _NEXT_MARKER.search(data, pos)
            end = found.start() if found else n
            layout.scans.append(
                _JpegScan(
                    components=ids,
                    dc_bits=[shortest.get((0, t >> 4), 1) for t in tables],
                    ac_bits=[shortest.get((1, t & 15), 1) for t in tables],
                    ss=ss,
                    ah=a >> 4,
                    start=pos,
                    end=end,
                )
            )
            pos = end
    return layout if layout is not None and layout.scans else None


def _read_dht(body: bytes, shortest: dict[tuple[int, int], int]) -> bool:
    at = 0
    while at < len(body):
        if at + 17 > len(body):
            return False
        cls, table = body[at] >> 4, body[at] & 15
        counts = body[at + 1 : at + 17]
        # An empty table codes nothing; count it as 1 bit so that the bound never overestimates.
        shortest[(cls, table)] = next((i + 1 for i, c in enumerate(counts) if c), 1)
        at += 17 + sum(counts)
    return at == len(body)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _scan_blocks(layout: _JpegLayout, scan: _JpegScan) -> list[int]:
    """8x8 blocks each component of `scan` codes."""
    hmax = max(h for h, _ in layout.sampling.values())
    vmax = max(v for _, v in layout.sampling.values())
    if len(scan.components) == 1:
        h, v = layout.sampling.get(scan.components[0], (1, 1))
        cw, ch = _ceil_div(layout.width * h, hmax), _ceil_div(layout.height * v, vmax)
        return [_ceil_div(cw, 8) * _ceil_div(ch, 8)]
    mcus = _ceil_div(layout.width, 8 * hmax) * _ceil_div(layout.height, 8 * vmax)
    return [mcus * layout.sampling.get(c, (1, 1))[0] * layout.sampling.get(c, (1, 1))[1] for c in scan.components]


def _check_jpeg_scans(layout: _JpegLayout) -> None:
    """Refuse a Huffman-coded JPEG whose scans hold fewer bits than its declared blocks need."""
    if layout.sof not in (*_SOF_SEQUENTIAL, _SOF_PROGRESSIVE) or layout.height == 0:
        return  # arithmetic, lossless, hierarchical or DNL-sized: no bound modelled
    for number, scan in enumerate(layout.scans):
        blocks = _scan_blocks(layout, scan)
        if layout.sof in _SOF_SEQUENTIAL:
            per_block = [dc + ac for dc, ac in zip(scan.dc_bits, scan.ac_bits, strict=True)]
        elif scan.ss != 0:
            continue  # progressive AC scans: one end-of-band run may cover many blocks
        elif scan.ah == 0:
            per_block = scan.dc_bits
        else:
            per_block = [1] * len(blocks)  # DC refinement: one bit per block
        needed = sum(b * k for b, k in zip(blocks, per_block, strict=True))
        held = 8 * (scan.end - scan.start)
        if needed > held:
            raise MediaError(
                f"JPEG data ends before the {layout.width}x{layout.height} image its header declares: "
                f"scan {number + 1} holds {scan.end - scan.start} bytes, its {sum(blocks)} blocks need at "
                f"least {_ceil_div(needed, 8)}",
                CORRUPT_IMAGE,
            )


def _jpeg_strict(data: bytes, layout: _JpegLayout) -> bytes:
    """The bytes to decode: for a single-scan sequential JPEG, the data up to the end of its scan followed by
    bits no valid code uses instead of the end-of-image marker; anything else unchanged."""
    if layout.sof not in _SOF_SEQUENTIAL or layout.height == 0 or len(layout.scans) != 1:
        return data
    scan = layout.scans[0]
    if len(scan.components) != len(layout.sampling) and len(layout.sampling) != 1:
        return data  # one component of several: the others would need scans of their own
    return data[: scan.end] + _JPEG_TAIL


# -- PNG: make the decoder fill every row or fail ----------------------------------------------------


def _png_strict(data: bytes) -> bytes:
    """The bytes to decode: the chunks before the image data, the image data as one IDAT without its zlib
    checksum, IEND. Unchanged for animated PNGs and for layouts this does not model (Pillow then decides)."""
    pos, n = 8, len(data)
    head_end: int | None = None
    parts: list[bytes] = []
    while pos + 12 <= n:
        length, kind = struct.unpack_from(">I4s", data, pos)
        if pos + 12 + length > n:
            break
        if kind == b"acTL":
            return data  # APNG: Pillow's first frame is not always the IDAT image
        if kind == b"IDAT":
            if head_end is None:
                head_end = pos
            parts.append(data[pos + 8 : pos + 8 + length])
        elif head_end is not None or kind == b"IEND":
            break  # the image data is one run of IDAT chunks; Pillow reads no further
        pos += 12 + length
    payload = b"".join(parts)
    if head_end is None or len(payload) <= 4:
        return data
    stream = payload[:-4]
    idat = struct.pack(">I", len(stream)) + b"IDAT" + stream + struct.pack(">I", zlib.crc32(b"IDAT" + stream))
    iend = struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))
    return data[:head_end] + idat + iend
