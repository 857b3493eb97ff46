"""Untrusted video bytes -> the RGB frames a sampler asks for, with their timestamps (PyAV / FFmpeg).

Only bytes are accepted (never a path or URL). The container is sniffed from magic bytes and FFmpeg
is told to use that one demuxer (MP4/MOV, Matroska/WebM, AVI), so playlist-style demuxers that open
other files or URLs (HLS, concat, ...) are never reached.

How frames are found:

* One cheap demux pass (no decoding) indexes every packet of the video stream: presentation
  timestamps (pts * time_base), keyframes, decode order. That gives the exact frame count and each
  frame's time, even for variable frame rate and for containers without a frame count (WebM/MKV).
* A sampler asks for times (or indices, which map to times on the stream's own timeline). The frame
  shown at a time is the last frame whose timestamp is <= that time (a one-tick tolerance absorbs
  time-base rounding), so a constant-rate stream gives exactly frame `round(t * fps)` and a
  variable-rate one gives what a player shows.
* Decoding starts at the keyframe before each wanted frame; when the next wanted frame lies past a
  later keyframe the decoder is flushed and jumps there, and it stops after the last wanted frame.
  Frames nobody wants and nothing references (B-frames) are skipped by the decoder
  (`skip_frame=NONREF`), and only wanted frames are converted to RGB.
* Rotation from the display matrix (or the legacy `rotate` tag) is applied, so frames come out
  upright; flips in the matrix are honoured too.
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import av
import av.error
import numpy as np

from service.media.errors import EMPTY, UNSUPPORTED_FORMAT, MediaError

CORRUPT_VIDEO = "corrupt_video"
TRUNCATED_VIDEO = "truncated_video"
NO_VIDEO_STREAM = "no_video_stream"
UNSUPPORTED_CODEC = "unsupported_codec"
TOO_MANY_PIXELS = "too_many_pixels"
TOO_FEW_FRAMES = "too_few_frames"

# 4096 x 4096 per frame: covers 4K UHD and DCI 4K, refuses 8K (one 8K RGB frame is ~100 MB).
DEFAULT_MAX_FRAME_PIXELS = 4096 * 4096

# Sniffed container -> FFmpeg demuxer short name.
SUPPORTED_CONTAINERS: dict[str, str] = {"mp4": "mov", "matroska": "matroska", "avi": "avi"}
_ISO_BMFF_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot")

# Cap of the look-ahead when matching a time to a frame, as a fraction of a nominal frame interval.
_TIME_TOLERANCE = 0.25

FrameSink = Callable[[int, np.ndarray], None]


def sniff_container(data: bytes | bytearray | memoryview) -> str | None:
    """'mp4' (MP4/MOV/3GP), 'matroska' (MKV/WebM) or 'avi' from the magic bytes, else None."""
    head = bytes(data[:16])
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"
    if head[:4] == b"RIFF" and head[8:12] in (b"AVI ", b"AVIX"):
        return "avi"
    if head[4:8] in _ISO_BMFF_BOXES:
        return "mp4"
    return None


@dataclass(frozen=True)
class VideoInfo:
    """What the header and the packet index say about the video stream (nothing decoded)."""

    container: str  # sniffed: "mp4", "matroska" or "avi"
    codec: str  # FFmpeg decoder name
    width: int  # coded size; frames come out rotated when the display matrix says so
    height: int
    fps: float  # header average rate if the timestamps follow it, else frames / duration
    num_frames: int  # presentable frames (exact: counted from the packet index)
    duration: float  # seconds from the first frame's timestamp to the end of the last frame
    start_time: float  # first frame's timestamp in seconds; reported times are relative to it


@dataclass
class DecodedVideo:
    """Frames a sampler asked for, in the order asked (repeats allowed)."""

    frames: np.ndarray  # uint8 RGB [N, H, W, 3], upright
    timestamps: np.ndarray  # float64 [N] seconds since the first frame
    positions: np.ndarray  # int64 [N] positions of the frames in presentation order
    info: VideoInfo


class VideoReader:
    """Random access to the frames of one in-memory video. Not thread-safe; use one per request.

    max_frame_pixels: frames (coded size) with more pixels are refused before any decoding.
    threads: FFmpeg decoder threads, 0 = one per core (frame and slice threading).
    """

    def __init__(
        self,
        data: bytes | bytearray | memoryview,
        *,
        max_frame_pixels: int = DEFAULT_MAX_FRAME_PIXELS,
        threads: int = 0,
    ) -> None:
        if max_frame_pixels < 1:
            raise ValueError(f"max_frame_pixels must be >= 1, got {max_frame_pixels}")
        if len(data) == 0:
            raise MediaError(reason="the video is empty (0 bytes)", code=EMPTY)
        container_name = sniff_container(data)
        if container_name is None:
            raise MediaError(
                reason="not a supported video container: expected MP4/MOV, MKV/WebM or AVI",
                code=UNSUPPORTED_FORMAT,
            )
        self.max_frame_pixels = max_frame_pixels
        self._container: av.container.InputContainer | None = None
        try:
            self._container = av.open(io.BytesIO(bytes(data)), format=SUPPORTED_CONTAINERS[container_name])
            self._setup(container_name, threads)
        except MediaError:
            self.close()
            raise
        except (av.error.FFmpegError, OSError, ValueError, EOFError, RuntimeError) as exc:
            self.close()
            # The data ended inside the header: a cut file (anything else is just unreadable).
            code = TRUNCATED_VIDEO if isinstance(exc, EOFError) else CORRUPT_VIDEO
            raise MediaError(reason=f"cannot read the video: {_ffmpeg_reason(exc)}", code=code) from exc

    # -- setup: stream choice, header checks, packet index ------------------------------------

    def _setup(self, container_name: str, threads: int) -> None:
        assert self._container is not None
        streams = [
            s
            for s in self._container.streams.video
            if not (s.disposition & av.stream.Disposition.attached_pic)  # cover art is not a video
        ]
        if not streams:
            kinds = sorted({s.type for s in self._container.streams}) or ["none"]
            raise MediaError(
                reason=f"the file has no video stream (streams: {', '.join(kinds)})", code=NO_VIDEO_STREAM
            )
        stream = streams[0]
        for other in self._container.streams:
            if other.index != stream.index:
                other.discard = av.stream.Discard.all  # let the demuxer skip audio etc.
        ctx = stream.codec_context
        if ctx is None:
            raise MediaError(reason="no decoder for the codec of this video stream", code=UNSUPPORTED_CODEC)
        width, height = int(ctx.width), int(ctx.height)
        if width <= 0 or height <= 0:
            raise MediaError(reason="the video stream has no frame size", code=CORRUPT_VIDEO)
        self._check_pixels(width, height)
        stream.thread_type = "AUTO"
        ctx.thread_count = threads
        self._stream = stream
        self._ctx = ctx
        self._decoder_used = False  # flush before reuse: an earlier read may have drained it
        # Work counters, for tests and benchmarks: packets sent to the decoder, keyframe jumps.
        self.stats = {"packets_decoded": 0, "jumps": 0}
        self._time_base = stream.time_base or Fraction(1, 1)
        self._index_packets()
        fps = self._frame_rate(stream)
        self._interval_s = 1.0 / fps  # index i <-> time i * interval on the stream's timeline
        self.info = VideoInfo(
            container=container_name,
            codec=ctx.name,
            width=width,
            height=height,
            fps=fps,
            num_frames=len(self._frame_pts),
            duration=self._span_s,
            start_time=float(self._frame_pts[0] * self._time_base),
        )

    def _check_pixels(self, width: int, height: int) -> None:
        if width * height > self.max_frame_pixels:
            raise MediaError(
                reason=f"frames are {width}x{height} = {width * height} pixels, "
                f"above the limit of {self.max_frame_pixels}",
                code=TOO_MANY_PIXELS,
            )

    def _index_packets(self) -> None:
        """Demux (no decoding) every packet of the stream and index frames by timestamp."""
        assert self._container is not None
        packets: list[av.Packet] = []
        demux_error: str | None = None
        try:
            for packet in self._container.demux(self._stream):
                if packet.size > 0:  # the demuxer ends with an empty flush packet
                    packets.append(packet)
        except (av.error.FFmpegError, OSError, EOFError) as exc:
            demux_error = _ffmpeg_reason(exc)
        self._packets = packets
        timestamps = [p.pts if p.pts is not None else p.dts for p in packets]
        self._packet_pts = [int(t) if t is not None else None for t in timestamps]
        # Frames the decoder drops (edit-list trimming) are decoded as references but never shown.
        shown = sorted(
            {t for t, p in zip(self._packet_pts, packets, strict=True) if t is not None and not p.is_discard}
        )
        self._frame_pts = np.asarray(shown, dtype=np.int64)
        self._span_s = self._timeline_span(shown)
        # A cut file is the likeliest cause of any problem below: say so first.
        self._check_truncation(demux_error)
        if not packets or not shown:
            raise MediaError(reason="the video stream has no frames", code=CORRUPT_VIDEO)
        if any(t is None for t in self._packet_pts):
            raise MediaError(reason="the video stream has packets without timestamps", code=CORRUPT_VIDEO)
        self._packet_of_pts = {t: i for i, t in enumerate(self._packet_pts)}
        self._keyframes = [i for i, p in enumerate(packets) if p.is_keyframe]
        if not self._keyframes:
            raise MediaError(
                reason="the video stream has no keyframe to start decoding from", code=CORRUPT_VIDEO
            )

    def _timeline_span(self, shown: list[int]) -> float:
        """Seconds from the first frame's timestamp to the end of the last frame (its duration, or
        the typical frame interval when the container does not say)."""
        if not shown:
            return 0.0
        last_duration = 0
        for packet, pts in zip(self._packets, self._packet_pts, strict=True):
            if pts == shown[-1] and packet.duration and packet.duration > 0:
                last_duration = int(packet.duration)
        if last_duration == 0 and len(shown) > 1:
            last_duration = int(np.median(np.diff(shown)))
        return float((shown[-1] - shown[0] + last_duration) * self._time_base)

    def _frame_rate(self, stream: av.video.stream.VideoStream) -> float:
        """The header's average rate when the timestamps follow it (constant frame rate; exact even
        where the time base rounds), else frames / duration measured on the timestamps (variable
        frame rate, or a header rate that does not describe this stream)."""
        n = len(self._frame_pts)
        first_to_last = float((self._frame_pts[-1] - self._frame_pts[0]) * self._time_base)
        for rate in (stream.average_rate, stream.guessed_rate):
            if rate is not None and rate > 0:
                if n == 1 or abs(first_to_last - (n - 1) / float(rate)) <= 0.5 / float(rate):
                    return float(rate)
                break
        if self._span_s > 0:
            return n / self._span_s
        raise MediaError(reason="cannot tell the frame rate of the video", code=CORRUPT_VIDEO)

    def _check_truncation(self, demux_error: str | None) -> None:
        """Refuse files cut short: the header promised more than the packets deliver."""
        stream = self._stream
        reasons = []
        if demux_error is not None:
            reasons.append(f"demuxing stopped with an error ({demux_error})")
        if self._packets and self._packets[-1].is_corrupt:
            reasons.append("the last packet is incomplete")
        if stream.frames and len(self._packets) < stream.frames - 1:
            reasons.append(f"the header lists {stream.frames} frames, the file holds {len(self._packets)}")
        header_s = _stream_duration_s(stream)
        if header_s is not None and header_s - self._span_s > max(1.0, 0.05 * header_s):
            reasons.append(f"the header says {header_s:.2f} s, the frames cover {self._span_s:.2f} s")
        if reasons:
            raise MediaError(
                reason="the video is truncated or damaged: " + "; ".join(reasons), code=TRUNCATED_VIDEO
            )

    # -- public API ---------------------------------------------------------------------------

    @property
    def frame_times(self) -> np.ndarray:
        """float64 [num_frames]: each frame's time in seconds since the first frame."""
        return (self._frame_pts - self._frame_pts[0]).astype(np.float64) * float(self._time_base)

    def positions_at(self, times: Sequence[float] | np.ndarray) -> np.ndarray:
        """Presentation positions of the frames shown at `times` (seconds since the first frame)."""
        t = np.asarray(times, dtype=np.float64)
        # Timestamps are rounded to the time base: allow one tick (never more than a quarter frame,
        # AVI's tick is a whole frame), plus float noise.
        quarter_frame = _TIME_TOLERANCE * self._interval_s
        tolerance = min(float(self._time_base), quarter_frame) + 1e-9
        pos = np.searchsorted(self.frame_times, t + tolerance, side="right") - 1
        return np.clip(pos, 0, len(self._frame_pts) - 1).astype(np.int64)

    def index_times(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Times of frame indices on the stream's timeline: index i is at i / fps when the
        timestamps follow the header rate (so frame i's own timestamp), else at
        i * duration / num_frames, so indices a sampler spaced evenly stay evenly spaced in time."""
        return np.asarray(indices, dtype=np.float64) * self._interval_s

    def read(self, positions: Sequence[int] | np.ndarray, sink: FrameSink) -> None:
        """Decode the frames at `positions` (presentation order) and call sink(position, rgb) once for
        each distinct position, in decode order, with an upright uint8 [H, W, 3] frame."""
        wanted = sorted({int(p) for p in positions})
        if not wanted:
            return
        if wanted[0] < 0 or wanted[-1] >= len(self._frame_pts):
            raise IndexError(
                f"positions must lie in [0, {len(self._frame_pts)}), got {wanted[0]}..{wanted[-1]}"
            )
        try:
            self._decode(wanted, sink)
        except MediaError:
            raise
        except (av.error.FFmpegError, OSError, EOFError) as exc:
            raise MediaError(
                reason=f"cannot decode the video: {_ffmpeg_reason(exc)}", code=CORRUPT_VIDEO
            ) from exc

    def frames_at_positions(self, positions: Sequence[int] | np.ndarray) -> DecodedVideo:
        """Frames at presentation positions, as one array in the order asked."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        got: dict[int, np.ndarray] = {}

        def keep(position: int, rgb: np.ndarray) -> None:
            got[position] = rgb

        self.read(pos, keep)
        shapes = {got[int(p)].shape for p in pos}
        if len(shapes) > 1:
            raise MediaError(
                reason=f"frame size changes within the video: {sorted(shapes)}", code=CORRUPT_VIDEO
            )
        frames = np.stack([got[int(p)] for p in pos]) if pos.size else np.empty((0, 0, 0, 3), np.uint8)
        return DecodedVideo(frames=frames, timestamps=self.frame_times[pos], positions=pos, info=self.info)

    def frames_at(self, times: Sequence[float] | np.ndarray) -> DecodedVideo:
        """Frames shown at `times` (seconds since the first frame)."""
        return self.frames_at_positions(self.positions_at(times))

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
            self._container = None

    def __enter__(self) -> VideoReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- decoding -----------------------------------------------------------------------------

    def _start_packet(self, pts: int) -> int:
        """Decode-order index of the keyframe to start from for the frame with timestamp `pts`."""
        target = self._packet_of_pts[pts]
        k = bisect.bisect_right(self._keyframes, target) - 1
        # Open-GOP leading frames are shown before their keyframe but decoded after it: they need
        # the previous keyframe too.
        while k > 0 and self._packet_pts[self._keyframes[k]] > pts:
            k -= 1
        return self._keyframes[max(k, 0)]

    def _decode(self, wanted_positions: list[int], sink: FrameSink) -> None:
        pts_to_pos = {int(self._frame_pts[p]): p for p in wanted_positions}
        order = sorted(pts_to_pos)
        pending = set(order)
        ctx = self._ctx
        next_packet = -1  # decode-order index of the next packet to send; -1: decoder not started
        drained = False
        for k, pts in enumerate(order):
            if pts not in pending:
                continue
            start = self._start_packet(pts)
            if start > next_packet or drained:
                # Jumping to a later keyframe beats decoding the gap; after a drain we must restart.
                if self._decoder_used:
                    ctx.flush_buffers()
                self.stats["jumps"] += 1
                next_packet, drained, self._decoder_used = start, False, True
            target_packet = self._packet_of_pts[pts]
            while pts in pending:
                # Once the wanted frame's packet is in, the frame only waits in the reorder / thread
                # queue: drain it out rather than decode packets the next wanted frame skips anyway.
                feed = next_packet < len(self._packets) and (
                    next_packet <= target_packet or not self._jump_follows(order, k, pending, next_packet)
                )
                if feed:
                    packet = self._packets[next_packet]
                    next_packet += 1
                    # Only wanted frames must come out; unreferenced others need no decoding at all.
                    ctx.skip_frame = "DEFAULT" if self._packet_pts[next_packet - 1] in pending else "NONREF"
                    frames = ctx.decode(packet)
                    self.stats["packets_decoded"] += 1
                elif not drained:
                    frames = ctx.decode(None)
                    drained = True
                else:
                    raise MediaError(
                        reason=f"the frame at {float((pts - self._frame_pts[0]) * self._time_base):.3f} s "
                        "could not be decoded",
                        code=CORRUPT_VIDEO,
                    )
                for frame in frames:
                    frame_pts = frame.pts if frame.pts is not None else frame.dts
                    if frame_pts in pending:
                        pending.discard(frame_pts)
                        sink(pts_to_pos[frame_pts], self._to_rgb(frame))
            if not pending:
                break

    def _jump_follows(self, order: list[int], k: int, pending: set[int], next_packet: int) -> bool:
        """Whether the decoder will jump (or stop) after the wanted frame order[k]: no later wanted
        frame is pending, or the next one starts at a keyframe past the packets sent so far."""
        for pts in order[k + 1 :]:
            if pts in pending:
                return self._start_packet(pts) > next_packet
        return True

    def _to_rgb(self, frame: av.VideoFrame) -> np.ndarray:
        self._check_pixels(frame.width, frame.height)
        rgb = frame.to_ndarray(format="rgb24")
        return _orient(rgb, _orientation(frame, self._stream))


# -- orientation ----------------------------------------------------------------------------------


def _orientation(frame: av.VideoFrame, stream: av.video.stream.VideoStream) -> tuple[bool, bool, bool]:
    """(transpose, flip_rows, flip_cols) that make the stored frame look as the display matrix says.

    The matrix maps a stored pixel (x, y) to (a*x + c*y, b*x + d*y) on screen (libavutil/display.h
    layout [a b u; c d v; x y w]). Axis-aligned matrices are the 8 rotations/flips; anything else is
    snapped to the closest of them by the signs of its dominant entries.
    """
    for entry in frame.side_data:
        # PyAV <= 18 iterates the side data themselves; 19 made the container a mapping by type.
        side = entry if hasattr(entry, "type") else frame.side_data[entry]
        if getattr(side.type, "name", "") == "DISPLAYMATRIX":
            m = np.frombuffer(bytes(side), dtype=np.int32)
            if m.size >= 5:
                a, b, c, d = (int(v) for v in (m[0], m[1], m[3], m[4]))
                if abs(a) + abs(d) >= abs(b) + abs(c):
                    return False, d < 0, a < 0
                # Transposed: stored column x becomes screen row b*x, stored row y screen column c*y.
                return True, b < 0, c < 0
    # Legacy tag (clockwise degrees), e.g. a Matroska ROTATE tag; only used without a matrix.
    rotate = next((v for k, v in stream.metadata.items() if k.lower() == "rotate"), None)
    if rotate:
        try:
            clockwise = int(round(float(rotate))) % 360
        except ValueError:
            return False, False, False
        return {90: (True, False, True), 180: (False, True, True), 270: (True, True, False)}.get(
            clockwise, (False, False, False)
        )
    return False, False, False


def _orient(rgb: np.ndarray, orientation: tuple[bool, bool, bool]) -> np.ndarray:
    transpose, flip_rows, flip_cols = orientation
    if not (transpose or flip_rows or flip_cols):
        return rgb
    out = rgb.transpose(1, 0, 2) if transpose else rgb
    if flip_rows:
        out = out[::-1]
    if flip_cols:
        out = out[:, ::-1]
    return np.ascontiguousarray(out)


# -- helpers --------------------------------------------------------------------------------------


def _stream_duration_s(stream: av.video.stream.VideoStream) -> float | None:
    """The stream's own duration from the header, if it states one (MP4 track, MKV DURATION tag)."""
    if stream.duration is not None and stream.duration > 0 and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    tag = stream.metadata.get("DURATION") or stream.metadata.get("duration")
    if tag and ":" in tag:
        try:
            h, m, s = tag.split(":")
            return int(h) * 3600 + int(m) * 60 + float(s)
        except ValueError:
            return None
    return None


def _ffmpeg_reason(exc: BaseException) -> str:
    """A short, client-safe reason from a PyAV error (no paths: we only ever open bytes)."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    log = getattr(exc, "log", None)
    if log and isinstance(log, tuple) and len(log) >= 3 and log[2]:
        text = f"{text} ({str(log[2]).strip()})"
    return text[:300]


def probe_video(
    data: bytes | bytearray | memoryview, *, max_frame_pixels: int = DEFAULT_MAX_FRAME_PIXELS
) -> VideoInfo:
    """Header and packet-index facts about a video; decodes nothing."""
    with VideoReader(data, max_frame_pixels=max_frame_pixels) as reader:
        return reader.info


def decode_video(
    data: bytes | bytearray | memoryview,
    *,
    times: Sequence[float] | np.ndarray | None = None,
    indices: Sequence[int] | np.ndarray | None = None,
    max_frame_pixels: int = DEFAULT_MAX_FRAME_PIXELS,
    threads: int = 0,
) -> DecodedVideo:
    """Decode the frames shown at `times` (seconds since the first frame) or at frame `indices`
    (index i = time i * duration / num_frames); with neither, every frame.

    Returns upright uint8 RGB [N, H, W, 3] frames, their timestamps, and the stream's facts.
    """
    if times is not None and indices is not None:
        raise ValueError("pass times or indices, not both")
    with VideoReader(data, max_frame_pixels=max_frame_pixels, threads=threads) as reader:
        if times is not None:
            positions = reader.positions_at(times)
        elif indices is not None:
            positions = reader.positions_at(reader.index_times(indices))
        else:
            positions = np.arange(reader.info.num_frames)
        return reader.frames_at_positions(positions)
