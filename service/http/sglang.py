"""The encoder side of SGLang's encode/prefill/decode disaggregation (SGLang 0.5.23): `sglang serve ...
--language-only --encoder-urls http://vitserve:8100` takes its embeddings from vitserve (docs/sglang.md).

- `POST /encode` with SGLang's body (told apart from vitserve's own by its `mm_items`; service.http.sglang_body
  reads it): one part of a request, `{req_id, mm_items, modality, num_parts, part_idx, prefill_host,
  embedding_port, ...}`. Its
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
import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from service.handoff import sglang_wire as wire
from service.handoff.sglang_push import RESULTS, DeliveryFailed, Part, Parts, Pushes
from service.http.errors import ApiError, item_error, server_fault
from service.http.fronts import FrontRole
from service.http.parsing import Parsed
from service.http.schemas import OutputOptions
from service.http.service import RENDER_HERE_BYTES, Deferred, parses_here
from service.http.sglang_body import (
    EncodePart,
    bad,
    digest,
    endpoint,
    is_count,
    parse_part,
    part_frames,
    receive_endpoint,
    refused,
)

if TYPE_CHECKING:
    from service.http.service import Service
    from service.workers.pool import Owner

log = logging.getLogger("vitserve.sglang")
MARKER = b'"mm_items"'  # in SGLang's /encode body, never in vitserve's (whose fields are known)
MARKER_WITHIN = 64 << 10  # SGLang writes its few short fields, then mm_items with the media
FORWARDED = "x-vitserve-front-hop"  # a request one front passed on to the front its part belongs to
MOONCAKE = ("vitserve does not offer SGLang's mooncake encoder transfer backend: start SGLang with "
            "--encoder-transfer-backend zmq_to_scheduler (the default) or zmq_to_tokenizer")


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
        """SGLang's body: a JSON object with `mm_items` (a key SGLang writes before its media, in the first
        bytes: looked for there alone, so that vitserve's own bodies cost one short search) and no `items`."""
        if request.headers.get("content-type", "application/json").split(";")[0].strip().lower() != \
                "application/json" or body.find(MARKER, 0, MARKER_WITHIN) < 0:
            return False
        try:
            obj = json.loads(body) if parses_here(len(body)) else await self.service.run_in_pool(json.loads, body)
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
        # its media decoded from base64 here, or on a parse thread for a large body, as vitserve's own are
        part = parse_part(obj, service.settings) if parses_here(len(body)) else await service.run_in_pool(
            parse_part, obj, service.settings)
        model = service.engine.model
        assert model is not None  # accepting: loaded
        family = service.engine.family
        served = wire.MODEL_TYPES.get(family or "")
        if served is None:
            raise ApiError(501, "not_implemented", f"this server's family {family} is not one SGLang "
                                                   f"{wire.SGLANG_VERSION} disaggregates", "unsupported_family")
        if part.modality == "video" and not served.takes_video:
            raise ApiError(501, "not_implemented", f"SGLang {wire.SGLANG_VERSION} takes no video of {family} "
                                                   "from an encoder", "unsupported_modality")
        try:
            state = self.parts.begin(part.req_id)
        except DeliveryFailed as exc:
            raise refused(exc) from None
        try:
            await service.resolve_urls(Parsed(part.items, OutputOptions()))
            for p, expected in zip(part.items, part.hashes):
                if expected is not None and digest(p.data) != expected:  # type: ignore[arg-type]
                    raise item_error(p.index, "its bytes do not match its content_hash", "hash_mismatch")
            items = [p.media() for p in part.items]
            results = await service.handoff.encode(items, "sglang", model,
                                                   lambda todo: service.engine.encode(todo, owner, deadline),
                                                   service.run_in_pool)
            try:
                nbytes = sum(r.output.nbytes for r in results)
                args = (part, results, model, served)
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
            if not is_count(count) or count <= 0:
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
                "family_served": family in wire.MODEL_TYPES if family else None,
                "timeout_s": self.service.settings.sglang_timeout_s, "pushes": dict(self.pushes.counts),
                "push_sockets": self.pushes.open_sockets, "parts_in_flight": len(self.parts)}

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.pushes.close()


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
