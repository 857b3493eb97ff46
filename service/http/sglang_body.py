"""SGLang's /encode body for one part, and the rows and metadata vitserve pushes for it (service/http/sglang.py
serves them; service/handoff/sglang_wire.py writes the metadata). Follows SGLang 0.5.23."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from service import shm
from service.engine.types import ItemResult, ModelInfo
from service.handoff import sglang_wire as wire
from service.handoff.sglang_push import DeliveryFailed
from service.handoff.vllm import grid_timestamps, seconds_per_step
from service.http.errors import ApiError, item_error
from service.http.parsing import Pending, check_count, decode_media
from service.settings import ServeSettings

HASH = re.compile(r"^sha256:[0-9a-fA-F]{64}$")


@dataclass
class EncodePart:
    req_id: str
    modality: str
    num_parts: int
    part_idx: int
    prefill_host: str | None
    embedding_port: int | list[int] | None  # None: the ranks register (zmq_to_scheduler)
    items: list[Pending]
    hashes: list[str | None]


def bad(message: str, code: str = "invalid_request") -> ApiError:
    return ApiError(400, "invalid_request", message, code)


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_part(obj: dict[str, Any], settings: ServeSettings) -> EncodePart:
    """SGLang's /encode body, checked as its encoder checks it (`validate_encode_request`), then each item."""
    req_id, modality = obj.get("req_id"), obj.get("modality")
    if not isinstance(req_id, str) or not req_id:
        raise bad("missing or invalid req_id")
    if not isinstance(modality, str):
        raise bad("missing or invalid modality")
    if modality.upper() not in ("IMAGE", "VIDEO", "AUDIO"):
        raise bad(f"unsupported modality: {modality}")
    if modality.upper() == "AUDIO":
        raise bad("unsupported modality: AUDIO (vitserve encodes images and videos)", "unsupported_modality")
    num_parts, part_idx = obj.get("num_parts"), obj.get("part_idx")
    if not is_count(num_parts) or num_parts <= 0:
        raise bad("num_parts must be a positive integer")
    if not is_count(part_idx) or not 0 <= part_idx < num_parts:
        raise bad(f"part_idx must be in [0, {num_parts})")
    port, host = obj.get("embedding_port"), obj.get("prefill_host")
    ports = port if isinstance(port, list) else [] if port is None else [port]
    if not all(is_count(p) and 0 < p < 65536 for p in ports):
        raise bad("embedding_port must be a port number, a list of them, or null")
    if ports and (not isinstance(host, str) or not host):
        raise bad("prefill_host is required with an embedding_port")
    raw = obj.get("mm_items")
    flat: list[Any] = []
    stack = [raw] if not isinstance(raw, list) else list(reversed(raw))
    while stack:  # nested lists, as SGLang's loader takes them
        entry = stack.pop()
        if isinstance(entry, (list, tuple)):
            stack.extend(reversed(entry))
        elif entry is not None:
            flat.append(entry)
    if not flat:
        raise bad("missing or empty mm_items")
    check_count(len(flat), settings)
    kind = modality.lower()
    items, hashes = [], []
    for i, entry in enumerate(flat):
        value, digest = entry, None
        if isinstance(entry, dict):
            value, digest = entry.get("url"), entry.get("content_hash")
            if digest is not None and (not isinstance(digest, str) or not HASH.match(digest)):
                raise item_error(i, "content_hash must use the form 'sha256:<64 hex digits>'", "invalid_hash")
        if not isinstance(value, str) or not value:
            raise item_error(i, "an item is a URL or data URL, or an object with one under 'url'", "invalid_item")
        data, url = decode_media(value, i, kind, settings.allow_url)
        items.append(Pending(i, kind, data, url))
        hashes.append(digest.lower() if digest else None)
    return EncodePart(req_id, kind, num_parts, part_idx, host, port, items, hashes)


def refused(exc: DeliveryFailed) -> ApiError:
    return ApiError(exc.status, "delivery_failed" if exc.status >= 500 else "invalid_request", exc.message, exc.code)


def endpoint(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def receive_endpoint(value: Any) -> str:
    """SGLang's `receive_url` (`host:port`, `[v6]:port`, or with tcp://) as a ZMQ endpoint."""
    text = value.removeprefix("tcp://") if isinstance(value, str) else ""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise bad(f"receive_url must be host:port, got {value!r}")
    return endpoint(host, int(port))


def part_frames(part: EncodePart, results: list[ItemResult], model: ModelInfo, served: wire.ModelType) -> list[Any]:
    """[metadata, rows]: every item's rows, in order, in one buffer (read from their segments)."""
    rows = sum(r.output.rows for r in results)
    buf = bytearray(sum(r.output.nbytes for r in results))
    offset = 0
    for r in results:
        if r.output.nbytes:
            shm.read_into(r.output.segment, np.frombuffer(buf, np.uint8, r.output.nbytes, offset))
        offset += r.output.nbytes
    stamps = seconds = None
    field = served.video_field
    if part.modality == "video" and field == "video_timestamps":
        times = served.step_times or grid_timestamps
        stamps = [times(r.meta, model.processor.temporal_patch_size) for r in results]
        if any(s is None or len(s) != r.grid_thw[0] for s, r in zip(stamps, results)):
            raise RuntimeError(f"{part.req_id}: a video without a timestamp per temporal step")
    elif part.modality == "video" and field == "second_per_grid_ts":
        seconds = [seconds_per_step(r.meta) for r in results]
        if any(s is None for s in seconds):
            raise RuntimeError(f"{part.req_id}: a video without its seconds per temporal step")
    merge = model.processor.video_merge_size if part.modality == "video" else model.processor.merge_size
    grids = [served.grid_row(tuple(r.grid_thw), merge) for r in results]  # type: ignore[arg-type]
    meta = wire.PartMeta(part.req_id, part.num_parts, part.part_idx, part.modality, grids, model.dtype_name,
                         (rows, model.width), stamps, seconds)
    return [wire.metadata_frame(meta), buf]


def digest(data: bytes) -> str:
    """A `content_hash` as SGLang writes it."""
    return "sha256:" + hashlib.sha256(data).hexdigest()
