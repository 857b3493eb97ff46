"""The message SGLang's language-only server takes from an encoder, written without SGLang installed.

Follows SGLang 0.5.23 (the encoder side of its encode/prefill/decode disaggregation):

- One message per encoder part, pushed over ZMQ: frame 0 is a pickled
  `sglang.srt.disaggregation.encoder.receiver.EmbeddingData` holding everything but the tensor (what its
  `copy_without_embedding` keeps), frame 1 the part's rows, C-contiguous, [tokens, width] in `dtype`. A
  failed part is frame 0 alone, with `error_msg` and `error_code` set.
- The receiver unpickles frame 0 with `safe_pickle_loads` (sglang/srt/utils/common.py): its
  `SafeUnpickler` resolves only the globals of an allowlist. The frames here name only `GLOBALS`, each on
  that list: the two SGLang classes (by their module paths, never imported here), torch dtypes and the
  legacy tensor constructors, which rebuild a tensor from a list.
- Fields, in SGLang's order: req_id (the part's id, `<rid>_local_part_<k>`), num_parts, part_idx,
  grid_dim (an int64 tensor [items, 3]), modality (`Modality` IMAGE=1, VIDEO=2), embedding (None),
  send_time (None), dtype, shape ([tokens, width]), _mr_ptr (None), error_msg, error_code, and on a
  success `video_timestamps` and `second_per_grid_ts`, None unless the family's video needs one of them
  (`MODEL_TYPES`): one entry per video of the part, which the receiver chains over the parts.
- The rows of a family with DeepStack (Qwen3-VL, its MoE, Qwen3-Omni) carry the levels after the main
  embedding on the last dimension, as vitserve's outputs already do.

`tests/test_sglang_wire.py` pins this format; `tests/test_sglang_handoff.py` has SGLang's own receiver
read it. A new SGLang release is checked there before this module follows it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SGLANG_VERSION = "0.5.23"
RECEIVER = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
MODALITY = ("sglang.srt.multimodal.modality", "Modality")
MODALITY_VALUES = {"image": 1, "video": 2}  # Modality.IMAGE, Modality.VIDEO (enum.auto())
DTYPES = ("float32", "bfloat16", "float16")
GLOBALS = frozenset({RECEIVER, MODALITY, ("torch", "LongTensor"), ("torch", "FloatTensor"),
                     *(("torch", d) for d in DTYPES)})


def patch_grid(grid: tuple[int, int, int], merge: int) -> list[int]:
    """grid_dim's row for an item as the Qwen-VL processors read it: vitserve's (t, h, w) in patches."""
    return list(grid)


def merged_grid(grid: tuple[int, int, int], merge: int) -> list[int]:
    """grid_dim's row as the merged tokens' grid (t, h / merge, w / merge), as Muse's processors read it."""
    t, h, w = grid
    if h % merge or w % merge:
        raise ValueError(f"grid {list(grid)} is not whole {merge}x{merge} merge blocks")
    return [t, h // merge, w // merge]


def first_frame_times(meta: dict[str, Any], temporal_patch_size: int) -> list[float] | None:
    """`video_timestamps` as the MiniMax-M3 and Muse processors write them into the prompt (MiniMax's
    `]<]{s:.1f} seconds[>[` before each temporal step, SGLang's, vLLM's and transformers' alike; Muse's
    `Time: {s:.1f}s` before each clip): the time of the step's first frame, its sampled index over the
    source frame rate (a step past the last frame takes the last one's). `meta` is an item's: `frame_indices`,
    `video_fps`."""
    indices, fps = meta.get("frame_indices"), meta.get("video_fps")
    if not indices or not fps:
        return None
    steps = -(-len(indices) // temporal_patch_size)
    return [int(indices[min(k * temporal_patch_size, len(indices) - 1)]) / float(fps) for k in range(steps)]


@dataclass(frozen=True)
class ModelType:
    """How SGLang's language side reads the parts of one model type: the video field its prompt or M-RoPE
    reads (one value per video), whether it takes video from an encoder at all, the grid_dim row it sizes
    an item's placeholders from (given vitserve's (t, h, w) in patches and the merge size), and for
    `video_timestamps` how a temporal step's time is taken from an item's meta (None: Qwen3-VL's, the mean of
    the step's first and last frame)."""

    video_field: str | None = None
    takes_video: bool = True
    grid_row: Callable[[tuple[int, int, int], int], list[int]] = patch_grid
    step_times: Callable[[dict[str, Any], int], list[float] | None] | None = None


# The model types SGLang's encoder disaggregation accepts (its server-argument check) that vitserve serves.
# Qwen3-VL's and Qwen3.5's prompts hold each temporal step's time; the M-RoPE of Qwen2.5-VL and the Omni
# models spaces the steps by seconds per step; Qwen2-VL reads neither, nor does GLM-5-Next (SGLang's GLM
# processor expands a video's one placeholder to all its rows). Qwen3.8 (qwen4_exp) and Cosmos3-Nano are not on
# SGLang's list, whose language-only server refuses them; dots3-note is on it, but SGLang 0.5.23's language
# side cannot assemble its parts (docs/sglang.md). MiniMax-M3's prompt holds each temporal step's time too (its
# first frame's); its grid row is the whole video's (t, h, w), which its tower cuts into clips of four steps
# itself. Kimi-K2.5/K2.6: an image's row is its patch grid (1, h, w), h*w/4 tokens, as Moonshot's processor
# writes `grid_thws`; SGLang's Kimi processor places image rows alone (its model has no video path), so a video
# part is refused.
MODEL_TYPES: dict[str, ModelType] = {
    "qwen2_vl": ModelType(),
    "qwen2_5_vl": ModelType("second_per_grid_ts"),
    "qwen3_vl": ModelType("video_timestamps"), "qwen3_vl_moe": ModelType("video_timestamps"),
    "qwen3_5": ModelType("video_timestamps"), "qwen3_5_moe": ModelType("video_timestamps"),
    "qwen2_5_omni": ModelType("second_per_grid_ts"), "qwen2_5_omni_thinker": ModelType("second_per_grid_ts"),
    "qwen3_omni_moe": ModelType("second_per_grid_ts"), "qwen3_omni_moe_thinker": ModelType("second_per_grid_ts"),
    "minimax_m3_vl": ModelType("video_timestamps", step_times=first_frame_times),
    # SGLang's Muse processor (muse_spark_omni) reads merged grids: an image's t*h*w tokens, a video's t clips
    # of h*w tokens, each after its first frame's time, as transformers' MuseSparkProcessor prints them.
    "muse_spark": ModelType("video_timestamps", grid_row=merged_grid, step_times=first_frame_times),
    "kimi_k25": ModelType(takes_video=False),
    "glm5_next": ModelType(),
}


@dataclass(frozen=True)
class PartMeta:
    """What frame 0 says of one part's rows."""

    req_id: str
    num_parts: int
    part_idx: int
    modality: str  # image | video
    grids: list[list[int]]  # grid_dim: one row per item, in the rows' order
    dtype: str  # the served dtype's torch name
    shape: tuple[int, int]  # [tokens, width]
    video_timestamps: list[list[float]] | None = None  # per video: the seconds of each temporal step
    second_per_grid_ts: list[float] | None = None  # per video


def metadata_frame(meta: PartMeta) -> bytes:
    if meta.dtype not in DTYPES:
        raise ValueError(f"dtype {meta.dtype} has no SGLang name here")
    seconds = None if meta.second_per_grid_ts is None else _Call(("torch", "FloatTensor"),
                                                                   [float(s) for s in meta.second_per_grid_ts])
    state = _state(meta.req_id, meta.num_parts, meta.part_idx, meta.modality,
                   grid_dim=_Call(("torch", "LongTensor"), [[int(x) for x in g] for g in meta.grids]),
                   dtype=_Global(("torch", meta.dtype)), shape=[int(meta.shape[0]), int(meta.shape[1])])
    state["video_timestamps"] = meta.video_timestamps
    state["second_per_grid_ts"] = seconds
    return _dumps(_Object(RECEIVER, state))


def error_frame(req_id: str, num_parts: int, part_idx: int, modality: str, message: str, code: int) -> bytes:
    """A failed part: the receiver fails that request with `message` and `code` (an HTTP status)."""
    state = _state(req_id, num_parts, part_idx, modality, grid_dim=None, dtype=None, shape=None)
    state["error_msg"], state["error_code"] = message, int(code)
    return _dumps(_Object(RECEIVER, state))


def _state(req_id: str, num_parts: int, part_idx: int, modality: str, *, grid_dim: Any, dtype: Any,
           shape: Any) -> dict[str, Any]:
    return {"req_id": req_id, "num_parts": int(num_parts), "part_idx": int(part_idx), "grid_dim": grid_dim,
            "modality": _Call(MODALITY, MODALITY_VALUES[modality]), "embedding": None, "send_time": None,
            "dtype": dtype, "shape": shape, "_mr_ptr": None, "error_msg": None, "error_code": None}


# ---- a pickle writer for plain data and named globals -------------------------------------------------
# Python's pickler writes a class or function only after importing its module to check the name, and
# SGLang's modules are not here: this writer emits protocol 2 opcodes itself.
@dataclass(frozen=True)
class _Global:
    name: tuple[str, str]


@dataclass(frozen=True)
class _Call:
    """`name(arg)` when unpickled."""

    name: tuple[str, str]
    arg: Any


@dataclass(frozen=True)
class _Object:
    """An instance of class `name` whose __dict__ is `state` (no __init__ runs)."""

    name: tuple[str, str]
    state: dict[str, Any]


def _dumps(value: Any) -> bytes:
    out = bytearray(b"\x80\x02")  # PROTO 2
    _write(out, value)
    out += b"."  # STOP
    return bytes(out)


def _global(out: bytearray, name: tuple[str, str]) -> None:
    if name not in GLOBALS:
        raise ValueError(f"{name} is not a global this module may name")
    out += b"c" + name[0].encode() + b"\n" + name[1].encode() + b"\n"  # GLOBAL


def _write(out: bytearray, value: Any) -> None:
    if value is None:
        out += b"N"
    elif value is True or value is False:
        out += b"\x88" if value else b"\x89"
    elif isinstance(value, int):
        if 0 <= value < 256:
            out += b"K" + bytes([value])  # BININT1
        elif -(2**31) <= value < 2**31:
            out += b"J" + struct.pack("<i", value)  # BININT
        else:
            raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            out += b"\x8a" + bytes([len(raw)]) + raw  # LONG1
    elif isinstance(value, float):
        out += b"G" + struct.pack(">d", value)  # BINFLOAT
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE
    elif isinstance(value, list):
        out += b"]"  # EMPTY_LIST
        if value:
            out += b"("  # MARK
            for v in value:
                _write(out, v)
            out += b"e"  # APPENDS
    elif isinstance(value, dict):
        out += b"}"  # EMPTY_DICT
        if value:
            out += b"("
            for k, v in value.items():
                _write(out, str(k))
                _write(out, v)
            out += b"u"  # SETITEMS
    elif isinstance(value, _Global):
        _global(out, value.name)
    elif isinstance(value, _Call):
        _global(out, value.name)
        _write(out, value.arg)
        out += b"\x85R"  # TUPLE1, REDUCE
    elif isinstance(value, _Object):
        _global(out, value.name)
        out += b")\x81"  # EMPTY_TUPLE, NEWOBJ
        _write(out, value.state)
        out += b"b"  # BUILD
    else:
        raise TypeError(f"cannot write {type(value).__name__}")
