"""The sidecar variants of `vitserve bench --http`: the answer's format (`--format base64|vllm_ref`) and the
cache (`--cache misses|hits`), and what a sidecar's figures need beyond the load levels.

- Misses: every request carries an image no request carried before (`FreshBodies`: the bench JPEG with a JPEG
  comment holding a counter, so its decoding and encoding cost the same), so every item is encoded.
  Hits: the few bench images again and again, cached by the warm-up.
- `server_times`: requests one after another, each with the server's own time (`server-timing`), which
  leaves the client and the loopback out: what a cache hit costs the server.
- `fetch_times` (vllm_ref): the LLM server's side, as `VitserveConnector` loads an output (`ec_client.Loader`):
  GET /v1/encoder_cache/{id} on a keep-alive connection, the tensor over the body, and on a GPU its copy to
  the device (waited for).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import time
from collections.abc import Sequence
from itertools import count
from typing import Any
from urllib.parse import urlsplit

from service.bench.http_client import BenchError, percentiles_ms

FORMATS = ("base64", "vllm_ref")
CACHES = ("misses", "hits")


def request_body(image_b64: str, fmt: str) -> bytes:
    body = {"items": [{"type": "image", "image": image_b64}], "encoding_format": fmt, "dtype": "bfloat16"}
    return json.dumps(body).encode()


class FreshBodies(Sequence[bytes]):
    """Request bodies whose image differs from every other request's: the JPEG's first bytes become SOI and a
    comment segment holding this process, the run and a counter (24 bytes, so its base64 is joined to the
    rest's without re-encoding the image). Indexing ignores the index: every body is new."""

    LENGTH = 1 << 40

    def __init__(self, images: Sequence[bytes], fmt: str) -> None:
        self.run = random.getrandbits(16)
        self.tails = [base64.b64encode(img[2:]).decode() for img in images]
        self.fmt = fmt
        self._count = count()

    def __len__(self) -> int:
        return self.LENGTH

    def __getitem__(self, index: Any) -> bytes:  # type: ignore[override]
        n = next(self._count)
        payload = f"{os.getpid() % 1000000:06d}{self.run:04x}{n:08d}".encode()[:18]
        head = b"\xff\xd8\xff\xfe" + (2 + len(payload)).to_bytes(2, "big") + payload
        return request_body(base64.b64encode(head).decode() + self.tails[n % len(self.tails)], self.fmt)

    def __getstate__(self) -> dict[str, Any]:  # client processes: each counts on its own (its pid differs)
        return {k: v for k, v in self.__dict__.items() if k != "_count"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._count = count()


def bodies_for(images: Sequence[bytes], fmt: str, cache: str) -> Sequence[bytes]:
    if fmt not in FORMATS or cache not in CACHES:
        raise BenchError(f"--format is one of {', '.join(FORMATS)} and --cache one of {', '.join(CACHES)}")
    if cache == "misses":
        return FreshBodies(images, fmt)
    return [request_body(base64.b64encode(img).decode(), fmt) for img in images]


def check_variant(base_url: str, body: bytes, api_key: str | None, fmt: str, client: str) -> dict[str, Any]:
    """One request, checked: base64 as `check_response` checks it; vllm_ref: a reference part whose output
    GET /v1/encoder_cache/{uuid} serves in the announced shape."""
    from service.bench.http_client import check_response

    if fmt == "base64":
        return check_response(base_url, body, api_key, client)
    timed = server_times(base_url, [body], 1, api_key)
    entry = timed["entry"]
    part = entry.get("content_part") or {}
    uuid = part.get("uuid")
    if not uuid or part.get("image_embeds", {}).get("image_grid_thw") != entry["grid_thw"]:
        raise BenchError(f"unexpected vllm_ref entry: {json.dumps(entry)[:300]}")
    fetched = fetch_times(base_url, uuid, 1, api_key, "cpu")
    if fetched["shape"] != entry["shape"]:
        raise BenchError(f"GET /v1/encoder_cache/{uuid} has shape {fetched['shape']}, the answer said {entry['shape']}")
    return {"grid_thw": entry["grid_thw"], "tokens_per_image": entry["num_tokens"], "shape": entry["shape"],
            "uuid": uuid}


def _connection(base_url: str) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(base_url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=300), parts.path.rstrip("/")


def _server_ms(header: str | None) -> float | None:
    """`encode;dur=1.234` -> 1.234."""
    if not header:
        return None
    for item in header.split(","):
        for field in item.split(";"):
            if field.strip().startswith("dur="):
                return float(field.strip()[4:])
    return None


def server_times(base_url: str, bodies: Sequence[bytes], n: int, api_key: str | None) -> dict[str, Any]:
    """`n` requests one after another: the client's and the server's (server-timing) p50, and one answer's
    content part or shape."""
    conn, prefix = _connection(base_url)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    client, server = [], []
    last: Any = None
    try:
        for i in range(n):
            body = bodies[i % len(bodies)]
            t0 = time.perf_counter()
            conn.request("POST", prefix + "/encode", body, headers)
            resp = conn.getresponse()
            data = resp.read()
            client.append(time.perf_counter() - t0)
            if resp.status != 200:
                raise BenchError(f"POST /encode answered {resp.status}: {data[:300]!r}")
            ms = _server_ms(resp.getheader("server-timing"))
            if ms is not None:
                server.append(ms / 1e3)
            last = json.loads(data)["data"][0]
    finally:
        conn.close()
    return {"requests": n, "client": percentiles_ms(client), "server": percentiles_ms(server), "entry": last}


def fetch_times(base_url: str, item_id: str, n: int, api_key: str | None, device: str) -> dict[str, Any]:
    """`n` loads of one output as the connector makes them; p50 of the whole load and of the server's time."""
    import torch

    from service.handoff.ec_client import Loader, Replicas

    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    replicas = Replicas([base_url], api_key)
    loader = Loader(replicas, "cuda:0" if device == "cuda" else device)
    total, server = [], []
    shape: list[int] = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            tensor, _ = loader.load(item_id)
            total.append(time.perf_counter() - t0)
            shape = list(tensor.shape)
        conn, prefix = _connection(base_url)  # the server's own time for the same GET
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            for _ in range(n):
                conn.request("GET", f"{prefix}/v1/encoder_cache/{item_id}", headers=headers)
                resp = conn.getresponse()
                resp.read()
                ms = _server_ms(resp.getheader("server-timing"))
                if ms is not None:
                    server.append(ms / 1e3)
        finally:
            conn.close()
    finally:
        replicas.close()
    return {"fetches": n, "device": device, "shape": shape, "load": percentiles_ms(total),
            "server": percentiles_ms(server)}
