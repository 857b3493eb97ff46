"""The encoder side of SGLang's encode/prefill/decode disaggregation (SGLang 0.5.23): `sglang serve ...
--language-only --encoder-urls http://vitserve:8100` takes its embeddings from vitserve (docs/sglang.md).

- `POST /encode` with SGLang's body (told apart from vitserve's own by its `mm_items`): one part of a
  request, `{req_id, mm_items, modality, num_parts, part_idx, prefill_host, embedding_port, ...}`. Its
  items (URLs under --allow-url and --allowed-hosts, data URLs, base64; or dicts with a `url` and an
  optional `content_hash`) go through the same request path as vitserve's own items: admission, the
  media workers, the encoder-output cache, identical items in flight encoded once, the engine's batches.
  The part's rows are pushed over ZMQ (service.handoff.sglang_push) and `/encode` answers 200 `null` once
  every receiver has them; an error answers SGLang's `{"status": "error", "message", "req_id"}` with
  vitserve's status, and the part's receivers get an error message (SGLang then aborts that request).
- `POST /scheduler_receive_url`: a scheduler rank registers for a part (zmq_to_scheduler).
- `POST /scheduler_receive_meta_data` and `POST /send` (the mooncake backend's): 501, and the part they
  name fails at once; `/encode` alone cannot tell mooncake from zmq_to_scheduler.

The API key applies (SGLang sends none). With several fronts, each part belongs to the front its req_id
hashes to: the others pass its `/encode` and registrations on over the fronts' Unix sockets.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from service import shm
from service.engine.types import ItemResult, ModelInfo
from service.handoff import sglang_wire as wire
from service.handoff.sglang_push import RESULTS, DeliveryFailed, Part, Parts, Pushes
from service.handoff.vllm import grid_timestamps, seconds_per_step
from service.http.errors import ApiError, item_error, server_fault
from service.http.fronts import FrontRole
from service.http.parsing import Parsed, Pending, check_count, decode_media
from service.http.schemas import OutputOptions
from service.http.service import RENDER_HERE_BYTES, Deferred, parses_here
from service.settings import ServeSettings

if TYPE_CHECKING:
    from service.http.service import Service
    from service.workers.pool import Owner

log = logging.getLogger("vitserve.sglang")
MARKER = b'"mm_items"'  # in SGLang's /encode body, never in vitserve's (whose fields are known)
FORWARDED = "x-vitserve-front-hop"  # a request one front passed on to the front its part belongs to
MOONCAKE = ("vitserve does not offer SGLang's mooncake encoder transfer backend: start SGLang with "
            "--encoder-transfer-backend zmq_to_scheduler (the default) or zmq_to_tokenizer")
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


def _count(value: Any) -> bool:
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
    if not _count(num_parts) or num_parts <= 0:
        raise bad("num_parts must be a positive integer")
    if not _count(part_idx) or not 0 <= part_idx < num_parts:
        raise bad(f"part_idx must be in [0, {num_parts})")
    port, host = obj.get("embedding_port"), obj.get("prefill_host")
    ports = port if isinstance(port, list) else [] if port is None else [port]
    if not all(_count(p) and 0 < p < 65536 for p in ports):
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


def part_frames(part: EncodePart, results: list[ItemResult], model: ModelInfo, field: str | None) -> list[Any]:
    """[metadata, rows]: every item's rows, in order, in one buffer (read from their segments)."""
    rows = sum(r.output.rows for r in results)
    buf = bytearray(sum(r.output.nbytes for r in results))
    offset = 0
    for r in results:
        if r.output.nbytes:
            shm.read_into(r.output.segment, np.frombuffer(buf, np.uint8, r.output.nbytes, offset))
        offset += r.output.nbytes
    stamps = seconds = None
    if part.modality == "video" and field == "video_timestamps":
        stamps = [grid_timestamps(r.meta, model.processor.temporal_patch_size) for r in results]
        if any(s is None or len(s) != r.grid_thw[0] for s, r in zip(stamps, results)):
            raise RuntimeError(f"{part.req_id}: a video without a timestamp per temporal step")
    elif part.modality == "video" and field == "second_per_grid_ts":
        seconds = [seconds_per_step(r.meta) for r in results]
        if any(s is None for s in seconds):
            raise RuntimeError(f"{part.req_id}: a video without its seconds per temporal step")
    meta = wire.PartMeta(part.req_id, part.num_parts, part.part_idx, part.modality,
                         [tuple(r.grid_thw) for r in results], model.dtype_name, (rows, model.width),
                         stamps, seconds)  # type: ignore[arg-type]
    return [wire.metadata_frame(meta), buf]


class Delivery(Deferred):
    """The answer to one part's /encode: its pushes, then 200 null."""

    def __init__(self, route: SGLangRoute, state: Part, part: EncodePart, frames: list[Any]) -> None:
        self.route, self.state, self.part, self.frames = route, state, part, frames

    async def finish(self) -> Response:
        try:
            await self.route.deliver(self.state, self.part, self.frames)
        except DeliveryFailed as exc:
            raise refused(exc) from None
        finally:
            self.route.parts.release(self.state)
        return JSONResponse(None)


class Forward(Deferred):
    """A request for a part another front owns, passed on to it as it came."""

    def __init__(self, route: SGLangRoute, request: Request, socket_path: str, path: str, body: bytes) -> None:
        self.route, self.request, self.socket_path, self.path, self.body = route, request, socket_path, path, body

    async def finish(self) -> Response:
        import httpx

        headers = {"content-type": "application/json", FORWARDED: "1"}
        if "authorization" in self.request.headers:
            headers["authorization"] = self.request.headers["authorization"]
        settings = self.route.service.settings
        timeout = settings.request_timeout_s + 2 * settings.sglang_timeout_s + 30
        transport = httpx.AsyncHTTPTransport(uds=self.socket_path)
        try:
            async with httpx.AsyncClient(transport=transport, timeout=timeout) as c:
                r = await c.post("http://front" + self.path, content=self.body, headers=headers)
        except httpx.HTTPError as exc:
            raise ApiError(502, "bad_gateway", f"the front owning this part did not answer: {exc}",
                           "front_unreachable") from None
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))


class SGLangRoute:
    """SGLang's body on /encode (a `Service` dialect) and its other routes, on one front."""

    def __init__(self, service: Service, front: FrontRole | None) -> None:
        self.service = service
        self.front = front
        self.pushes = Pushes()
        self.parts = Parts(self.pushes, service.settings.sglang_timeout_s)
        self.tasks: set[asyncio.Task[None]] = set()  # error messages still being delivered

    # ---- the /encode dialect -----------------------------------------------------------------
    async def claims(self, request: Request, body: bytes) -> bool:
        if request.headers.get("content-type", "application/json").split(";")[0].strip().lower() != \
                "application/json":
            return False
        here = parses_here(len(body))
        found = MARKER in body if here else await self.service.run_in_pool(body.__contains__, MARKER)
        if not found:
            return False
        try:
            obj = json.loads(body) if here else await self.service.run_in_pool(json.loads, body)
        except ValueError:
            return False
        if not isinstance(obj, dict) or "mm_items" not in obj or "items" in obj:
            return False
        request.state.sglang_body = obj
        request.state.sglang_req_id = obj.get("req_id") if isinstance(obj.get("req_id"), str) else None
        return True

    def error_response(self, request: Request, error: ApiError) -> JSONResponse:
        """SGLang's error shape, vitserve's status; `code` and `error_id` ride along."""
        body: dict[str, Any] = {"status": "error", "message": error.message,
                                "req_id": getattr(request.state, "sglang_req_id", None), "code": error.code}
        if error.error_id:
            body["error_id"] = error.error_id
        return JSONResponse(body, status_code=error.status, headers=error.headers)

    def owner(self, request: Request, req_id: Any) -> str | None:
        """The Unix socket of the front this part belongs to, or None where it is this one."""
        front = self.front
        if front is None or front.count == 1 or FORWARDED in request.headers or not isinstance(req_id, str):
            return None
        index = zlib.crc32(req_id.encode()) % front.count
        return None if index == front.index else front.sockets[index]

    async def encode(self, request: Request, owner: Owner, body: bytes, deadline: float) -> Deferred:
        obj = request.state.sglang_body
        socket_path = self.owner(request, obj.get("req_id"))
        if socket_path is not None:
            return Forward(self, request, socket_path, "/encode", body)
        service = self.service
        part = parse_part(obj, service.settings)
        model = service.engine.model
        assert model is not None  # accepting: loaded
        family = service.engine.family
        if family not in wire.VIDEO_FIELD:
            raise ApiError(501, "not_implemented", f"this server's family {family} is not one SGLang "
                                                   f"{wire.SGLANG_VERSION} disaggregates", "unsupported_family")
        try:
            state = self.parts.begin(part.req_id)
        except DeliveryFailed as exc:
            raise refused(exc) from None
        try:
            await service.resolve_urls(Parsed(part.items, OutputOptions()))
            for p, digest in zip(part.items, part.hashes):
                if digest is not None and wire_digest(p.data) != digest:  # type: ignore[arg-type]
                    raise item_error(p.index, "its bytes do not match its content_hash", "hash_mismatch")
            items = [p.media() for p in part.items]
            results = await service.handoff.encode(items, "sglang", model,
                                                   lambda todo: service.engine.encode(todo, owner, deadline),
                                                   service.run_in_pool)
            try:
                nbytes = sum(r.output.nbytes for r in results)
                args = (part, results, model, wire.VIDEO_FIELD[family])
                frames = part_frames(*args) if nbytes <= RENDER_HERE_BYTES else await service.run_in_pool(
                    part_frames, *args)
            finally:
                service.handoff.release(results)
        except asyncio.CancelledError:  # the client went away, or the deadline passed: 504 tells SGLang
            self.parts.release(state)
            raise
        except Exception as exc:
            raise self.fail(state, part, exc) from None
        return Delivery(self, state, part, frames)

    def fail(self, state: Part, part: EncodePart, exc: Exception) -> ApiError:
        """The part's error, logged once; its receivers get it too, in the background, as SGLang sends it."""
        error, logged = self.service.api_error(exc)
        if error.status >= 500:
            server_fault(error, logged)
        frame = wire.error_frame(part.req_id, part.num_parts, part.part_idx, part.modality, error.message,
                                 error.status)
        task = asyncio.ensure_future(self._deliver_error(state, part, frame))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return error

    async def _deliver_error(self, state: Part, part: EncodePart, frame: bytes) -> None:
        try:
            await self.deliver(state, part, [frame], warn=False)
        except DeliveryFailed as exc:
            log.info("the error of part %s reached no receiver: %s", part.req_id, exc.message)
        finally:
            self.parts.release(state)

    async def deliver(self, state: Part, part: EncodePart, frames: list[Any], warn: bool = True) -> None:
        if part.embedding_port is None:  # zmq_to_scheduler: to the ranks that register
            await self.parts.deliver(state, frames, warn)
            return
        # zmq_to_tokenizer (one port), or SGLang's per-request scheduler ports (a list): one request's sockets
        ports = part.embedding_port if isinstance(part.embedding_port, list) else [part.embedding_port]
        timeout = self.service.settings.sglang_timeout_s
        results = await asyncio.gather(*(self.pushes.push(endpoint(part.prefill_host, p), frames, timeout, keep=False)
                                         for p in ports), return_exceptions=True)  # type: ignore[arg-type]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    # ---- the other routes -----------------------------------------------------------------------
    async def small_json(self, request: Request) -> tuple[bytes, dict[str, Any]]:
        self.service.check_auth(request)
        body = await self.service.read_body(request)
        try:
            obj = json.loads(body)
        except ValueError as exc:
            raise bad(f"the body is not JSON: {exc}", "invalid_json") from None
        if not isinstance(obj, dict):
            raise bad("the body must be a JSON object")
        request.state.sglang_req_id = obj.get("req_id") if isinstance(obj.get("req_id"), str) else None
        return body, obj

    async def receive_url(self, request: Request, path: str) -> Response:
        try:
            body, obj = await self.small_json(request)
            socket_path = self.owner(request, obj.get("req_id"))
            if socket_path is not None:
                return await Forward(self, request, socket_path, path, body).finish()
            req_id, count = obj.get("req_id"), obj.get("receive_count")
            if not isinstance(req_id, str) or not req_id:
                raise bad("missing or invalid req_id")
            if not _count(count) or count <= 0:
                raise bad("receive_count must be a positive integer")
            await self.parts.register(req_id, count, receive_endpoint(obj.get("receive_url")))
            return JSONResponse(None)
        except DeliveryFailed as exc:
            return self.error_response(request, refused(exc))
        except ApiError as exc:
            return self.error_response(request, exc)

    async def mooncake(self, request: Request, path: str) -> Response:
        try:
            body, obj = await self.small_json(request)
            socket_path = self.owner(request, obj.get("req_id"))
            if socket_path is not None:
                return await Forward(self, request, socket_path, path, body).finish()
            if isinstance(obj.get("req_id"), str):
                self.parts.refuse(obj["req_id"], MOONCAKE)
            raise ApiError(501, "not_implemented", MOONCAKE, "unsupported_backend")
        except ApiError as exc:
            return self.error_response(request, exc)

    # ---- reporting and shutdown ---------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        family = self.service.engine.family
        return {"route": "on", "follows": f"SGLang {wire.SGLANG_VERSION}",
                "transfer_backends": ["zmq_to_scheduler", "zmq_to_tokenizer"],
                "family_served": family in wire.VIDEO_FIELD if family else None,
                "timeout_s": self.service.settings.sglang_timeout_s, "pushes": dict(self.pushes.counts),
                "push_sockets": self.pushes.open_sockets, "parts_in_flight": len(self.parts)}

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.pushes.close()


def wire_digest(data: bytes) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(data).hexdigest()


class PushCollector(Collector):
    def __init__(self, route: SGLangRoute) -> None:
        self.route = route

    def collect(self) -> Iterable:
        pushes = CounterMetricFamily("vitserve_sglang_pushes", "Parts pushed to SGLang's receivers, by result: "
                                     "ok, failed (not taken within --sglang-timeout-s, or the connection failed), "
                                     "dropped (a receiver that never registered within --sglang-timeout-s; one per "
                                     "missing rank)", labels=["result"])
        for result in RESULTS:
            pushes.add_metric([result], self.route.pushes.counts[result])
        sockets = GaugeMetricFamily("vitserve_sglang_push_sockets", "Open ZMQ sockets to SGLang's receivers")
        sockets.add_metric([], self.route.pushes.open_sockets)
        parts = GaugeMetricFamily("vitserve_sglang_parts", "SGLang parts being encoded or delivered, or awaited "
                                  "by a registration")
        parts.add_metric([], len(self.route.parts))
        yield from (pushes, sockets, parts)


def install(app: FastAPI, service: Service, front: FrontRole | None) -> SGLangRoute:
    route = SGLangRoute(service, front)
    service.dialects.append(route)
    service.closers.append(route.close)
    service.metrics.registry.register(PushCollector(route))

    @app.post("/scheduler_receive_url", summary="SGLang: a scheduler rank registers for a part (zmq_to_scheduler)",
              response_class=Response)
    async def receive_url(request: Request) -> Response:
        return await route.receive_url(request, "/scheduler_receive_url")

    @app.post("/scheduler_receive_meta_data", summary="SGLang's mooncake backend: not offered (501)",
              response_class=Response, include_in_schema=False)
    async def receive_meta_data(request: Request) -> Response:
        return await route.mooncake(request, "/scheduler_receive_meta_data")

    @app.post("/send", summary="SGLang's mooncake backend: not offered (501)", response_class=Response,
              include_in_schema=False)
    async def send(request: Request) -> Response:
        return await route.mooncake(request, "/send")

    return route
