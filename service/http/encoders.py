"""Engine results -> response bodies: JSON (float, base64 or vLLM content parts) or one safetensors file.

These run in the worker pool, never on the event loop: serialising megabytes of floats is CPU work.

The vLLM formats (`vllm`: embeddings inline; `vllm_ref`: a reference to the shared encoder-cache folder)
put a chat content part in each entry instead of the embedding; `service.handoff.vllm` builds them and
says what vLLM's code requires of them.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import pybase64  # SIMD base64: an image's embedding is megabytes
import torch
from safetensors.torch import save

from service.engine.types import ItemView
from service.handoff import vllm
from service.handoff.vllm import torch_b64  # noqa: F401 - part of this module's interface

SAFETENSORS_MEDIA_TYPE = "application/vnd.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def raw_base64(t: torch.Tensor) -> bytes:
    """Row-major little-endian bytes of the tensor, as base64 text (ASCII bytes; see `json_body`)."""
    t = t.detach().contiguous().cpu()
    if sys.byteorder != "little" and t.element_size() > 1:
        raise RuntimeError("big-endian hosts are not supported")
    return pybase64.b64encode(t.reshape(-1).view(torch.uint8).numpy())


def float_rows(t: torch.Tensor) -> list[list[float]]:
    # Values of the requested dtype, exactly representable as float64 JSON numbers.
    return t.detach().cpu().to(torch.float64).tolist()


def grid_tensor(r: ItemView) -> torch.Tensor:
    return torch.tensor(r.grid_thw, dtype=torch.int64)


# What a video's entry carries besides its embedding (docs/api.md): the times M-RoPE and vLLM need, and
# the sampling rate used against the one asked for (min_frames may raise it, max_frames lower it).
VIDEO_FIELDS = ("timestamps", "second_per_grid_ts", "fps", "requested_fps", "fps_adjusted_by")


def video_fields(r: ItemView) -> dict[str, Any]:
    if r.modality != "video":
        return {}
    out: dict[str, Any] = {}
    for key in VIDEO_FIELDS:
        value = r.meta.get(key)
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        elif hasattr(value, "tolist"):  # numpy arrays and scalars
            value = value.tolist()
        elif isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out


def item_entry(r: ItemView, fmt: str, dtype: str, include_deepstack: bool, family: str = "",
               temporal_patch_size: int = 2) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": r.index, "type": r.modality}
    if r.id is not None:
        entry["id"] = r.id
    if r.content_id is not None:
        entry["content_id"] = r.content_id
    entry.update(grid_thw=list(r.grid_thw), num_tokens=r.num_tokens, shape=list(r.embeds.shape), dtype=dtype)
    if fmt in vllm.VLLM_FORMATS:
        entry["content_part"] = vllm.content_part(r, fmt, family, temporal_patch_size)
        notes = vllm.warnings(r, family, fmt)
        if notes:
            entry["warnings"] = notes
    else:
        encode = float_rows if fmt == "float" else raw_base64
        entry["embedding"] = encode(r.embeds)
        if include_deepstack:
            entry["deepstack"] = [encode(d) for d in r.deepstack]
    entry.update(video_fields(r))
    return entry


def usage(results: Sequence[Any]) -> dict[str, int]:
    return {
        "images": sum(r.modality == "image" for r in results),
        "videos": sum(r.modality == "video" for r in results),
        "patches": sum(r.num_patches for r in results),
        "tokens": sum(r.num_tokens for r in results),
    }




def spliced_parts(body: Any) -> list[bytes]:
    """JSON of `body`, whose `bytes` values are base64 text written into the output as they are, in
    parts: the JSON around each payload, and the payload object itself (not copied).

    An image's base64 embedding is megabytes; json.dumps would scan every character for escapes
    (half the serialisation time, and base64 has nothing to escape) and then copy it twice. Each
    payload is dumped as a placeholder holding its index, between two copies of a per-call random
    marker that no request can predict, and put back in its place among the parts.
    """
    marker = f"@{uuid.uuid4().hex}@"
    payloads: list[bytes] = []

    def placeholder(value: Any) -> str:
        if not isinstance(value, bytes):
            raise TypeError(f"{type(value).__name__} is not JSON serialisable")
        payloads.append(value)
        return f"{marker}{len(payloads) - 1}{marker}"

    text = json.dumps(body, separators=(",", ":"), allow_nan=False, default=placeholder).encode()
    if not payloads:
        return [text]
    parts = text.split(marker.encode())  # [before, index, between, index, ..., after]
    out = [parts[0]]
    for i in range(1, len(parts), 2):
        out += [payloads[int(parts[i])], parts[i + 1]]
    return out


def safetensors_body(results: Sequence[ItemView], *, request_id: str, model: str, dtype: str,
                     include_deepstack: bool, family: str = "") -> bytes:
    """`embeds.<i>` [tokens, D], `grid_thw.<i>` [1, 3] int64, `deepstack.<i>.<j>`; metadata names the
    model and describes the inputs (JSON in the `inputs` entry)."""
    tensors: dict[str, torch.Tensor] = {}
    inputs = []
    for r in results:
        i = r.index
        tensors[f"embeds.{i}"] = r.embeds.contiguous()
        tensors[f"grid_thw.{i}"] = grid_tensor(r).reshape(1, 3)
        if include_deepstack:
            for j, d in enumerate(r.deepstack):
                tensors[f"deepstack.{i}.{j}"] = d.contiguous()
        inputs.append({"index": i, "type": r.modality, "id": r.id, "grid_thw": list(r.grid_thw),
                       "num_tokens": r.num_tokens, **video_fields(r)})
    metadata = {
        "format": "pt",
        "model": model,
        "family": family,
        "id": request_id,
        "dtype": dtype,
        "inputs": json.dumps(inputs, separators=(",", ":")),
        "usage": json.dumps(usage(results), separators=(",", ":")),
    }
    return save(tensors, metadata=metadata)
