"""What a video container's header says before FFmpeg opens it: frame sizes, and which way up frames are shown.

`declared_frame_sizes` lists the frame size of every video track (MP4/MOV sample entries, Matroska
PixelWidth/PixelHeight, AVI main and stream headers). FFmpeg's own probing at open time may decode a frame
of every stream, so a header announcing 8192x8192 frames is refused from these bytes before FFmpeg
allocates anything (opening such a 200 KB file took 255 ms and 154 MB).

An orientation is `(transpose, flip_rows, flip_cols)`: what turns a stored frame into the upright one. The
decoder reads FFmpeg's display matrix from the first decoded frame (`service.media.video_frames`); the estimate must
know it before decoding anything, so `container_display_matrix` reads the same matrix from the header bytes the
way FFmpeg's demuxers derive it:

* MP4/MOV: the track header (`tkhd`) matrix multiplied by the movie header (`mvhd`) matrix, in the fixed-point
  arithmetic of FFmpeg's mov demuxer; the track is found by its ID (FFmpeg's stream id).
* Matroska/WebM: a rectangular `Projection` of the track (ProjectionPoseRoll, and a yaw of 180 degrees for a
  mirror), as FFmpeg's matroska demuxer turns it into a matrix; other projections are not a display matrix.
  FFmpeg leaves the stream id at 0 here, so the track is the n-th video track entry (n = the stream's place
  among the video streams that are not cover art, which FFmpeg adds after the tracks).

`matroska_declared_end` reads where a Matroska Segment says it ends: past the end of the data, the file was
cut (Matroska has no frame count to compare with, and a cut cluster demuxes quietly).

Every walk is bounded (at most `_MAX_ELEMENTS` boxes, elements or chunks); when the header cannot be read
this way the answer is "no size" / "no matrix", and FFmpeg's reading stays the authority.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence

Orientation = tuple[bool, bool, bool]
UPRIGHT: Orientation = (False, False, False)

_MAX_ELEMENTS = 20_000


def orientation_from_matrix(matrix: Sequence[int]) -> Orientation:
    """(transpose, flip_rows, flip_cols) for a display matrix in libavutil's layout [a b u; c d v; x y w].

    The matrix maps a stored pixel (x, y) to (a*x + c*y, b*x + d*y) on screen. Axis-aligned matrices are the 8
    rotations/flips; anything else is snapped to the closest of them by the signs of its dominant entries.
    """
    a, b, c, d = (int(matrix[i]) for i in (0, 1, 3, 4))
    if abs(a) + abs(d) >= abs(b) + abs(c):
        return False, d < 0, a < 0
    # Transposed: stored column x becomes screen row b*x, stored row y screen column c*y.
    return True, b < 0, c < 0


def orientation_from_rotate_tag(value: str | None) -> Orientation:
    """The legacy `rotate` metadata tag (clockwise degrees), used only where there is no display matrix."""
    if not value:
        return UPRIGHT
    try:
        clockwise = int(round(float(value))) % 360
    except (ValueError, OverflowError):
        return UPRIGHT
    return {90: (True, False, True), 180: (False, True, True), 270: (True, True, False)}.get(clockwise, UPRIGHT)


def upright_size(height: int, width: int, orientation: Orientation) -> tuple[int, int]:
    """(H, W) of the upright frame for a stored height x width frame."""
    return (width, height) if orientation[0] else (height, width)


def container_display_matrix(
    data: bytes | bytearray | memoryview, container: str, *, track_id: int, video_index: int
) -> tuple[int, ...] | None:
    """The display matrix FFmpeg derives from the header for one video track, or None (identity, absent, or a
    header this reader cannot walk). `container` is the sniffed name: "mp4" or "matroska" (AVI has none);
    `track_id` is the stream's id (MP4), `video_index` its place among the video tracks (Matroska)."""
    view = memoryview(data)
    try:
        if container == "mp4":
            return _mp4_matrix(view, track_id)
        if container == "matroska":
            return _matroska_matrix(view, video_index)
    except (struct.error, ValueError, IndexError, OverflowError):
        return None
    return None


def declared_frame_sizes(data: bytes | bytearray | memoryview, container: str) -> list[tuple[int, int]]:
    """(width, height) of every video track as the header declares it; empty when it cannot be read."""
    view = memoryview(data)
    try:
        if container == "mp4":
            return _mp4_sizes(view)
        if container == "matroska":
            return _matroska_sizes(view)
        if container == "avi":
            return _avi_sizes(view)
    except (struct.error, ValueError, IndexError, OverflowError):
        return []
    return []


# -- MP4 / MOV ------------------------------------------------------------------------------------


def _boxes(data: memoryview, start: int, end: int, budget: list[int]) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload start, payload end) of the ISO-BMFF boxes in data[start:end]."""
    pos = start
    while pos + 8 <= end:
        budget[0] -= 1
        if budget[0] < 0:
            return
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1:
            if pos + 16 > end:
                return
            (size,) = struct.unpack_from(">Q", data, pos + 8)
            header = 16
        elif size == 0:
            size = end - pos
        if size < header or pos + size > end:
            return
        yield bytes(kind), pos + header, pos + size
        pos += size


def _matrix_at(data: memoryview, offset: int) -> list[list[int]]:
    values = struct.unpack_from(">9i", data, offset)
    return [list(values[0:3]), list(values[3:6]), list(values[6:9])]


def _mp4_matrix(data: memoryview, track_id: int) -> tuple[int, ...] | None:
    budget = [_MAX_ELEMENTS]
    for kind, start, end in _boxes(data, 0, len(data), budget):
        if kind != b"moov":
            continue
        movie = [[1 << 16, 0, 0], [0, 1 << 16, 0], [0, 0, 1 << 30]]
        for inner, s, e in _boxes(data, start, end, budget):
            if inner == b"mvhd":
                movie = _matrix_at(data, s + (48 if data[s] == 1 else 36))
            elif inner == b"trak":
                for leaf, ts, _te in _boxes(data, s, e, budget):
                    if leaf != b"tkhd":
                        continue
                    version = data[ts]
                    (tid,) = struct.unpack_from(">I", data, ts + (20 if version == 1 else 12))
                    if tid == track_id:
                        track = _matrix_at(data, ts + (52 if version == 1 else 40))
                        return _combine(track, movie)
        return None
    return None


def _mp4_sizes(data: memoryview) -> list[tuple[int, int]]:
    """Coded width and height of the visual sample entries of the 'vide' tracks."""
    budget = [_MAX_ELEMENTS]
    sizes: list[tuple[int, int]] = []
    for kind, start, end in _boxes(data, 0, len(data), budget):
        if kind != b"moov":
            continue
        for trak, ts, te in _boxes(data, start, end, budget):
            if trak != b"trak":
                continue
            for mdia, ms, me in _boxes(data, ts, te, budget):
                if mdia != b"mdia":
                    continue
                handler, entries = None, []
                for child, cs, ce in _boxes(data, ms, me, budget):
                    if child == b"hdlr" and ce - cs >= 12:
                        handler = bytes(data[cs + 8 : cs + 12])
                    elif child == b"minf":
                        entries = _mp4_sample_entries(data, cs, ce, budget)
                if handler == b"vide":
                    sizes += entries
        break
    return sizes


def _mp4_sample_entries(data: memoryview, start: int, end: int, budget: list[int]) -> list[tuple[int, int]]:
    for stbl, s, e in _boxes(data, start, end, budget):
        if stbl != b"stbl":
            continue
        for stsd, ds, de in _boxes(data, s, e, budget):
            if stsd == b"stsd":
                # Full box (4 bytes) and entry count (4), then sample entries: a visual one has 6 reserved
                # bytes, a data reference index (2), 16 bytes of pre-defined/reserved, then width and height.
                return [
                    struct.unpack_from(">HH", data, es + 24)
                    for _kind, es, ee in _boxes(data, ds + 8, de, budget)
                    if ee - es >= 28
                ]
    return []


def _combine(track: list[list[int]], movie: list[list[int]]) -> tuple[int, ...] | None:
    """track x movie in the demuxer's fixed point (16.16, 16.16, 2.30 rows), None for the identity."""
    shifts = (16, 16, 30)
    out = [[sum((track[i][k] * movie[k][j]) >> shifts[k] for k in range(3)) for j in range(3)] for i in range(3)]
    flat = tuple(v for row in out for v in row)
    if flat == (1 << 16, 0, 0, 0, 1 << 16, 0, 0, 0, 1 << 30):
        return None
    return flat


# -- Matroska / WebM ------------------------------------------------------------------------------

_SEGMENT, _TRACKS, _TRACK_ENTRY, _CLUSTER = 0x18538067, 0x1654AE6B, 0xAE, 0x1F43B675
_TRACK_TYPE, _VIDEO, _PROJECTION = 0x83, 0xE0, 0x7670
_PIXEL_WIDTH, _PIXEL_HEIGHT = 0xB0, 0xBA
_PROJ_TYPE, _PROJ_PRIVATE, _YAW, _PITCH, _ROLL = 0x7671, 0x7672, 0x7673, 0x7674, 0x7675


def _vint(data: memoryview, pos: int, keep_marker: bool) -> tuple[int | None, int]:
    """(value, length) of an EBML variable-length integer; value None for the reserved "unknown size"."""
    first = data[pos]
    if first == 0:
        raise ValueError("invalid EBML length")
    length = 8 - first.bit_length() + 1
    value = first if keep_marker else first & ((1 << (8 - length)) - 1)
    all_ones = value == (1 << (8 - length)) - 1
    for k in range(1, length):
        byte = data[pos + k]
        value = (value << 8) | byte
        all_ones = all_ones and byte == 0xFF
    if not keep_marker and all_ones:
        return None, length
    return value, length


def _elements(data: memoryview, start: int, end: int, budget: list[int]) -> Iterator[tuple[int, int, int | None]]:
    """(id, payload start, payload end or None when the size is unknown) of the EBML elements in [start, end)."""
    pos = start
    while pos < end:
        budget[0] -= 1
        if budget[0] < 0:
            return
        element_id, n = _vint(data, pos, keep_marker=True)
        size, m = _vint(data, pos + n, keep_marker=False)
        payload = pos + n + m
        if size is None:
            yield element_id or 0, payload, None
            return
        if payload + size > end:
            yield element_id or 0, payload, end  # a cut file: let the caller read what is there
            return
        yield element_id or 0, payload, payload + size
        pos = payload + size


def _uint(data: memoryview, start: int, end: int) -> int:
    return int.from_bytes(data[start:end], "big")


def _float(data: memoryview, start: int, end: int) -> float:
    if end - start == 4:
        return struct.unpack_from(">f", data, start)[0]
    if end - start == 8:
        return struct.unpack_from(">d", data, start)[0]
    return 0.0


def matroska_declared_end(data: bytes | bytearray | memoryview) -> int | None:
    """Where the Segment of a Matroska/WebM file says it ends (its offset plus its declared size), or
    None when its size is unknown (a live stream) or the head cannot be read. A muxer that can seek
    back writes the true size there, so a larger value than the file's length means a cut file, the
    counterpart of an MP4 track whose sample table lists more frames than the file holds."""
    view = memoryview(data)
    pos = 0
    try:
        for _ in range(8):  # the EBML header, maybe Void elements, then the Segment
            element_id, n = _vint(view, pos, keep_marker=True)
            size, m = _vint(view, pos + n, keep_marker=False)
            if element_id == _SEGMENT:
                return None if size is None else pos + n + m + size
            if size is None:
                return None
            pos += n + m + size
    except (ValueError, IndexError):
        return None
    return None


def _matroska_tracks_element(data: memoryview, budget: list[int]) -> tuple[int, int] | None:
    """[start, end) of the Tracks element, when it comes before the media data."""
    for element_id, start, end in _elements(data, 0, len(data), budget):
        if element_id != _SEGMENT:
            continue
        for child, s, e in _elements(data, start, end if end is not None else len(data), budget):
            if child == _TRACKS and e is not None:
                return s, e
            if child == _CLUSTER or e is None:
                return None  # media data before any track list, or an element we cannot skip
        return None
    return None


def _matroska_video_tracks(data: memoryview, budget: list[int]) -> Iterator[tuple[int, int]]:
    """[start, end) of the Video element of each video track entry, in order."""
    tracks = _matroska_tracks_element(data, budget)
    if tracks is None:
        return
    for entry, s, e in _elements(data, tracks[0], tracks[1], budget):
        if entry != _TRACK_ENTRY or e is None:
            continue
        kind, video = None, None
        for child, cs, ce in _elements(data, s, e, budget):
            if child == _TRACK_TYPE and ce is not None:
                kind = _uint(data, cs, ce)
            elif child == _VIDEO and ce is not None:
                video = (cs, ce)
        if kind == 1:
            yield video if video is not None else (0, 0)


def _matroska_sizes(data: memoryview) -> list[tuple[int, int]]:
    budget = [_MAX_ELEMENTS]
    sizes = []
    for vs, ve in _matroska_video_tracks(data, budget):
        width = height = 0
        for child, cs, ce in _elements(data, vs, ve, budget):
            if child == _PIXEL_WIDTH and ce is not None:
                width = _uint(data, cs, ce)
            elif child == _PIXEL_HEIGHT and ce is not None:
                height = _uint(data, cs, ce)
        if width and height:
            sizes.append((width, height))
    return sizes


def _matroska_matrix(data: memoryview, video_index: int) -> tuple[int, ...] | None:
    budget = [_MAX_ELEMENTS]
    for seen, (vs, ve) in enumerate(_matroska_video_tracks(data, budget)):
        if seen == video_index:
            return _matroska_projection(data, vs, ve, budget) if ve > vs else None
    return None


def _matroska_projection(data: memoryview, start: int, end: int, budget: list[int]) -> tuple[int, ...] | None:
    for child, s, e in _elements(data, start, end, budget):
        if child != _PROJECTION or e is None:
            continue
        kind, private, yaw, pitch, roll = 0, b"", 0.0, 0.0, 0.0
        for field, fs, fe in _elements(data, s, e, budget):
            if fe is None:
                break
            if field == _PROJ_TYPE:
                kind = _uint(data, fs, fe)
            elif field == _PROJ_PRIVATE:
                private = bytes(data[fs:fe])
            elif field == _YAW:
                yaw = _float(data, fs, fe)
            elif field == _PITCH:
                pitch = _float(data, fs, fe)
            elif field == _ROLL:
                roll = _float(data, fs, fe)
        # Only a rectangular projection that is a 2D rotation (and a mirror) is a display matrix.
        if kind != 0 or (private and private[0] != 0):
            return None
        if pitch == 0.0 and yaw == 0.0 and roll == 0.0:
            return None
        if pitch != 0.0 or yaw not in (0.0, 180.0, -180.0) or math.isnan(roll):
            return None
        hflip = yaw != 0.0
        # Roll is counter-clockwise, FFmpeg's rotation clockwise; a mirror applies first, so it turns back.
        radians = -(roll * (2 * hflip - 1)) * math.pi / 180.0
        cos, sin = math.cos(radians), math.sin(radians)
        matrix = [_fixed(cos), _fixed(-sin), 0, _fixed(sin), _fixed(cos), 0, 0, 0, 1 << 30]
        if hflip:
            matrix = [v * (-1 if i % 3 == 0 else 1) for i, v in enumerate(matrix)]
        return tuple(matrix)
    return None


def _fixed(x: float) -> int:
    return int(x * (1 << 16))


# -- AVI ------------------------------------------------------------------------------------------


def _riff_chunks(data: memoryview, start: int, end: int, budget: list[int]) -> Iterator[tuple[bytes, int, int]]:
    """(id, payload start, payload end) of RIFF chunks; a LIST's payload starts with its 4-byte type."""
    pos = start
    while pos + 8 <= end:
        budget[0] -= 1
        if budget[0] < 0:
            return
        kind, size = struct.unpack_from("<4sI", data, pos)
        stop = min(pos + 8 + size, end)
        yield bytes(kind), pos + 8, stop
        pos = pos + 8 + size + (size & 1)


def _avi_sizes(data: memoryview) -> list[tuple[int, int]]:
    """The main header's frame size and the BITMAPINFOHEADER size of every video stream."""
    budget = [_MAX_ELEMENTS]
    sizes = []
    for kind, start, end in _riff_chunks(data, 12, len(data), budget):
        if kind != b"LIST" or bytes(data[start : start + 4]) != b"hdrl":
            continue
        for child, cs, ce in _riff_chunks(data, start + 4, end, budget):
            if child == b"avih" and ce - cs >= 40:
                sizes.append(struct.unpack_from("<II", data, cs + 32))
            elif child == b"LIST" and bytes(data[cs : cs + 4]) == b"strl":
                video = False
                for leaf, ls, le in _riff_chunks(data, cs + 4, ce, budget):
                    if leaf == b"strh" and le - ls >= 4:
                        video = bytes(data[ls : ls + 4]) == b"vids"
                    elif leaf == b"strf" and video and le - ls >= 12:
                        width, height = struct.unpack_from("<ii", data, ls + 4)
                        sizes.append((abs(width), abs(height)))
        break
    return sizes
