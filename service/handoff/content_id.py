"""Content ids: a name for one item's encoder output, computed before any decoding.

A content id hashes everything that decides the output: the served model's identity (checkpoint, dtype,
device kind, preprocessing defaults, this server's version), the item's modality, every preprocessing
option the request set, and the media bytes. Two requests for the same picture with the same options get
the same id on any server that serves the same model the same way; a different `max_pixels`, another
checkpoint or another dtype give another id. So the id can key the encoder-output cache, name a shared
encoder-cache folder that several models or settings share, and travel to vLLM as the media's `uuid`.

Ids are `vit-` + 64 hex digits: letters, digits and `-`, within the id rules of the API (and of a folder
name).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PREFIX = "vit-"
SCHEME = "vitserve-content-id/1"
# Checkpoint files that define the model or its preprocessing; their bytes are hashed.
CONFIG_FILES = ("config.json", "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
_CHUNK = 1 << 20


def canonical_json(value: Any) -> bytes:
    """One spelling per value: sorted keys, no spaces (the options of a request, the identity's parts)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def checkpoint_fingerprint(model: str) -> dict[str, Any]:
    """What names a checkpoint folder's content without reading its weights: the config files' bytes and
    each weight file's name, size and modification time. A preset (random weights from a fixed seed) is
    its name."""
    folder = Path(model)
    if not folder.is_dir():
        return {"preset": model}
    out: dict[str, Any] = {"folder": str(folder.resolve())}
    for name in CONFIG_FILES:
        path = folder / name
        if path.is_file():
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    weights = []
    for path in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.safetensors.index.json")):
        st = path.stat()
        weights.append([path.name, st.st_size, st.st_mtime_ns])
    out["weights"] = weights
    return out


def model_identity(parts: Mapping[str, Any]) -> str:
    """A short hash of the served model's description (see `Handoff.identity_parts`)."""
    return hashlib.sha256(canonical_json(dict(parts))).hexdigest()[:32]


def content_id(identity: str, modality: str, options: Mapping[str, Any], data: bytes | memoryview) -> str:
    """The id of one item's output under the model `identity`; hashes the bytes in 1 MiB chunks (hashlib
    releases the GIL for each, so the worker pool hashes in parallel)."""
    h = hashlib.sha256()
    h.update(SCHEME.encode() + b"\0" + identity.encode() + b"\0" + modality.encode() + b"\0")
    h.update(canonical_json({k: v for k, v in options.items() if v is not None}) + b"\0")
    view = memoryview(data)
    for start in range(0, len(view), _CHUNK):
        h.update(view[start:start + _CHUNK])
    return PREFIX + h.hexdigest()


def process_umask() -> int:
    """The process's umask, read without changing it where Linux tells it (`os.umask` sets it process-wide
    for a moment, which other threads creating files would see)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
