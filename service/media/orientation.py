"""Which way up a video's frames are shown: display matrices, from decoded frames or from the container's header.

An orientation is `(transpose, flip_rows, flip_cols)`: what turns a stored frame into the upright one. The
decoder reads FFmpeg's display matrix from the first decoded frame (`service.media.video`); the estimate must
know it before decoding anything, so `container_display_matrix` reads the same matrix from the header bytes the
way FFmpeg's demuxers derive it:

* MP4/MOV: the track header (`tkhd`) matrix multiplied by the movie header (`mvhd`) matrix, in the fixed-point
  arithmetic of FFmpeg's mov demuxer; the track is found by its ID (FFmpeg's stream id).
* Matroska/WebM: a rectangular `Projection` of the track (ProjectionPoseRoll, and a yaw of 180 degrees for a
  mirror), as FFmpeg's matroska demuxer turns it into a matrix; other projections are not a display matrix.
  FFmpeg leaves the stream id at 0 here, so the track is the n-th video track entry (n = the stream's place
  among the video streams that are not cover art, which FFmpeg adds after the tracks).

Both walks are bounded (at most `_MAX_ELEMENTS` boxes or elements); when the header cannot be read this way the
answer is "no matrix", and the decoder's own reading stays the authority for the frames it returns.
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


def _matroska_matrix(data: memoryview, video_index: int) -> tuple[int, ...] | None:
    budget = [_MAX_ELEMENTS]
    for element_id, start, end in _elements(data, 0, len(data), budget):
        if element_id != _SEGMENT:
            continue
        for child, s, e in _elements(data, start, end if end is not None else len(data), budget):
            if child == _TRACKS and e is not None:
                return _matroska_tracks(data, s, e, video_index, budget)
            if child == _CLUSTER or e is None:
                return None  # media data before any track list, or an element we cannot skip
        return None
    return None


def _matroska_tracks(
    data: memoryview, start: int, end: int, video_index: int, budget: list[int]
) -> tuple[int, ...] | None:
    seen = 0
    for entry, s, e in _elements(data, start, end, budget):
        if entry != _TRACK_ENTRY or e is None:
            continue
        kind, video = None, None
        for child, cs, ce in _elements(data, s, e, budget):
            if child == _TRACK_TYPE and ce is not None:
                kind = _uint(data, cs, ce)
            elif child == _VIDEO and ce is not None:
                video = (cs, ce)
        if kind != 1:  # not a video track
            continue
        if seen == video_index:
            return None if video is None else _matroska_projection(data, video[0], video[1], budget)
        seen += 1
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
