"""Response bodies made in the worker processes and sent from shared memory without a copy here.

Encoding an embedding (base64 of megabytes, JSON floats, safetensors, vLLM parts) is CPU work that
holds the GIL; the workers do it, each item into its own segment. The event loop maps each segment,
unlinks it at once (the mapping stays valid) and hands the mapped bytes to the transport, which writes
them to the socket: the body is never joined nor copied in this process.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service import shm


def take_segment(name: str, length: int) -> memoryview:
    """A segment's first `length` bytes, mapped read-only; the segment's name is gone once this returns."""
    try:
        if length == 0:
            return memoryview(b"")
        # Not populated here, on the event loop: the writer thread's writev faults the pages in.
        mapping = shm.open_segment(name, populate=False)
        return memoryview(mapping)[:length]
    finally:
        shm.unlink(name)


class PartsResponse(Response):
    """A 200 whose body is the concatenation of `parts`, sent part by part."""

    def __init__(self, parts: Sequence[bytes | memoryview], media_type: str, headers: dict[str, str] | None = None,
                 background: BackgroundTask | None = None) -> None:
        self.parts = list(parts)
        self.status_code = 200
        self.media_type = media_type
        self.background = background
        self.body = b""
        self.init_headers({**(headers or {}), "content-length": str(sum(len(p) for p in self.parts))})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.parts) - 1
        for i, part in enumerate(self.parts or [b""]):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})
        if self.background is not None:
            await self.background()


def json_parts(head: dict[str, Any], entries: Sequence[bytes | memoryview | list[bytes]],
               tail: dict[str, Any]) -> list:
    """`{**head, "data": [entries...], **tail}` as parts: the entries are ready-made JSON objects, each
    whole or in parts."""
    opening = json.dumps(head, separators=(",", ":"))[:-1].encode() + b',"data":['
    closing = b"]," + json.dumps(tail, separators=(",", ":"))[1:].encode()
    parts: list[bytes | memoryview] = [opening]
    for i, entry in enumerate(entries):
        if i:
            parts.append(b",")
        if isinstance(entry, list):
            parts.extend(entry)
        else:
            parts.append(entry)
    parts.append(closing)
    return parts
