"""Encoder outputs on a shared folder, in the layout of vLLM's shared-storage encoder-cache connector.

vLLM's `ECExampleConnector` (vllm/distributed/ec_transfer/ec_connector/example_connector.py) reads
`<shared_storage_path>/<identifier>/encoder_cache.safetensors` and takes the tensor named `ec_cache`: the
item's merged tokens [tokens, hidden] as the language model consumes them, so Qwen3-VL's DeepStack features
follow the main embedding along the hidden dimension. It checks no shape: rows past the placeholder's
length are cut silently. The identifier is the media's `uuid` only under conditions (docs/sidecar.md).

Writes are atomic: a temporary file in the target folder, renamed over the target, so a reader never sees
a partial file. They are not made durable (no fsync) unless `durable`: a file is a cache entry whose
metadata vitserve checks before serving it, vLLM reads it moments after from the page cache, and an fsync
put the disk's flush on every request's path (a crash's torn file fails the check and is written again).
The file is written with one `writev` of its header and the rows, without a serialised copy. Its mode is
what the operator's umask gives a new file (0644 under the usual 022), so an LLM server running as another
user can read it. A full disk raises `StorageError` (507) and leaves nothing behind; any other failure to
write raises it as 503.

vLLM never deletes these files. With `max_bytes` the folder is trimmed oldest first (by modification
time; a cache hit refreshes it) after each write, sparing entries younger than `grace_s` (a consumer may
be about to read them) and entries being written. Scanning the folder (at start-up, and at most once a
minute while a trim finds it over its bound) also clears temporary files and empty folders older than
`grace_s`: a crash's leftovers, and the empty folder vLLM 0.13's consumer creates for every lookup.
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from service.handoff.content_id import process_umask

FILE_NAME = "encoder_cache.safetensors"
TENSOR_KEY = "ec_cache"
TMP_PREFIX = ".tmp-"
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
# A safetensors header larger than this is not one of ours.
_MAX_HEADER = 1 << 20
_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
RESCAN_S = 60.0


def id_problem(item_id: str) -> str | None:
    """Why `item_id` cannot name a folder, or None. Safe characters only: no separators, no `..`."""
    if not _SAFE_ID.match(item_id):
        return "id must be 1-200 characters from A-Z a-z 0-9 _ . -"
    if ".." in item_id or item_id.startswith("."):
        return "id must not start with '.' nor contain '..'"
    return None


class StorageError(Exception):
    """The shared folder cannot take a file: 507 when it is full, 503 otherwise (the message says why)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(frozen=True)
class StoredHeader:
    """What a file's header says, without reading its tensor."""

    shape: tuple[int, ...]
    dtype: str  # safetensors spelling: F32, BF16, F16
    metadata: dict[str, str]


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class ECSharedStorage:
    def __init__(self, root: Path | str, max_bytes: int = 0, grace_s: float = 60.0, durable: bool = False) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.grace_s = grace_s
        self.file_mode = 0o644
        self.durable = durable
        self._lock = threading.Lock()
        self._index: dict[str, tuple[int, float]] = {}  # uuid -> (bytes, mtime)
        self._writing: set[str] = set()
        self._scanned = 0.0
        self.bytes = 0
        self.writes = 0
        self.evictions = 0
        self.write_errors = 0

    # ---- start-up ----------------------------------------------------------------------------
    def check(self) -> None:
        """At start-up: the folder exists (or can be made) and is writable; count what it holds."""
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.root, prefix=".probe-"):
            pass
        self.file_mode = 0o666 & ~process_umask()
        with self._lock:
            self._scan()

    # ---- reading -----------------------------------------------------------------------------
    def path_for(self, item_id: str) -> Path:
        problem = id_problem(item_id)
        if problem:
            raise ValueError(problem)
        return self.root / item_id / FILE_NAME

    def header(self, item_id: str) -> StoredHeader | None:
        """The file's `ec_cache` shape, dtype and metadata; None when absent or not such a file."""
        try:
            with open(self.path_for(item_id), "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    return None
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER:
                    return None
                doc = json.loads(f.read(n))
        except (OSError, ValueError):
            return None
        entry = doc.get(TENSOR_KEY) if isinstance(doc, dict) else None
        if not isinstance(entry, dict) or set(doc) - {TENSOR_KEY, "__metadata__"}:
            return None
        metadata = doc.get("__metadata__") or {}
        return StoredHeader(tuple(entry.get("shape", ())), str(entry.get("dtype")), dict(metadata))

    def load(self, item_id: str) -> torch.Tensor:
        return load_file(str(self.path_for(item_id)))[TENSOR_KEY]

    def touch(self, item_id: str) -> None:
        """A hit: the entry becomes the newest, so the trim spares it longest."""
        path = self.path_for(item_id)
        try:
            os.utime(path)
            size = path.stat().st_size
        except OSError:
            return
        with self._lock:
            self._set(item_id, size, time.time())

    # ---- writing -----------------------------------------------------------------------------
    def write(self, item_id: str, tensor: torch.Tensor, metadata: dict[str, str] | None = None) -> Path:
        """The tensor as `ec_cache` in the folder's file for `item_id` (see `write_parts`)."""
        t = tensor.detach().contiguous().cpu()
        head = safetensors_head(SAFETENSORS_DTYPES[t.dtype], tuple(t.shape), t.numel() * t.element_size(),
                                {"format": "pt", **(metadata or {})})
        return self.write_parts(item_id, [head, memoryview(t.view(-1).view(torch.uint8).numpy())])

    def write_parts(self, item_id: str, parts: list[bytes | memoryview]) -> Path:
        """A whole file's bytes (`safetensors_head` then the rows) to a temp file in the target folder, renamed
        over the target; then trim."""
        target = self.path_for(item_id)
        size = sum(len(b) for b in parts)
        with self._lock:
            self._writing.add(item_id)
        try:
            self._write_file(target, parts)
        except OSError as exc:
            self.write_errors += 1
            if exc.errno in _FULL:
                raise StorageError(507, "insufficient_storage",
                                   f"the shared encoder-cache folder {self.root} is full ({exc.strerror}); nothing "
                                   "was written: free space there or lower --ec-max-bytes") from None
            raise StorageError(503, "storage_unavailable", f"cannot write to the shared encoder-cache folder "
                                                           f"{self.root}: {exc.strerror or exc}") from None
        finally:
            with self._lock:
                self._writing.discard(item_id)
        with self._lock:
            self.writes += 1
            self._set(item_id, size, time.time())
            self._trim(keep=item_id)
        return target

    def read_bytes(self, item_id: str) -> bytes | None:
        """The file for `item_id` as it is, or None."""
        try:
            return self.path_for(item_id).read_bytes()
        except (OSError, ValueError):
            return None

    def _write_file(self, target: Path, parts: list[bytes | memoryview]) -> None:
        folder = target.parent
        for attempt in range(2):  # the trim may remove an old empty folder between mkdir and mkstemp
            made = not folder.exists()
            folder.mkdir(parents=True, exist_ok=True)
            try:
                fd, tmp = tempfile.mkstemp(dir=folder, prefix=TMP_PREFIX, suffix=".safetensors")
            except FileNotFoundError:
                if attempt:
                    raise
                continue
            try:
                with os.fdopen(fd, "wb") as f:
                    os.fchmod(f.fileno(), self.file_mode)  # mkstemp makes 0600: the consumer may be another user
                    _write_all(f.fileno(), parts)
                    if self.durable:
                        os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                if made:
                    _rmdir_quietly(folder)
                raise
            if self.durable:
                _fsync_dir(folder)
            return

    # ---- the bound ---------------------------------------------------------------------------
    def _set(self, item_id: str, size: int, mtime: float) -> None:
        old = self._index.get(item_id)
        if old is not None:
            self.bytes -= old[0]
        self._index[item_id] = (size, mtime)
        self.bytes += size

    def _scan(self) -> None:
        """Rebuild the index from the folder (other writers share it) and sweep stale leftovers."""
        self._index.clear()
        self.bytes = 0
        stale = time.time() - self.grace_s
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False) or entry.name.startswith("."):
                continue
            try:
                children = list(os.scandir(entry.path))
            except OSError:
                continue
            for child in children:
                try:
                    st = child.stat(follow_symlinks=False)
                except OSError:
                    continue
                if child.name == FILE_NAME:
                    self._set(entry.name, st.st_size, st.st_mtime)
                elif child.name.startswith(TMP_PREFIX) and st.st_mtime < stale and entry.name not in self._writing:
                    Path(child.path).unlink(missing_ok=True)
            if entry.name not in self._index and entry.name not in self._writing:
                try:
                    if entry.stat().st_mtime < stale:
                        _rmdir_quietly(Path(entry.path))
                except OSError:
                    pass
        self._scanned = time.monotonic()

    def _trim(self, keep: str) -> None:
        """Oldest first down to the bound; never `keep` (the file just written: its response names it)."""
        if self.max_bytes <= 0 or self.bytes <= self.max_bytes:
            return
        if time.monotonic() - self._scanned > RESCAN_S:
            self._scan()
        stale = time.time() - self.grace_s
        for item_id, (size, mtime) in sorted(self._index.items(), key=lambda kv: kv[1][1]):
            if self.bytes <= self.max_bytes:
                break
            if mtime > stale or item_id in self._writing or item_id == keep:
                continue
            folder = self.root / item_id
            try:
                (folder / FILE_NAME).unlink(missing_ok=True)
            except OSError:
                continue
            _rmdir_quietly(folder)
            del self._index[item_id]
            self.bytes -= size
            self.evictions += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"path": str(self.root), "max_bytes": self.max_bytes, "bytes": self.bytes,
                    "items": len(self._index), "writes": self.writes, "evictions": self.evictions,
                    "write_errors": self.write_errors, "file_mode": oct(self.file_mode)}


def safetensors_head(dtype: str, shape: tuple[int, ...], nbytes: int, metadata: dict[str, str]) -> bytes:
    """A safetensors file's first bytes for one tensor `ec_cache` whose `nbytes` raw bytes follow: the
    header's length (u64, little endian), then its JSON padded with spaces to 8 bytes, as safetensors writes it."""
    doc = {"__metadata__": metadata, TENSOR_KEY: {"dtype": dtype, "shape": list(shape), "data_offsets": [0, nbytes]}}
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    views = [memoryview(b).cast("B") for b in parts if len(b)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _rmdir_quietly(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # not empty (a writer is using it), or gone already
        pass


def _fsync_dir(folder: Path) -> None:
    # Makes the rename durable; not every filesystem allows opening a directory.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
