"""The message vitserve pushes to SGLang's receivers (service/handoff/sglang_wire.py), pinned without SGLang.

SGLang 0.5.23 unpickles frame 0 with an allowlist of globals (`SafeUnpickler`) into its `EmbeddingData`:
these tests fail when the frame names another global, or its fields, their order or their encoding change.
tests/test_sglang_handoff.py has SGLang's own unpickler read the same frames and compares them with what its
own encoder pickles.
"""

from __future__ import annotations

import enum
import hashlib
import io
import pickle
import pickletools
from typing import Any

import pytest
import torch

from service.handoff import sglang_wire as wire
from service.handoff.vllm import grid_timestamps

# SGLang 0.5.23: `EmbeddingData.copy_without_embedding()`'s __dict__, in order, as its encoder pickles it.
FIELDS = ["req_id", "num_parts", "part_idx", "grid_dim", "modality", "embedding", "send_time", "dtype", "shape",
          "_mr_ptr", "error_msg", "error_code"]
SUCCESS_FIELDS = FIELDS + ["video_timestamps", "second_per_grid_ts"]
# Entries of SGLang 0.5.23's SafeUnpickler.ALLOWED_GLOBALS that the frames may name.
ALLOWED = {("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"),
           ("sglang.srt.multimodal.modality", "Modality"), ("torch", "LongTensor"), ("torch", "FloatTensor"),
           ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16")}

VIDEO = wire.PartMeta("rid_local_part_1", 3, 1, "video", [(2, 4, 6), (1, 4, 4)], "bfloat16", (16, 2048),
                      video_timestamps=[[0.25, 1.25], [0.5]])


class Modality(enum.Enum):  # SGLang's values (enum.auto())
    IMAGE = 1
    VIDEO = 2
    AUDIO = 3


class EmbeddingData:
    pass


class Reader(pickle.Unpickler):
    """Stand-ins for SGLang's classes; records every global the frame names."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.named: list[tuple[str, str]] = []

    def find_class(self, module: str, name: str) -> Any:
        self.named.append((module, name))
        if (module, name) == wire.RECEIVER:
            return EmbeddingData
        if (module, name) == wire.MODALITY:
            return Modality
        if module == "torch":
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read(data: bytes) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    reader = Reader(data)
    obj = reader.load()
    assert type(obj) is EmbeddingData
    return obj.__dict__, reader.named


def test_the_globals_are_sglangs_allowlisted_ones():
    assert wire.GLOBALS == ALLOWED
    assert wire.SGLANG_VERSION == "0.5.23"


def test_a_video_part():
    state, named = read(wire.metadata_frame(VIDEO))
    assert list(state) == SUCCESS_FIELDS
    assert set(named) <= ALLOWED
    assert state["req_id"] == "rid_local_part_1" and (state["num_parts"], state["part_idx"]) == (3, 1)
    assert state["grid_dim"].dtype == torch.int64 and state["grid_dim"].tolist() == [[2, 4, 6], [1, 4, 4]]
    assert state["modality"] is Modality.VIDEO and state["dtype"] is torch.bfloat16
    assert state["shape"] == [16, 2048] and isinstance(state["shape"], list)
    assert state["video_timestamps"] == [[0.25, 1.25], [0.5]] and state["second_per_grid_ts"] is None
    assert [state[k] for k in ("embedding", "send_time", "_mr_ptr", "error_msg", "error_code")] == [None] * 5


def test_seconds_per_step_are_a_float32_tensor():
    """Qwen3-Omni's M-RoPE calls .cpu() on each video's value: a tensor, as SGLang's encoder sends it."""
    part = wire.PartMeta("s_local_part_0", 1, 0, "video", [(2, 4, 4)], "float32", (8, 64), second_per_grid_ts=[0.5])
    state, _ = read(wire.metadata_frame(part))
    seconds = state["second_per_grid_ts"]
    assert isinstance(seconds, torch.Tensor) and seconds.dtype == torch.float32 and seconds.tolist() == [0.5]
    assert state["video_timestamps"] is None and state["dtype"] is torch.float32


def test_minimax_and_muse_time_a_temporal_step_by_its_first_frame():
    """The MiniMax-M3 and Muse prompts time each step by its first frame's index over the source rate
    (Qwen3-VL's would be 0.5, 2.5, 4.0 here); a step that pads an odd count with the last frame starts at
    that frame."""
    meta = {"frame_indices": [0, 3, 6, 9, 12], "video_fps": 3.0}
    assert wire.first_frame_times(meta, 2) == [0.0, 2.0, 4.0]
    assert grid_timestamps(meta, 2) == [0.5, 2.5, 4.0]
    assert wire.first_frame_times({"frame_indices": [5, 10], "video_fps": 10.0}, 2) == [0.5]
    assert wire.first_frame_times({"frame_indices": [0, 3]}, 2) is None  # no source rate: no times
    assert wire.MODEL_TYPES["minimax_m3_vl"].step_times is wire.first_frame_times
    assert wire.MODEL_TYPES["muse_spark"].step_times is wire.first_frame_times


def test_an_error_part():
    state, named = read(wire.error_frame("e_local_part_0", 2, 0, "image", "item 1: bad", 422))
    assert list(state) == FIELDS
    assert named == [wire.RECEIVER, wire.MODALITY]
    assert (state["error_msg"], state["error_code"], state["modality"]) == ("item 1: bad", 422, Modality.IMAGE)
    assert state["grid_dim"] is None and state["dtype"] is None and state["shape"] is None


def test_the_bytes_are_pinned():
    """Protocol 2, no memo: the same part gives the same bytes (a change here is a format change)."""
    data = wire.metadata_frame(VIDEO)
    assert data[:2] == b"\x80\x02" and data[-1:] == b"."
    ops = {op.name for op, _, _ in pickletools.genops(data)}
    assert ops <= {"PROTO", "GLOBAL", "EMPTY_TUPLE", "NEWOBJ", "EMPTY_DICT", "MARK", "BINUNICODE", "BININT1",
                   "BININT2", "BININT", "EMPTY_LIST", "APPENDS", "TUPLE1", "REDUCE", "NONE", "BINFLOAT",
                   "SETITEMS", "BUILD", "STOP"}, ops
    assert hashlib.sha256(data).hexdigest()[:16] == "ebaef15275bc93f7"


@pytest.mark.parametrize("value", [0, 255, 256, 70000, -1, 2**31, -(2**40)])
def test_integers_of_every_size(value):
    part = wire.PartMeta("i", 1, 0, "image", [(1, value, 1)], "float16", (1, 1))
    state, _ = read(wire.metadata_frame(part))
    assert state["grid_dim"].tolist() == [[1, value, 1]]


def test_no_other_dtype_or_value():
    with pytest.raises(ValueError):
        wire.metadata_frame(wire.PartMeta("x", 1, 0, "image", [(1, 2, 2)], "int8", (1, 1)))
    with pytest.raises(TypeError):
        wire._dumps(object())


def test_muses_rows_are_merged_grids():
    """SGLang's Muse processor sizes an image by t*h*w of grid_dim's row and a video's clips by h*w: the
    merged tokens' grid, not the patches' that the Qwen-VL processors read."""
    muse, qwen = wire.MODEL_TYPES["muse_spark"], wire.MODEL_TYPES["qwen3_vl"]
    assert muse.grid_row((1, 8, 10), 2) == [1, 4, 5] and muse.grid_row((2, 4, 6), 2) == [2, 2, 3]
    assert qwen.grid_row((1, 8, 10), 2) == [1, 8, 10]
    with pytest.raises(ValueError, match="merge blocks"):
        muse.grid_row((1, 8, 9), 2)
