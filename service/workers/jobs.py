"""What runs in the worker processes (`pool.WorkerPool`): a request's media in, its response body out.

- `prepare_media`: bytes (in the message, or a segment for large media) -> estimated cost, asked of the
  server before any decoding (admission counts it) -> decoded and preprocessed uint8 patches, written
  to the item's pixel segment.
- `encode_item`: one item's embedding rows (a segment the engine wrote) -> its JSON entry in the
  requested format and dtype (`item_json`), written to a segment the server streams to the client.
- `encode_safetensors`: every item of a request -> one safetensors body (`safetensors_file`).
The server runs `item_json` and `safetensors_file` itself for a request that is alone in its front.
`warm_up` runs once in each new worker, before its first job.

Input problems raise `MediaError` (a client error: the pool hands it back as it is); anything else is a
bug, logged with its traceback by the pool.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.config import ProcessorConfig, VisualInput
from service import shm
from service.engine.types import ItemView, OutputRef
from service.media.limits import MediaLimits


@dataclass
class Prepared:
    grid_thw: tuple[int, int, int]
    num_patches: int
    meta: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def _read(segment: str, length: int) -> bytes:
    mapping = shm.open_segment(segment)
    try:
        return bytes(mapping[:length])
    finally:
        mapping.close()


def prepare_media(ctx: Any, source: bytes | str, length: int, modality: str, cfg: ProcessorConfig,
                  options: dict[str, Any], limits: MediaLimits, pixels: str) -> Prepared:
    """Estimate from the header or container metadata, ask the server to admit that cost, then decode and
    preprocess within `limits`; the patches go to segment `pixels`. `source`: the media's bytes, or the
    segment holding them (large media)."""
    from service.media.estimate import estimate_image, estimate_video
    from service.media.images import read_header

    t0 = time.perf_counter()
    data = source if isinstance(source, bytes) else _read(source, length)
    if modality == "image":
        header = read_header(data, limits.max_image_pixels)  # once, for the estimate and the decode
        cost = estimate_image(data, cfg, min_pixels=options.get("min_pixels"), max_pixels=options.get("max_pixels"),
                              limits=limits, header=header)
    else:
        cost = estimate_video(data, cfg, limits=limits, **options)
    ctx.ask(cost)  # admission: raises Aborted (no result) when the server refuses the item
    if modality == "image":
        from service.media.image_preprocess import preprocess_image_bytes

        visual: VisualInput = preprocess_image_bytes(data, cfg, options.get("min_pixels"), options.get("max_pixels"),
                                                     limits=limits, header=header)
    else:
        from service.media.video_preprocess import preprocess_video_bytes

        visual = preprocess_video_bytes(data, cfg, threads=1, workers=1, limits=limits, **options)
    del data
    shm.write_array(pixels, visual.pixels)
    return Prepared(tuple(int(x) for x in visual.grid_thw), visual.num_patches,  # type: ignore[arg-type]
                    visual.meta, time.perf_counter() - t0)


SAMPLE_IMAGE = Path(__file__).resolve().parents[1] / "assets" / "sample.jpg"


def warm_up() -> None:
    """The image path once, on the bundled sample. A fresh worker's first image took about 230 ms instead
    of 2.5 (2-core dev box): imports, now done once in the fork server (`processes.PRELOAD`), and first-use
    initialisation (PIL's plugins, the first call of each numpy and torch routine), paid here instead."""
    from service.media.estimate import estimate_image
    from service.media.image_preprocess import preprocess_image_bytes

    data = SAMPLE_IMAGE.read_bytes()
    cfg = ProcessorConfig()
    estimate_image(data, cfg, limits=MediaLimits())
    preprocess_image_bytes(data, cfg, limits=MediaLimits())


# ---- responses --------------------------------------------------------------------------------
def read_rows(ref: OutputRef, out: np.ndarray | None = None) -> torch.Tensor:
    """The joined rows [rows, width] of the served dtype, read from the segment with pread into `out`
    (bytes, at least `ref.nbytes`; default a new array). Reading costs less than mapping: populating and
    unmapping one image's 1.8 MB took 0.36 ms against 0.1 ms to read it into a warm buffer (2 cores)."""
    dtype = getattr(torch, ref.dtype)
    if ref.rows == 0:
        return torch.empty((0, ref.width), dtype=dtype)
    raw = (np.empty(ref.nbytes, np.uint8) if out is None else out)[:ref.nbytes]
    shm.read_into(ref.segment, raw)
    return torch.from_numpy(raw).view(dtype).view(ref.rows, ref.width)


def load_rows(ref: OutputRef) -> torch.Tensor:
    """The joined rows in the served dtype, in memory of their own: for a caller that outlives the segment."""
    return read_rows(ref)


# One thread's buffer for the rows it encodes, kept between jobs: a fresh one faults its pages in anew.
_SCRATCH = threading.local()
SCRATCH_MAX_BYTES = 16 << 20  # rows above this are read into a buffer of their own, freed after


def _scratch(nbytes: int) -> np.ndarray | None:
    if nbytes > SCRATCH_MAX_BYTES:
        return None
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _SCRATCH.buf = np.empty(max(nbytes, 4 << 20), np.uint8)
    return buf


def views(results: list[dict[str, Any]], hidden: int, dtype: torch.dtype) -> list[ItemView]:
    """The items' rows split into their levels, in `dtype`. One item's rows may sit in this thread's
    scratch buffer: use them before the thread's next call, and keep only copies."""
    scratch = len(results) == 1
    out = []
    for result in results:
        ref = result["output"]
        rows = read_rows(ref, _scratch(ref.nbytes) if scratch else None).to(dtype)
        levels = [rows[:, j:j + hidden] for j in range(0, rows.shape[1], hidden)]
        out.append(ItemView(result["index"], result["modality"], result["id"], tuple(result["grid_thw"]),  # type: ignore[arg-type]
                            result["num_patches"], result["num_tokens"], result["meta"], levels[0].contiguous(),
                            [lv.contiguous() for lv in levels[1:]], rows, result.get("content_id"),
                            result.get("uuid")))
    return out


def shape_view(result: dict[str, Any], hidden: int) -> ItemView:
    """An item's view without its rows: tensors of the right shapes on the meta device (no memory)."""
    ref = result["output"]
    levels = [torch.empty((ref.rows, hidden), device="meta") for _ in range(max(1, ref.width // hidden))]
    return ItemView(result["index"], result["modality"], result["id"], tuple(result["grid_thw"]),  # type: ignore[arg-type]
                    result["num_patches"], result["num_tokens"], result["meta"], levels[0], levels[1:],
                    torch.empty((ref.rows, ref.width), device="meta"), result.get("content_id"), result.get("uuid"))


def item_json(result: dict[str, Any], *args: Any) -> list[bytes]:
    """One item's JSON entry in a response, in parts (`encoders.spliced_parts`: a megabytes-long base64
    payload is not copied into one joined body); its output is retired once read."""
    parts = _item_parts(result, *args)
    _release([result])
    return parts


def _item_parts(result: dict[str, Any], fmt: str, dtype: str, include_deepstack: bool, hidden: int, family: str,
                temporal_patch_size: int) -> list[bytes]:
    from service.http import encoders

    if fmt == "vllm_ref":  # metadata only: reading (and casting) the rows cost milliseconds for nothing
        item = shape_view(result, hidden)
    else:
        item, = views([result], hidden, encoders.DTYPES[dtype])
    return encoders.spliced_parts(encoders.item_entry(item, fmt, dtype, include_deepstack, family,
                                                      temporal_patch_size))


def safetensors_file(results: list[dict[str, Any]], header: dict[str, Any], hidden: int) -> bytes:
    """Every item of a request as one safetensors body; the outputs are retired once read."""
    body = _safetensors_body(results, header, hidden)
    _release(results)
    return body


def _safetensors_body(results: list[dict[str, Any]], header: dict[str, Any], hidden: int) -> bytes:
    from service.http import encoders

    items = views(results, hidden, encoders.DTYPES[header["dtype"]])
    return encoders.safetensors_body(items, **header)


def _release(results: list[dict[str, Any]]) -> None:
    """Retire the outputs the server left to their encoder: read now, and what was encoded is a copy."""
    for r in results:
        if r.get("release"):
            shm.retire(r["output"].segment)


def encode_item(ctx: Any, out: str, result: dict[str, Any], *args: Any) -> int:
    """`item_json` into segment `out`; returns its length in bytes. The output is retired only once the
    length is sent: a worker killed before then leaves it whole for the job's next run."""
    n = _written(out, _item_parts(result, *args))
    ctx.once_answered(lambda: _release([result]))
    return n


def encode_safetensors(ctx: Any, out: str, results: list[dict[str, Any]], *args: Any) -> int:
    """`safetensors_file` into segment `out`; returns its length in bytes (outputs retired as above)."""
    n = _written(out, [_safetensors_body(results, *args)])
    ctx.once_answered(lambda: _release(results))
    return n


def _written(out: str, parts: list[bytes]) -> int:
    shm.write_parts(out, parts)
    return sum(len(p) for p in parts)



