"""Decoded frames turned upright: the orientation FFmpeg reads from a frame's display matrix (else the
stream's legacy `rotate` tag), and the transpose / flips that apply it to an RGB array.

An orientation is `(transpose, flip_rows, flip_cols)` (`service.media.headers`), which also reads the same
matrix from the container header before anything is decoded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.media.headers import Orientation, orientation_from_matrix, orientation_from_rotate_tag

try:  # PyAV 18: a side-data container built here is not cached on the frame (no frame <-> container cycle)
    from av.sidedata.sidedata import SideDataContainer as _SideDataContainer
except ImportError:  # pragma: no cover - depends on the installed PyAV
    _SideDataContainer = None


def display_matrix(frame: Any) -> tuple[int, ...] | None:
    """The nine ints of a frame's display matrix, or None.

    `frame.side_data` caches a container on the frame that points back at the frame: a reference cycle that
    keeps the decoded frame (its buffers, and the swscale context and threads of `frame.reformat`) alive until
    the garbage collector runs. A container made here is referenced by nothing but this function, so the
    frame is freed by reference counting; the matrix leaves as plain ints.
    """
    try:
        entries = _SideDataContainer(frame) if _SideDataContainer is not None else frame.side_data
    except TypeError:  # not a PyAV frame (tests pass stand-ins)
        entries = frame.side_data
    for entry in entries:
        # PyAV <= 18 iterates the side data themselves; 19 made the container a mapping by type.
        side = entry if hasattr(entry, "type") else entries[entry]
        if getattr(side.type, "name", "") == "DISPLAYMATRIX":
            m = np.frombuffer(bytes(side), dtype=np.int32)
            if m.size >= 5:
                return tuple(int(v) for v in m[:9])
    return None


def frame_orientation(frame: Any, stream: Any) -> Orientation:
    """(transpose, flip_rows, flip_cols) that make the stored frame look as its display matrix says; without a
    matrix, the stream's legacy `rotate` tag (clockwise degrees)."""
    matrix = display_matrix(frame)
    if matrix is not None:
        return orientation_from_matrix(matrix)
    return orientation_from_rotate_tag(rotate_tag(stream))


def rotate_tag(stream: Any) -> str | None:
    """The stream's `rotate` metadata tag, whatever its case, or None."""
    return next((v for k, v in stream.metadata.items() if k.lower() == "rotate"), None)


def turn_upright(rgb: np.ndarray, orientation: Orientation) -> np.ndarray:
    """An [H, W, 3] frame with `orientation` applied (the same array when it is already upright)."""
    transpose, flip_rows, flip_cols = orientation
    if not (transpose or flip_rows or flip_cols):
        return rgb
    out = rgb.transpose(1, 0, 2) if transpose else rgb
    if flip_rows:
        out = out[::-1]
    if flip_cols:
        out = out[:, ::-1]
    return np.ascontiguousarray(out)
