"""The LLM server's side of `GET /v1/encoder_cache/{id}`: which replica holds an id, asking replicas which ids
they hold, and fetching one output as a tensor. Standard library only at import (torch is imported when a
tensor is made): the vLLM connector (`vllm_connector`) runs this inside vLLM's processes, and the proxy
(`service.http.openai`) uses `replica_for` to send each item to the replica the connector will ask.

Replicas are picked by rendezvous hashing on the id: every process that has the same list of URLs picks the
same replica for an id without talking to the others, and adding or removing a replica moves only the ids
that it wins or held.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_TIMEOUT_S = 10.0
RETRY_S = (0.05, 0.25, 1.0)  # pauses before a load asks a replica that did not answer again
CHECK_PATH = "/v1/encoder_cache/check"
TENSOR_KEY = "ec_cache"


class FetchError(RuntimeError):
    """An output could not be fetched: `status` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def normalise(url: str) -> str:
    return url.strip().rstrip("/")


def replica_for(urls: Sequence[str], item_id: str) -> str:
    """The replica that holds `item_id`: the URL with the highest hash of (URL, id)."""
    if len(urls) == 1:
        return normalise(urls[0])

    def score(url: str) -> bytes:
        return hashlib.blake2b(f"{normalise(url)}\0{item_id}".encode(), digest_size=8).digest()

    return normalise(max(urls, key=score))


class Replicas:
    """HTTP/1.1 keep-alive connections to the replicas, one per (thread, replica): a fetch reuses its thread's
    connection, and a connection the server closed is opened again once."""

    def __init__(self, urls: Sequence[str], api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not urls:
            raise ValueError("no vitserve URL: set 'url' (or 'urls') in ec_connector_extra_config")
        self.urls = [normalise(u) for u in urls]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self._local = threading.local()

    def replica_for(self, item_id: str) -> str:
        return replica_for(self.urls, item_id)

    def _connection(self, url: str, fresh: bool = False) -> http.client.HTTPConnection:
        pool: dict[str, http.client.HTTPConnection] = self._local.__dict__.setdefault("pool", {})
        conn = pool.get(url)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            parts = urllib.parse.urlsplit(url)
            kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conn = pool[url] = kind(parts.netloc, timeout=self.timeout)
        return conn

    def request(self, url: str, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None,
                buffer: Callable[[int], memoryview] | None = None) -> tuple[int, bytearray | memoryview]:
        """(status, body) of one request to the replica at `url`, on this thread's connection; a 200's body
        with a length is read into `buffer(length)` when given (a reused, pinned staging buffer)."""
        prefix = urllib.parse.urlsplit(url).path
        for attempt in range(2):
            conn = self._connection(url, fresh=attempt > 0)
            try:
                conn.request(method, prefix + path, body=body, headers={**self.headers, **(headers or {})})
                resp = conn.getresponse()
                length = resp.getheader("content-length")
                data: bytearray | memoryview
                if length is not None and length.isdigit():
                    size = int(length)
                    data = buffer(size)[:size] if buffer is not None and resp.status == 200 else bytearray(size)
                    view = memoryview(data)
                    got = 0
                    while got < size:
                        n = resp.readinto(view[got:])
                        if not n:
                            raise http.client.IncompleteRead(bytes(view[:got]), size - got)
                        got += n
                else:
                    data = bytearray(resp.read())
                if resp.will_close:
                    conn.close()
                return resp.status, data
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                conn.close()
                if attempt:  # a kept-alive connection the server had closed is retried once on a new one
                    raise FetchError(f"{method} {url}{path}: {exc}") from None
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise FetchError(f"{method} {url}{path}: {exc}") from None
        raise AssertionError("unreachable")

    def check(self, ids: Sequence[str]) -> dict[str, bool]:
        """Which of `ids` their replicas hold (one request per replica). A replica that answers no holds none
        of its ids, and the error is raised after the others were asked."""
        by_replica: dict[str, list[str]] = {}
        for item_id in ids:
            by_replica.setdefault(self.replica_for(item_id), []).append(item_id)
        out: dict[str, bool] = {}
        error: FetchError | None = None
        for url, some in by_replica.items():
            try:
                status, body = self.request(url, "POST", CHECK_PATH, json.dumps({"ids": some}).encode(),
                                            {"Content-Type": "application/json"})
                if status != 200:
                    raise FetchError(f"POST {url}{CHECK_PATH}: HTTP {status}: {bytes(body[:300])!r}", status)
                present = json.loads(body)["present"]
                out.update(zip(some, (bool(p) for p in present)))
            except (FetchError, ValueError, KeyError) as exc:
                out.update((i, False) for i in some)
                error = exc if isinstance(exc, FetchError) else FetchError(f"POST {url}{CHECK_PATH}: {exc}")
        if error is not None:
            raise CheckIncomplete(out, error)
        return out

    def fetch(self, item_id: str, buffer: Callable[[int], memoryview] | None = None
              ) -> tuple[bytearray | memoryview, dict[str, Any]]:
        """The safetensors body for `item_id` from its replica (read into `buffer(length)` when given), and its
        parsed header."""
        url = self.replica_for(item_id)
        path = "/v1/encoder_cache/" + urllib.parse.quote(item_id, safe="")
        status, body = self.request(url, "GET", path, buffer=buffer)
        if status != 200:
            raise FetchError(f"GET {url}{path}: HTTP {status}: {bytes(body[:300])!r}", status)
        return body, parse_header(body)

    def close(self) -> None:
        for conn in self._local.__dict__.get("pool", {}).values():
            conn.close()


class CheckIncomplete(FetchError):
    """Some replica did not answer a check: `found` holds every id's answer (False for that replica's)."""

    def __init__(self, found: dict[str, bool], cause: FetchError) -> None:
        super().__init__(str(cause), cause.status)
        self.found = found


def parse_header(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """A safetensors body's header, checked to hold one tensor `ec_cache` that fits in the body."""
    if len(body) < 8:
        raise FetchError("not a safetensors body: shorter than its header's length")
    (n,) = struct.unpack_from("<Q", body, 0)
    if 8 + n > len(body):
        raise FetchError("not a safetensors body: its header runs past the end")
    header = json.loads(bytes(body[8:8 + n]))
    spec = header.get(TENSOR_KEY)
    if not isinstance(spec, dict):
        raise FetchError(f"the safetensors body holds no tensor {TENSOR_KEY!r}")
    start, end = spec["data_offsets"]
    if 8 + n + end > len(body):
        raise FetchError("the safetensors body is shorter than its tensor")
    header["_data_start"] = 8 + n
    return header


_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def to_tensor(body: bytearray | memoryview, header: dict[str, Any], staging: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The `ec_cache` tensor over `body`'s bytes, no copy: over `staging` (the uint8 tensor `body` was read
    into) when given, else over `body`, which the tensor then owns."""
    import torch

    spec = header[TENSOR_KEY]
    start, end = spec["data_offsets"]
    base = header["_data_start"]
    dtype = getattr(torch, _DTYPES[spec["dtype"]])
    if staging is not None:
        flat = staging[base + start:base + end].view(dtype)
    else:
        flat = torch.frombuffer(memoryview(body)[base + start:base + end], dtype=dtype)
    return flat.view(*spec["shape"])


def check_output(item_id: str, header: dict[str, Any], rows: int) -> None:
    """The body holds the output asked for: the uuid its metadata names (files written before it was named:
    the content id, for an id that is one), and a 2-D tensor of at least `rows` rows (vLLM's runner slices
    the placeholder's rows without checking)."""
    md = header.get("__metadata__") or {}
    named = md.get("uuid") or (md.get("content_id") if item_id.startswith("vit-") else None)
    if named is not None and named != item_id:
        raise FetchError(f"vitserve answered {item_id} with the output of {named}")
    shape = header[TENSOR_KEY]["shape"]
    if len(shape) != 2 or shape[0] < rows:
        raise FetchError(f"encoder output {item_id} has shape {tuple(shape)}: the prompt's placeholder needs "
                         f"{rows} rows")


class Loader:
    """Outputs onto a device as the connector loads them. For a GPU, each thread reads bodies into its own
    pinned staging buffer, reused from load to load, and copies the tensor from there: no fresh host
    memory to fault in per load, and the copy to the device runs at pinned speed."""

    def __init__(self, replicas: Replicas, device: str) -> None:
        self.replicas = replicas
        self.device = device
        self._local = threading.local()

    def _staging(self, size: int) -> torch.Tensor:
        import torch

        buf = getattr(self._local, "staging", None)
        if buf is None or buf.numel() < size:
            buf = self._local.staging = torch.empty(max(size, 4 << 20), dtype=torch.uint8, pin_memory=True)
        return buf

    def load(self, item_id: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """(the output on the device, the body's header). A replica that does not answer (restarting, a
        connection reset) is asked again after RETRY_S pauses: the scheduler found the id there moments ago,
        and a load that fails stops vLLM's step."""
        for pause in RETRY_S:
            try:
                return self._load(item_id)
            except FetchError as exc:
                if exc.status:  # it answered: 404 and the like will not change
                    raise
                time.sleep(pause)
        return self._load(item_id)

    def _load(self, item_id: str) -> tuple[torch.Tensor, dict[str, Any]]:
        if self.device == "cpu":
            body, header = self.replicas.fetch(item_id)
            return to_tensor(body, header), header
        used: list[torch.Tensor] = []

        def buffer(size: int) -> memoryview:
            used.append(self._staging(size))
            return memoryview(used[-1].numpy())

        body, header = self.replicas.fetch(item_id, buffer)
        tensor = to_tensor(body, header, used[0] if used else None)
        return tensor.to(self.device), header  # waits for the copy: the staging buffer is free again after
