"""The LLM server's side of `GET /v1/encoder_cache/{id}`: where an id's output is, asking replicas which ids
they hold, and fetching one output as a tensor. Standard library only at import (torch is imported when a
tensor is made): the vLLM connector (`vllm_connector`) runs this inside vLLM's processes.

The replicas are a `Membership` (a fixed list, and/or `dns:NAME[:PORT]` resolved again every few seconds),
and an id's replicas are asked in its rendezvous order, as vitserve's OpenAI front orders them to place the
id (`service.http.peers`): the replica that encoded it is the first, or, after a change of members, one of
the next (a joining replica wins the id from it) or one that just left (it still holds its outputs while it
drains). So a lookup asks the first MAX_TRIES of the order and then of the members that left, and no lookup
fails while the replica holding the output is up. A replica that does not answer is asked last for DOWN_S
seconds; a lookup that found nothing resolves the members again first when they may be stale.
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from service.handoff.membership import Membership, normalise, replica_for

if TYPE_CHECKING:
    import torch

__all__ = ["CheckIncomplete", "FetchError", "Loader", "Replicas", "check_output", "normalise", "replica_for"]

DEFAULT_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 2.0  # a member whose pod is gone may not refuse: its address just stops answering
RETRY_S = (0.05, 0.25, 1.0)  # pauses before a load asks a replica that did not answer again
MAX_TRIES = 3  # replicas of an id's order a lookup asks, before the members that left
DOWN_S = 5.0  # a replica that did not answer is asked after the others for this long
CHECK_PATH = "/v1/encoder_cache/check"
TENSOR_KEY = "ec_cache"


class FetchError(RuntimeError):
    """An output could not be fetched: `status` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def _connect(address: tuple[str, int], timeout: float, source_address: Any = None) -> socket.socket:
    """A connection opened within CONNECT_TIMEOUT_S, then read with the full timeout."""
    sock = socket.create_connection(address, min(timeout, CONNECT_TIMEOUT_S), source_address)
    sock.settimeout(timeout)
    return sock


class Replicas:
    """The replicas of one ring, over HTTP/1.1 keep-alive connections, one per (thread, replica): a fetch
    reuses its thread's connection, and a connection the server closed is opened again once. `found` counts
    the fetches by where the output was: `home` (the id's own replica), `elsewhere`, `missing`."""

    def __init__(self, members: Sequence[str] | Membership, api_key: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if isinstance(members, Membership):
            self.membership = members
        elif not members:
            raise ValueError("no vitserve URL: set 'url', 'urls' or 'replicas_from' in ec_connector_extra_config")
        else:
            self.membership = Membership(members)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.found = {"home": 0, "elsewhere": 0, "missing": 0}
        self._down: dict[str, float] = {}  # replica -> until when it is asked last
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def urls(self) -> tuple[str, ...]:
        return self.membership.members

    def replica_for(self, item_id: str) -> str:
        order = self.membership.order(item_id)
        if not order:
            raise FetchError(f"no vitserve replica is known ({self.membership.source} has no address yet)")
        return order[0]

    def candidates(self, item_id: str, first: str | None = None) -> list[str]:
        """Where to look for `item_id`, in order: `first` (where a check found it), the first MAX_TRIES of its
        order, then of the members that left (the one that held it comes first among them: it beat them all in
        the id's order); replicas that did not answer lately after the others."""
        seen: dict[str, None] = {}
        for url in ([normalise(first)] if first else []) + self.membership.order(item_id)[:MAX_TRIES] + \
                self.membership.fallbacks(item_id)[:MAX_TRIES]:
            seen.setdefault(url)
        now = time.monotonic()
        with self._lock:
            down = {u for u in seen if self._down.get(u, 0.0) > now}
        return [u for u in seen if u not in down] + [u for u in seen if u in down]

    def _no_answer(self, url: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._down = {u: until for u, until in self._down.items() if until > now}
            self._down[url] = now + DOWN_S

    def _count(self, kind: str) -> None:
        with self._lock:
            self.found[kind] += 1

    def _connection(self, url: str, fresh: bool = False) -> http.client.HTTPConnection:
        pool: dict[str, http.client.HTTPConnection] = self._local.__dict__.setdefault("pool", {})
        conn = pool.get(url)
        if conn is None:
            self._prune(pool)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            parts = urllib.parse.urlsplit(url)
            kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conn = pool[url] = kind(parts.netloc, timeout=self.timeout)
            conn._create_connection = _connect  # type: ignore[attr-defined]
        return conn

    def _prune(self, pool: dict[str, http.client.HTTPConnection]) -> None:
        """Close connections to replicas gone from the ring (pods come and go with new addresses)."""
        if len(pool) > 2 * len(self.membership.members) + 8:
            for url in [u for u in pool if u not in self.membership.members]:
                pool.pop(url).close()

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

    def check(self, ids: Sequence[str]) -> dict[str, str | None]:
        """The replica that holds each of `ids` (None: none found). Each round asks every replica once about
        the ids it is next for. A replica that does not answer holds none of its ids; when an id was found
        nowhere and some replica did not answer, CheckIncomplete is raised after the others were asked."""
        where: dict[str, str | None] = {i: None for i in ids}
        todo = {i: self.candidates(i) for i in where}
        asked: dict[str, set[str]] = {i: set() for i in where}
        error: FetchError | None = None
        refreshed = False
        while True:
            by_replica: dict[str, list[str]] = {}
            for item_id, left in todo.items():
                if left:
                    url = left.pop(0)
                    asked[item_id].add(url)
                    by_replica.setdefault(url, []).append(item_id)
            if not by_replica:
                missing = [i for i, url in where.items() if url is None]
                if not missing or refreshed or not self.membership.refresh_if_stale():
                    break
                refreshed = True  # the members changed: the ids not found yet ask the new ones once
                todo = {i: [u for u in self.candidates(i) if u not in asked[i]] for i in missing}
                continue
            for url, some in by_replica.items():
                try:
                    present = self._check_one(url, some)
                except FetchError as exc:
                    error = exc
                    continue
                for item_id, held in zip(some, present):
                    if held:
                        where[item_id] = url
                        todo.pop(item_id, None)
        if error is not None and any(url is None for url in where.values()):
            raise CheckIncomplete(where, error)
        return where

    def _check_one(self, url: str, ids: list[str]) -> list[bool]:
        try:
            status, body = self.request(url, "POST", CHECK_PATH, json.dumps({"ids": ids}).encode(),
                                        {"Content-Type": "application/json"})
        except FetchError:
            self._no_answer(url)
            raise
        if status != 200:
            raise FetchError(f"POST {url}{CHECK_PATH}: HTTP {status}: {bytes(body[:300])!r}", status)
        try:
            present = json.loads(body)["present"]
        except (ValueError, KeyError, TypeError) as exc:
            raise FetchError(f"POST {url}{CHECK_PATH}: {exc}") from None
        return [bool(p) for p in present]

    def fetch(self, item_id: str, buffer: Callable[[int], memoryview] | None = None, first: str | None = None
              ) -> tuple[bytearray | memoryview, dict[str, Any]]:
        """The safetensors body for `item_id` (read into `buffer(length)` when given), and its parsed header:
        from `first` (where a check found it) or the first replica of `candidates` that holds it. FetchError's
        status is 404 when none does, 0 when the first one asked did not answer (it may be restarting)."""
        path = "/v1/encoder_cache/" + urllib.parse.quote(item_id, safe="")
        order = self.membership.order(item_id)
        home = order[0] if order else None
        asked: list[str] = []
        first_unanswered: FetchError | None = None
        for attempt in range(2):
            for url in self.candidates(item_id, first) if attempt == 0 else \
                    [u for u in self.candidates(item_id) if u not in asked]:
                asked.append(url)
                try:
                    status, body = self.request(url, "GET", path, buffer=buffer)
                except FetchError as exc:
                    self._no_answer(url)
                    if len(asked) == 1:
                        first_unanswered = exc
                    continue
                if status == 200:
                    self._count("home" if url == home else "elsewhere")
                    return body, parse_header(body)
                if status != 404:  # refused (401 and the like): asking elsewhere will not change it
                    raise FetchError(f"GET {url}{path}: HTTP {status}: {bytes(body[:300])!r}", status)
            if attempt or not self.membership.refresh_if_stale():
                break
        self._count("missing")
        if first_unanswered is not None:
            raise FetchError(f"{first_unanswered} (and no other replica holds {item_id})")
        raise FetchError(f"no vitserve replica holds {item_id} (asked {', '.join(asked) or 'none: no member'})",
                         404)

    def close(self) -> None:
        for conn in self._local.__dict__.get("pool", {}).values():
            conn.close()


class CheckIncomplete(FetchError):
    """Some replica did not answer a check: `found` holds every id's replica (None where none was found)."""

    def __init__(self, found: dict[str, str | None], cause: FetchError) -> None:
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

    def load(self, item_id: str, first: str | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """(the output on the device, the body's header), from `first` (the replica the scheduler's check
        found it on) or the next that holds it. A replica that does not answer (restarting, a connection
        reset) is asked again after RETRY_S pauses: the scheduler found the id there moments ago, and a load
        that fails stops vLLM's step."""
        for pause in RETRY_S:
            try:
                return self._load(item_id, first)
            except FetchError as exc:
                if exc.status:  # it answered: 404 and the like will not change
                    raise
                time.sleep(pause)
        return self._load(item_id, first)

    def _load(self, item_id: str, first: str | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        if self.device == "cpu":
            body, header = self.replicas.fetch(item_id, first=first)
            return to_tensor(body, header), header
        used: list[torch.Tensor] = []

        def buffer(size: int) -> memoryview:
            used.append(self._staging(size))
            return memoryview(used[-1].numpy())

        body, header = self.replicas.fetch(item_id, buffer, first)
        tensor = to_tensor(body, header, used[0] if used else None)
        return tensor.to(self.device), header  # waits for the copy: the staging buffer is free again after
