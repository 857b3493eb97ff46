"""Video decoding (service/media/video.py) on synthetic videos whose frames say their own index."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.media.errors import MediaError
from service.media.sniff import sniff_container
from service.media.video import VideoReader, decode_video, probe_video
from tests.videos import decode_all, make_audio_only, make_video, read_index

av.logging.set_level(av.logging.ERROR)


def encoder_available(codec: str) -> bool:
    return codec in av.codecs_available


CASES = [
    ("mp4", "mpeg4"),
    ("mp4", "libx264"),
    ("mov", "libx264"),
    ("matroska", "libx264"),
    ("webm", "libvpx"),
    ("webm", "libvpx-vp9"),
    ("avi", "mjpeg"),
    ("mp4", "libx265"),
    ("mp4", "libsvtav1"),
]


@pytest.fixture(scope="module")
def clips() -> dict[tuple[str, str], bytes]:
    """One 23-frame 10 fps clip per container/codec the bundled FFmpeg can encode."""
    out = {}
    for container, codec in CASES:
        if encoder_available(codec):
            out[(container, codec)] = make_video(23, fps=10, codec=codec, container=container)
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{c}-{k}" for c, k in CASES])
def test_containers_and_codecs(clips: dict[tuple[str, str], bytes], case: tuple[str, str]) -> None:
    if case not in clips:
        pytest.skip(f"encoder {case[1]} not in this FFmpeg build")
    data = clips[case]
    reference, ref_times = decode_all(data)
    assert [read_index(f) for f in reference] == list(range(23))
    info = probe_video(data)
    assert (info.num_frames, info.fps, info.width, info.height) == (23, 10.0, 64, 48)
    assert info.duration == pytest.approx(2.3)
    wanted = [0, 3, 4, 11, 22, 22, 7]
    got = decode_video(data, indices=wanted)
    assert got.frames.shape == (7, 48, 64, 3) and got.frames.dtype == np.uint8
    # Bit-identical to a straight decode: seeking and skipping never change a wanted frame.
    for frame, i in zip(got.frames, wanted, strict=True):
        np.testing.assert_array_equal(frame, reference[i])
    np.testing.assert_allclose(got.timestamps, ref_times[wanted])
    assert got.positions.tolist() == wanted


def test_sniff_container() -> None:
    assert sniff_container(make_video(2, container="mp4")) == "mp4"
    assert sniff_container(make_video(2, codec="libx264", container="mov")) == "mp4"
    assert sniff_container(make_video(2, codec="libvpx-vp9", container="webm")) == "matroska"
    assert sniff_container(make_video(2, codec="mjpeg", container="avi")) == "avi"
    assert sniff_container(b"GIF89a" + bytes(20)) is None


def test_sparse_sampling_jumps_to_keyframes() -> None:
    """Four frames out of 200 with a keyframe every 10: decode ~4 partial GOPs, not the whole clip."""
    data = make_video(200, fps=25, codec="libx264", gop=10, options={"sc_threshold": "0"})
    reference, _ = decode_all(data)
    wanted = [0, 66, 133, 199]
    for threads in (0, 1, 8):  # frame threading delays output; draining makes that free
        with VideoReader(data, threads=threads) as reader:
            got = reader.frames_at_positions(wanted)
            assert reader.stats["jumps"] == 4
            assert reader.stats["packets_decoded"] <= 4 * 10
        for frame, i in zip(got.frames, wanted, strict=True):
            np.testing.assert_array_equal(frame, reference[i])
    # Dense sampling never decodes a packet twice.
    dense = list(range(0, 200, 3))
    with VideoReader(data) as reader:
        got = reader.frames_at_positions(dense)
        assert reader.stats["packets_decoded"] <= 200
    assert [read_index(f) for f in got.frames] == dense


def test_reader_reuse_and_repeats() -> None:
    data = make_video(30, codec="libx264")
    reference, _ = decode_all(data)
    with VideoReader(data) as reader:
        for wanted in ([29], [0, 29, 0], [5, 6, 7], [28, 1]):
            got = reader.frames_at_positions(wanted)
            for frame, i in zip(got.frames, wanted, strict=True):
                np.testing.assert_array_equal(frame, reference[i])


@pytest.mark.skipif(not encoder_available("libx265"), reason="no libx265 encoder")
def test_open_gop_leading_frames() -> None:
    """HEVC open GOP: frames shown before a CRA keyframe but decoded after it need the GOP before."""
    params = "log-level=error:open-gop=1:keyint=8:min-keyint=8:bframes=4:scenecut=0:pools=1:frame-threads=1"
    data = make_video(40, codec="libx265", options={"x265-params": params})
    reference, _ = decode_all(data)
    for wanted in ([6, 7], [14], [21, 22, 23], [39]):
        got = decode_video(data, indices=wanted)
        assert [read_index(f) for f in got.frames] == wanted
        for frame, i in zip(got.frames, wanted, strict=True):
            np.testing.assert_array_equal(frame, reference[i])


@pytest.mark.parametrize("container", ["mp4", "matroska"])
def test_variable_frame_rate_uses_timestamps(container: str) -> None:
    # 10 frames at 10 fps, then a 0.6 s and two 1.0 s holds, then 10 fps again (ms).
    pts = [0, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1500, 2500, 3500, 3600, 3700]
    data = make_video(len(pts), pts=pts, time_base=Fraction(1, 1000), codec="libx264", container=container)
    with VideoReader(data) as reader:
        np.testing.assert_allclose(reader.frame_times, np.asarray(pts) / 1000)
        # The frame shown at t is the last one whose timestamp is <= t (frame counters would say
        # frame 12 for t=1.2 s; the timeline says frame 9, shown from 0.9 s to 1.5 s).
        times = [0.0, 0.95, 1.2, 1.5, 2.49, 3.0, 3.55, 9.0]
        expect = [0, 9, 9, 10, 10, 11, 12, 14]
        assert reader.positions_at(times).tolist() == expect
        got = reader.frames_at(times)
        assert [read_index(f) for f in got.frames] == expect
        np.testing.assert_allclose(got.timestamps, np.asarray(pts)[expect] / 1000)
        # Indices spread over the timeline by time, not by frame count.
        n, span = reader.info.num_frames, reader.info.duration
        np.testing.assert_allclose(reader.index_times([0, 5, 14]), np.array([0, 5, 14]) * span / n)


def test_constant_rate_rounding_tolerance() -> None:
    """29.97 fps in a 1 ms time base: timestamps are rounded to the ms, indices still map 1:1."""
    data = make_video(40, fps=30000 / 1001, codec="libx264", container="matroska")
    with VideoReader(data) as reader:
        assert reader.positions_at(reader.index_times(np.arange(40))).tolist() == list(range(40))


@pytest.mark.parametrize(
    ("rotation", "hflip", "expect"),
    [
        (90, False, lambda x: np.rot90(x, 1)),
        (-90, False, lambda x: np.rot90(x, -1)),
        (180, False, lambda x: np.rot90(x, 2)),
        (90, True, lambda x: np.fliplr(np.rot90(x, 1))),
        (0, True, lambda x: np.fliplr(x)),
    ],
)
@pytest.mark.parametrize("container", ["mp4", "matroska"])
def test_rotation_display_matrix(rotation: int, hflip: bool, expect, container: str) -> None:
    data = make_video(6, codec="libx264", container=container, rotation=rotation, hflip=hflip)
    stored, _ = decode_all(data)  # the plain decode ignores the display matrix
    got = decode_video(data, indices=[1, 4])
    for frame, i in zip(got.frames, [1, 4], strict=True):
        np.testing.assert_array_equal(frame, expect(stored[i]))
    if rotation in (90, -90):
        assert got.frames.shape[1:3] == (64, 48)  # portrait now
    if rotation in (90, -90) and not hflip:
        # Undo the counter-clockwise turn: the index pattern reads back upright.
        assert read_index(np.rot90(got.frames[0], -rotation // 90)) == 1


def test_rotation_legacy_tag() -> None:
    """A Matroska ROTATE tag (clockwise degrees, no display matrix) is honoured too."""

    def tagged(n: int) -> bytes:
        buf = io.BytesIO()
        with av.open(buf, "w", format="matroska") as out:
            stream = out.add_stream("libx264", rate=10, options={"preset": "veryfast"})
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            stream.metadata["rotate"] = "90"
            for i in range(n):
                from tests.videos import index_pattern

                frame = av.VideoFrame.from_ndarray(index_pattern(i, 64, 48), format="rgb24")
                for packet in stream.encode(frame):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        return buf.getvalue()

    data = tagged(4)
    stored, _ = decode_all(data)
    got = decode_video(data, indices=[2])
    np.testing.assert_array_equal(got.frames[0], np.rot90(stored[2], -1))  # clockwise


def test_audio_and_video_streams() -> None:
    data = make_video(12, codec="libx264", audio=True)
    assert len(av.open(io.BytesIO(data)).streams) == 2
    got = decode_video(data, indices=[0, 11])
    assert [read_index(f) for f in got.frames] == [0, 11]


# -- bad input --------------------------------------------------------------------------------


def _code(data: bytes, **kwargs) -> str:
    with pytest.raises(MediaError) as err:
        decode_video(data, indices=[0], **kwargs)
    assert err.value.reason and str(err.value)
    return err.value.code


def test_empty() -> None:
    assert _code(b"") == "empty"


def test_not_a_video() -> None:
    assert _code(b"hello, this is not a video at all") == "unsupported_format"
    assert _code(b"\x89PNG\r\n\x1a\n" + bytes(100)) == "unsupported_format"


@pytest.mark.parametrize("container", ["mp4", "webm", "matroska"])
def test_audio_only(container: str) -> None:
    assert _code(make_audio_only(container)) == "no_video_stream"


def test_truncated() -> None:
    # mp4 with the index at the end: the index is gone, nothing can be read.
    plain = make_video(30, codec="libx264")
    assert _code(plain[: len(plain) // 2]) == "corrupt_video"
    # mp4 with the index first, and Matroska: the header promises more than the file holds.
    faststart = make_video(30, codec="libx264", container_options={"movflags": "faststart"})
    assert _code(faststart[: len(faststart) * 2 // 3]) == "truncated_video"
    mkv = make_video(60, codec="libx264", container="matroska")
    assert _code(mkv[: len(mkv) // 2]) == "truncated_video"
    assert _code(plain[:40]) == "corrupt_video"


@pytest.mark.parametrize(("container", "codec"), [("webm", "libvpx-vp9"), ("webm", "libvpx"), ("matroska", "libx264")])
@pytest.mark.parametrize("kept", [0.9, 0.99])
def test_matroska_cut_short_is_truncated_like_mp4(container: str, codec: str, kept: float) -> None:
    """Matroska has no frame count to compare with, and a cut cluster demuxes quietly: the first 90% of a
    3 s file lost 0.3 s, under the duration check's slack. The segment's declared size tells, as the
    sample table does for the same cut of an MP4."""
    data = make_video(30, codec=codec, container=container)
    decode_video(data, indices=[0])
    assert _code(data[: int(len(data) * kept)]) == "truncated_video"
    mp4 = make_video(30, codec="libx264", container_options={"movflags": "faststart"})
    assert _code(mp4[: int(len(mp4) * kept)]) == "truncated_video"
    # A live stream's segment has no size: nothing to compare, a whole one is read as before.
    decode_video(make_video(30, codec=codec, container=container, container_options={"live": "1"}), indices=[0])


def test_unsupported_codec() -> None:
    data = make_video(4, codec="mjpeg", container="avi")
    assert data.count(b"MJPG") >= 1
    assert _code(data.replace(b"MJPG", b"QQQQ")) == "unsupported_codec"


def test_too_many_pixels() -> None:
    data = make_video(4, width=64, height=48)
    assert _code(data, max_frame_pixels=64 * 48 - 1) == "too_many_pixels"
    assert decode_video(data, indices=[0], max_frame_pixels=64 * 48).frames.shape == (1, 48, 64, 3)


@pytest.fixture(scope="module")
def fuzz_seed_videos() -> list[bytes]:
    return [
        make_video(8, codec="libx264"),
        make_video(8, codec="libvpx-vp9", container="webm"),
        make_video(8, codec="mjpeg", container="avi"),
    ]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.integers(0, 2),
    cuts=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=6),
    keep=st.floats(0.05, 1.0),
)
def test_damaged_files_raise_media_error_only(
    fuzz_seed_videos: list[bytes], which: int, cuts, keep: float
) -> None:
    """Flipped bytes and cut files either decode or raise MediaError: never anything else."""
    data = bytearray(fuzz_seed_videos[which])
    for where, value in cuts:
        data[min(int(where * len(data)), len(data) - 1)] = value
    data = data[: max(1, int(keep * len(data)))]
    try:
        got = decode_video(bytes(data), indices=[0, 3, 7])
    except MediaError as err:
        assert err.code in {
            "corrupt_video",
            "truncated_video",
            "unsupported_format",
            "no_video_stream",
            "unsupported_codec",
            "too_many_pixels",
        }
    else:
        assert got.frames.dtype == np.uint8 and got.frames.ndim == 4


class _Side:
    """A display-matrix side datum as PyAV exposes it (type, bytes)."""

    def __init__(self, matrix: list[int]) -> None:
        self.type = type("Type", (), {"name": "DISPLAYMATRIX"})()
        self._bytes = np.array(matrix, dtype=np.int32).tobytes()

    def __bytes__(self) -> bytes:
        return self._bytes


@pytest.mark.parametrize("style", ["sequence", "mapping"])
def test_display_matrix_read_from_either_side_data_shape(style: str) -> None:
    """PyAV <= 18 iterates side data; PyAV 19 iterates their types (a mapping). Both are read."""
    from types import SimpleNamespace

    from service.media.video_frames import frame_orientation

    rotated = _Side([0, 65536, 0, -65536, 0, 0, 0, 0, 1 << 30])  # 90 degrees: a transposed matrix
    side_data = {"DISPLAYMATRIX": rotated} if style == "mapping" else [rotated]
    frame = SimpleNamespace(side_data=side_data)
    stream = SimpleNamespace(metadata={})
    assert frame_orientation(frame, stream) == (True, False, True)  # type: ignore[arg-type]
