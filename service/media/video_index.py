"""The packet index of a video stream: one demux pass over the packets' headers, nothing decoded.

It gives the exact frame count and each frame's timestamp (variable frame rate and containers without a
frame count included), the keyframes a decoder can start from, and the stream's span and frame rate. The
pass is bounded: a header that declares more than `max_stream_frames` frames is refused before it starts
(`check_declared_length`), and it stops with `too_many_frames` once the stream holds more packets. A file
cut short (the header promises more than the packets deliver) is refused with `truncated_video`.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import av
import av.error
import numpy as np

from service.media.errors import CORRUPT_VIDEO, TOO_MANY_FRAMES, TRUNCATED_VIDEO, MediaError
from service.media.headers import UPRIGHT, Orientation, upright_size


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
    orientation: Orientation = UPRIGHT  # from the container header (display matrix, else `rotate` tag)

    @property
    def upright_size(self) -> tuple[int, int]:
        """(H, W) of the frames once turned upright, as the header describes them."""
        return upright_size(self.height, self.width, self.orientation)


@dataclass
class PacketIndex:
    """The video stream's packets in decode order and its frames in presentation order."""

    packets: list[av.Packet]  # kept for decoding; empty when only the index was wanted
    packet_pts: list[int]  # decode order: each packet's timestamp (pts, else dts) in time-base ticks
    packet_of_pts: dict[int, int]  # timestamp -> decode-order index
    keyframes: list[int]  # decode-order indices of the keyframes
    frame_pts: np.ndarray  # int64, sorted: the timestamps of the frames shown
    span_s: float  # seconds from the first frame's timestamp to the end of the last frame


def check_declared_length(stream: av.video.stream.VideoStream, limit: int) -> None:
    """Refuse, before demuxing anything, a stream whose header itself declares more than `limit` frames."""
    declared = int(stream.frames or 0)
    source = "frames"
    if declared <= 0:
        seconds = stream_duration_s(stream)
        rate = stream.average_rate or stream.guessed_rate
        if seconds is not None and rate:
            declared, source = int(seconds * float(rate)), f"{seconds:.1f} s at {float(rate):.3f} fps"
    if declared > limit:
        raise MediaError(
            reason=f"the header declares {declared} frames ({source}), above the limit of {limit} "
            "frames per video",
            code=TOO_MANY_FRAMES,
        )


def index_packets(
    container: av.container.InputContainer,
    stream: av.video.stream.VideoStream,
    time_base: Fraction,
    limit: int,
    keep_packets: bool,
) -> PacketIndex:
    """Demux (no decoding) the stream's packets, at most `limit`, and index its frames by time."""
    timestamps: list[int | None] = []
    packets: list[av.Packet] = []
    keyframes: list[int] = []
    shown: set[int] = set()
    durations: dict[int, int] = {}
    last_corrupt = False
    demux_error: str | None = None
    demuxer = container.demux(stream)
    try:
        for packet in demuxer:
            if packet.size <= 0:  # the demuxer ends with an empty flush packet
                continue
            if len(timestamps) >= limit:
                raise MediaError(
                    reason=f"the video stream holds more than {limit} frames, the limit per video",
                    code=TOO_MANY_FRAMES,
                )
            t = packet.pts if packet.pts is not None else packet.dts
            ts = int(t) if t is not None else None
            if packet.is_keyframe:
                keyframes.append(len(timestamps))
            # Frames the decoder drops (edit-list trimming) are decoded as references but never shown.
            if ts is not None and not packet.is_discard:
                shown.add(ts)
            if ts is not None and packet.duration and packet.duration > 0:
                durations[ts] = int(packet.duration)
            last_corrupt = bool(packet.is_corrupt)
            timestamps.append(ts)
            if keep_packets:
                packets.append(packet)
    except (av.error.FFmpegError, OSError, EOFError) as exc:
        demux_error = ffmpeg_reason(exc)
    finally:
        demuxer.close()  # not left suspended for the collector when the limit stops the pass
    ordered = sorted(shown)
    span_s = _timeline_span(ordered, durations, time_base)
    # A cut file is the likeliest cause of any problem below: say so first.
    _check_truncation(stream, len(timestamps), span_s, demux_error, last_corrupt)
    if not timestamps or not ordered:
        raise MediaError(reason="the video stream has no frames", code=CORRUPT_VIDEO)
    if any(t is None for t in timestamps):
        raise MediaError(reason="the video stream has packets without timestamps", code=CORRUPT_VIDEO)
    if not keyframes:
        raise MediaError(reason="the video stream has no keyframe to start decoding from", code=CORRUPT_VIDEO)
    packet_pts = [int(t) for t in timestamps if t is not None]
    return PacketIndex(
        packets=packets,
        packet_pts=packet_pts,
        packet_of_pts={t: i for i, t in enumerate(packet_pts)},
        keyframes=keyframes,
        frame_pts=np.asarray(ordered, dtype=np.int64),
        span_s=span_s,
    )


def frame_rate(stream: av.video.stream.VideoStream, index: PacketIndex, time_base: Fraction) -> float:
    """The header's average rate when the timestamps follow it (constant frame rate; exact even where
    the time base rounds), else frames / duration measured on the timestamps (variable frame rate, or a
    header rate that does not describe this stream)."""
    frame_pts = index.frame_pts
    n = len(frame_pts)
    first_to_last = float((frame_pts[-1] - frame_pts[0]) * time_base)
    for rate in (stream.average_rate, stream.guessed_rate):
        if rate is not None and rate > 0:
            if n == 1 or abs(first_to_last - (n - 1) / float(rate)) <= 0.5 / float(rate):
                return float(rate)
            break
    if index.span_s > 0:
        return n / index.span_s
    raise MediaError(reason="cannot tell the frame rate of the video", code=CORRUPT_VIDEO)


def _timeline_span(shown: list[int], durations: dict[int, int], time_base: Fraction) -> float:
    """Seconds from the first frame's timestamp to the end of the last frame (its duration, or the
    typical frame interval when the container does not say)."""
    if not shown:
        return 0.0
    last_duration = durations.get(shown[-1], 0)
    if last_duration == 0 and len(shown) > 1:
        last_duration = int(np.median(np.diff(shown)))
    return float((shown[-1] - shown[0] + last_duration) * time_base)


def _check_truncation(
    stream: av.video.stream.VideoStream, packet_count: int, span_s: float, demux_error: str | None,
    last_corrupt: bool,
) -> None:
    """Refuse files cut short: the header promised more than the packets deliver."""
    reasons = []
    if demux_error is not None:
        reasons.append(f"demuxing stopped with an error ({demux_error})")
    if packet_count and last_corrupt:
        reasons.append("the last packet is incomplete")
    if stream.frames and packet_count < stream.frames - 1:
        reasons.append(f"the header lists {stream.frames} frames, the file holds {packet_count}")
    header_s = stream_duration_s(stream)
    if header_s is not None and header_s - span_s > max(1.0, 0.05 * header_s):
        reasons.append(f"the header says {header_s:.2f} s, the frames cover {span_s:.2f} s")
    if reasons:
        raise MediaError(reason="the video is truncated or damaged: " + "; ".join(reasons), code=TRUNCATED_VIDEO)


def stream_duration_s(stream: av.video.stream.VideoStream) -> float | None:
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


def ffmpeg_reason(exc: BaseException) -> str:
    """A short, client-safe reason from a PyAV error (no paths: we only ever open bytes)."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    log = getattr(exc, "log", None)
    if log and isinstance(log, tuple) and len(log) >= 3 and log[2]:
        text = f"{text} ({str(log[2]).strip()})"
    return text[:300]
