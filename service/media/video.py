"""Untrusted video bytes -> the RGB frames a sampler asks for, with their timestamps (PyAV / FFmpeg).

Only bytes are accepted (never a path or URL). The container is sniffed from magic bytes and FFmpeg
is told to use that one demuxer (MP4/MOV, Matroska/WebM, AVI), so playlist-style demuxers that open
other files or URLs (HLS, concat, ...) are never reached.

How frames are found:

* One cheap demux pass (no decoding, `service.media.video_index`) indexes the packets of the video
  stream: exact frame count, each frame's time, keyframes, decode order, bounded by
  `limits.max_stream_frames`. `VideoReader(..., index_only=True)` keeps only these facts (what the
  estimate reads).
* A sampler asks for times (or indices, which map to times on the stream's own timeline). The frame
  shown at a time is the last frame whose timestamp is <= that time (a one-tick tolerance absorbs
  time-base rounding), so a constant-rate stream gives exactly frame `round(t * fps)` and a
  variable-rate one gives what a player shows.
* Decoding starts at the keyframe before each wanted frame; when the next wanted frame lies past a
  later keyframe the decoder is flushed and jumps there, and it stops after the last wanted frame.
  Frames nobody wants and nothing references (B-frames) are skipped by the decoder
  (`skip_frame=NONREF`), and only wanted frames are converted to RGB.
* Frame sizes the header declares (`service.media.headers`) are checked against
  `limits.max_frame_pixels` before FFmpeg opens the file, since its probing may decode a frame.
* The decoder counts its work (`stats`): packets sent, pixels of the frames it returned, pixels
  converted to RGB. It refuses with `too_much_work` before sending a packet past
  `limits.max_decoded_frames` or `limits.max_decoded_pixels`, and with `too_many_pixels` as soon as
  a frame (wanted or not) is larger than `limits.max_frame_pixels`, whatever the header said.
* Rotation from the display matrix (or the legacy `rotate` tag) is applied, so frames come out
  upright (`service.media.video_frames`); the matrix is read once per reader, from the first frame.

Resources: FFmpeg decoder threads are `threads` per reader (default 1: parallelism comes from decoding
several items at once), and RGB conversion uses one swscale context per reader with the same thread
count. Nothing keeps a frame alive after it is converted, so frames, their buffers and their threads
are freed by reference counting as soon as they are dropped, never left for the garbage collector.
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

import av
import av.error
import numpy as np
from av.video.reformatter import VideoReformatter

from service.media.errors import (
    CORRUPT_VIDEO,
    EMPTY,
    NO_VIDEO_STREAM,
    TOO_FEW_FRAMES,
    TOO_MANY_PIXELS,
    TOO_MUCH_WORK,
    TRUNCATED_VIDEO,
    UNSUPPORTED_CODEC,
    UNSUPPORTED_FORMAT,
    MediaError,
)
from service.media.headers import (
    Orientation,
    container_display_matrix,
    declared_frame_sizes,
    matroska_declared_end,
    orientation_from_matrix,
    orientation_from_rotate_tag,
)
from service.media.limits import DEFAULT_DECODE_THREADS, DEFAULT_LIMITS, DEFAULT_MAX_FRAME_PIXELS, MediaLimits
from service.media.sniff import sniff_container
from service.media.video_frames import frame_orientation, rotate_tag, turn_upright
from service.media.video_index import VideoInfo, check_declared_length, ffmpeg_reason, frame_rate, index_packets

__all__ = [
    "CORRUPT_VIDEO",
    "DEFAULT_MAX_FRAME_PIXELS",
    "NO_VIDEO_STREAM",
    "SUPPORTED_CONTAINERS",
    "TOO_FEW_FRAMES",
    "TOO_MANY_PIXELS",
    "TRUNCATED_VIDEO",
    "UNSUPPORTED_CODEC",
    "DecodedVideo",
    "VideoInfo",
    "VideoReader",
    "decode_video",
    "probe_video",
]

# Sniffed container -> FFmpeg demuxer short name.
SUPPORTED_CONTAINERS: dict[str, str] = {"mp4": "mov", "matroska": "matroska", "avi": "avi"}

# Cap of the look-ahead when matching a time to a frame, as a fraction of a nominal frame interval.
_TIME_TOLERANCE = 0.25
_MAX_THREADS = 64

FrameSink = Callable[[int, np.ndarray], None]


@dataclass
class DecodedVideo:
    """Frames a sampler asked for, in the order asked (repeats allowed)."""

    frames: np.ndarray  # uint8 RGB [N, H, W, 3], upright
    timestamps: np.ndarray  # float64 [N] seconds since the first frame
    positions: np.ndarray  # int64 [N] positions of the frames in presentation order
    info: VideoInfo


def _too_much_work(reason: str) -> MediaError:
    return MediaError(reason=reason, code=TOO_MUCH_WORK)


class VideoReader:
    """Random access to the frames of one in-memory video. Not thread-safe; use one per request.

    limits: per-item bounds (`MediaLimits`); `max_frame_pixels`, if given, overrides its frame limit.
    threads: FFmpeg decoder (and RGB conversion) threads, >= 1; 0 = FFmpeg's choice (one per core).
    index_only: build the packet index and the header facts, keep no packet (nothing can be decoded);
        what the estimate uses, at the cost of one demux pass over packet headers.
    """

    def __init__(
        self,
        data: bytes | bytearray | memoryview,
        *,
        max_frame_pixels: int | None = None,
        threads: int = DEFAULT_DECODE_THREADS,
        limits: MediaLimits | None = None,
        index_only: bool = False,
    ) -> None:
        limits = limits or DEFAULT_LIMITS
        if max_frame_pixels is not None:
            if max_frame_pixels < 1:
                raise ValueError(f"max_frame_pixels must be >= 1, got {max_frame_pixels}")
            limits = replace(limits, max_frame_pixels=max_frame_pixels)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= _MAX_THREADS:
            raise ValueError(f"threads must be an integer in [0, {_MAX_THREADS}], got {threads!r}")
        if len(data) == 0:
            raise MediaError(reason="the video is empty (0 bytes)", code=EMPTY)
        container_name = sniff_container(data)
        if container_name is None:
            raise MediaError(
                reason="not a supported video container: expected MP4/MOV, MKV/WebM or AVI",
                code=UNSUPPORTED_FORMAT,
            )
        self.limits = limits
        self.max_frame_pixels = limits.max_frame_pixels
        self.threads = threads
        self.index_only = index_only
        # Work counters: packets sent to the decoder, keyframe jumps, pixels of the frames it returned,
        # pixels converted to RGB.
        self.stats = {"packets_decoded": 0, "jumps": 0, "decoded_pixels": 0, "converted_pixels": 0}
        self._container: av.container.InputContainer | None = None
        self._packets: list[av.Packet] = []
        self._rgb: VideoReformatter | None = None
        self._frame_orientation: Orientation | None = None
        raw = bytes(data)
        # FFmpeg's probing at open time may decode a frame of every stream: refuse huge frames before it.
        for width, height in declared_frame_sizes(raw, container_name):
            if width * height > self.max_frame_pixels:
                raise MediaError(
                    reason=f"the header declares {width}x{height} = {width * height} pixel frames, above the limit "
                    f"of {self.max_frame_pixels}",
                    code=TOO_MANY_PIXELS,
                )
        try:
            self._container = av.open(io.BytesIO(raw), format=SUPPORTED_CONTAINERS[container_name])
            self._setup(container_name, raw)
        except MediaError:
            self.close()
            raise
        except (av.error.FFmpegError, OSError, ValueError, EOFError, RuntimeError) as exc:
            self.close()
            # The data ended inside the header: a cut file (anything else is just unreadable).
            code = TRUNCATED_VIDEO if isinstance(exc, EOFError) else CORRUPT_VIDEO
            raise MediaError(reason=f"cannot read the video: {ffmpeg_reason(exc)}", code=code) from exc

    # -- setup: stream choice, header checks, packet index (`video_index`) ------------------------

    def _setup(self, container_name: str, raw: bytes) -> None:
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
        if not self.index_only:
            ctx.thread_type = "AUTO"
            ctx.thread_count = self.threads
        self._stream = stream
        self._ctx = ctx
        self._decoder_used = False  # flush before reuse: an earlier read may have drained it
        self._time_base = stream.time_base or Fraction(1, 1)
        check_declared_length(stream, self.limits.max_stream_frames)
        if container_name == "matroska":
            declared = matroska_declared_end(raw)
            if declared is not None and declared > len(raw):
                raise MediaError(reason=f"the video is truncated: its Matroska segment ends at byte {declared}, the "
                                 f"file holds {len(raw)} bytes", code=TRUNCATED_VIDEO)
        index = index_packets(
            self._container, stream, self._time_base, self.limits.max_stream_frames, keep_packets=not self.index_only
        )
        self._packets = index.packets
        self._packet_pts = index.packet_pts
        self._packet_of_pts = index.packet_of_pts
        self._keyframes = index.keyframes
        self._frame_pts = index.frame_pts
        self._span_s = index.span_s
        fps = frame_rate(stream, index, self._time_base)
        self._interval_s = 1.0 / fps  # index i <-> time i * interval on the stream's timeline
        # The chosen stream is the first video track: cover art streams come after the tracks.
        matrix = container_display_matrix(raw, container_name, track_id=stream.id, video_index=0)
        if matrix is not None:
            header_orientation = orientation_from_matrix(matrix)
        else:
            header_orientation = orientation_from_rotate_tag(rotate_tag(stream))
        self.info = VideoInfo(
            container=container_name,
            codec=ctx.name,
            width=width,
            height=height,
            fps=fps,
            num_frames=len(self._frame_pts),
            duration=self._span_s,
            start_time=float(self._frame_pts[0] * self._time_base),
            orientation=header_orientation,
        )

    def _check_pixels(self, width: int, height: int) -> None:
        if width * height > self.max_frame_pixels:
            raise MediaError(
                reason=f"frames are {width}x{height} = {width * height} pixels, "
                f"above the limit of {self.max_frame_pixels}",
                code=TOO_MANY_PIXELS,
            )

    # -- public API ---------------------------------------------------------------------------

    @property
    def frame_times(self) -> np.ndarray:
        """float64 [num_frames]: each frame's time in seconds since the first frame."""
        return (self._frame_pts - self._frame_pts[0]).astype(np.float64) * float(self._time_base)

    @property
    def orientation(self) -> Orientation:
        """How frames are turned upright: from the first decoded frame once one was converted (FFmpeg's
        own reading), else from the container header."""
        return self._frame_orientation if self._frame_orientation is not None else self.info.orientation

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

    def packets_needed(self, positions: Sequence[int] | np.ndarray) -> int:
        """Packets the decoder must be sent to return the frames at `positions`: for each, from the keyframe
        it depends on up to its own packet, overlapping runs counted once. The decoder may send a few more
        (frames wait in the reorder queue); it never sends fewer."""
        wanted = sorted({int(p) for p in positions})
        if not wanted:
            return 0
        runs = sorted(
            (self._start_packet(int(self._frame_pts[p])), self._packet_of_pts[int(self._frame_pts[p])])
            for p in wanted
        )
        total, end = 0, -1
        for start, stop in runs:
            if stop <= end:
                continue
            total += stop - max(start, end + 1) + 1
            end = stop
        return total

    def read(self, positions: Sequence[int] | np.ndarray, sink: FrameSink) -> None:
        """Decode the frames at `positions` (presentation order) and call sink(position, rgb) once for
        each distinct position, in decode order, with an upright uint8 [H, W, 3] frame."""
        if self.index_only:
            raise RuntimeError("this reader was opened with index_only=True: it cannot decode")
        if self._container is None:
            raise RuntimeError("the reader is closed")
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
                reason=f"cannot decode the video: {ffmpeg_reason(exc)}", code=CORRUPT_VIDEO
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
        """Free the demuxer, the decoder (and its threads) and every packet now, not at collection time."""
        ctx = getattr(self, "_ctx", None)
        if ctx is not None and getattr(self, "_decoder_used", False):
            # Let frame threads finish the frame they hold while the GIL is released (PyAV flushes without
            # it): freeing the decoder later joins them with the GIL held, and a thread still decoding may
            # need the GIL to log, which would deadlock.
            try:
                ctx.flush_buffers()
            except (av.error.FFmpegError, RuntimeError):
                pass
        if self._container is not None:
            self._container.close()
            self._container = None
        self._packets = []
        self._rgb = None
        self._ctx = None
        self._stream = None

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

    def _time_of(self, pts: int) -> str:
        return f"{float((pts - self._frame_pts[0]) * self._time_base):.3f} s"

    def _send(self, packet: av.Packet | None) -> list[av.VideoFrame]:
        """One packet (None: drain) into the decoder, within the work limits; the frames it returns."""
        stats, limits, ctx = self.stats, self.limits, self._ctx
        if packet is not None:
            if stats["packets_decoded"] >= limits.max_decoded_frames:
                raise _too_much_work(
                    f"decoding the requested frames needs more than {limits.max_decoded_frames} frames "
                    "decoded (the limit per video): ask for fewer frames or a shorter range, or send a video "
                    "with more keyframes"
                )
            if stats["decoded_pixels"] + ctx.width * ctx.height > limits.max_decoded_pixels:
                raise _too_much_work(
                    f"decoding the requested frames needs more than {limits.max_decoded_pixels} pixels "
                    "decoded (the limit per video)"
                )
            stats["packets_decoded"] += 1
        frames = ctx.decode(packet)
        for frame in frames:
            # Every frame counts, wanted or not, at the size it really has (the header may have lied).
            self._check_pixels(frame.width, frame.height)
            stats["decoded_pixels"] += frame.width * frame.height
        if stats["decoded_pixels"] > limits.max_decoded_pixels:
            raise _too_much_work(
                f"the video decodes to more than {limits.max_decoded_pixels} pixels (the limit per video)"
            )
        return frames

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
                    frames = self._send(packet)
                elif not drained:
                    frames = self._send(None)
                    drained = True
                else:
                    raise MediaError(
                        reason=f"the frame at {self._time_of(pts)} could not be decoded", code=CORRUPT_VIDEO
                    )
                for frame in frames:
                    frame_pts = frame.pts if frame.pts is not None else frame.dts
                    if frame_pts in pending:
                        pending.discard(frame_pts)
                        sink(pts_to_pos[frame_pts], self._to_rgb(frame))
                del frames
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
        if self._frame_orientation is None:
            self._frame_orientation = frame_orientation(frame, self._stream)
        if self._rgb is None:
            self._rgb = VideoReformatter()  # one swscale context per reader, with a bounded thread count
        rgb = self._rgb.reformat(frame, format="rgb24", threads=self.threads).to_ndarray()
        self.stats["converted_pixels"] += frame.width * frame.height
        return turn_upright(rgb, self._frame_orientation)


def probe_video(
    data: bytes | bytearray | memoryview,
    *,
    max_frame_pixels: int | None = None,
    limits: MediaLimits | None = None,
) -> VideoInfo:
    """Header and packet-index facts about a video; decodes nothing."""
    with VideoReader(data, max_frame_pixels=max_frame_pixels, limits=limits, index_only=True) as reader:
        return reader.info


def decode_video(
    data: bytes | bytearray | memoryview,
    *,
    times: Sequence[float] | np.ndarray | None = None,
    indices: Sequence[int] | np.ndarray | None = None,
    max_frame_pixels: int | None = None,
    threads: int = DEFAULT_DECODE_THREADS,
    limits: MediaLimits | None = None,
) -> DecodedVideo:
    """Decode the frames shown at `times` (seconds since the first frame) or at frame `indices`
    (index i = time i * duration / num_frames); with neither, every frame.

    Returns upright uint8 RGB [N, H, W, 3] frames, their timestamps, and the stream's facts.
    """
    if times is not None and indices is not None:
        raise ValueError("pass times or indices, not both")
    with VideoReader(data, max_frame_pixels=max_frame_pixels, threads=threads, limits=limits) as reader:
        if times is not None:
            positions = reader.positions_at(times)
        elif indices is not None:
            positions = reader.positions_at(reader.index_times(indices))
        else:
            positions = np.arange(reader.info.num_frames)
        return reader.frames_at_positions(positions)
