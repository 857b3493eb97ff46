"""The FastAPI app: authenticate, bound and parse the body, turn media fields into bytes, hand the
items to the engine and serialise what it returns. No batching or device work happens here."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.engine.core import Engine
from service.engine.types import NotReady
from service.http import docs, encoder_cache, encoders, openai, sglang
from service.http.errors import (
    ApiError,
    FaultBarrier,
    from_engine,
    validation_error,
)
from service.http.fronts import FrontRole, ask_siblings, merge_expositions
from service.http.peers import Peers
from service.http.schemas import (
    EncodeRequest,
    EncodeResponse,
    ErrorResponse,
    MultipartOptions,
)
from service.http.service import Service
from service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from service.metrics import Metrics, watch_event_loop
from service.settings import ServeSettings
from service.version import VERSION

log = logging.getLogger("vitserve.http")


# ---- the service -------------------------------------------------------------------------------
def telemetry_options() -> dict[str, Any]:
    """FastAPI's OpenTelemetry hooks, off unless OpenTelemetry is configured through the environment
    (an OTEL_* or FASTAPI_OTEL_* variable): unconfigured, they still look up the global providers
    on every request, on the event loop that every request shares."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}  # a FastAPI without them
    if any(k.startswith(("OTEL_", "FASTAPI_OTEL_")) for k in os.environ):
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}




# ---- the app -----------------------------------------------------------------------------------
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in [
        (400, "malformed request (bad Content-Length)"),
        (401, "API key missing or wrong"),
        (413, "body over --max-payload-bytes"),
        (415, "neither JSON nor multipart"),
        (422, "invalid request or item (the error names the item index)"),
        (429, "over --max-queued-tokens or --max-concurrent-requests, or more work ahead than the request's "
              "--request-timeout-s leaves time for (deadline_unreachable); see Retry-After"),
        (500, "internal error; error_id is logged with the traceback"),
        (503, "starting or shutting down, the engine running the request exited (engine_failed), a worker "
              "process was lost (worker_lost), or the --ec-shared-storage folder cannot be written "
              "(storage_unavailable)"),
        (504, "over --request-timeout-s"),
        (507, "the --ec-shared-storage folder, or /dev/shm, is full (insufficient_storage); nothing was written"),
    ]
}


def create_app(settings: ServeSettings, engine: Engine | None = None, metrics: Metrics | None = None,
               start_engine: bool = True, front: FrontRole | None = None) -> FastAPI:
    metrics = metrics or (engine.metrics if engine else Metrics())
    engine = engine or Engine(settings, metrics)
    service = Service(settings, engine, metrics)
    if settings.replicas or settings.replicas_from:
        service.peers = Peers(settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.handoff.start()
        if service.peers is not None:
            service.peers.start()
        if start_engine and engine.state == "starting":
            engine.start()
        lag_watch = asyncio.create_task(watch_event_loop(metrics.loop_lag_seconds))
        try:
            yield
        finally:
            lag_watch.cancel()
            await service.drain(settings.request_timeout_s)
            if service.fetcher is not None:
                await service.fetcher.close()
            for close in service.closers:
                await close()
            if service.peers is not None:
                await service.peers.close()
            engine.stop()
            service.handoff.stop()

    app = FastAPI(title="vitserve", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Vision encoder for Qwen2-VL, Qwen2.5-VL and Qwen3-VL: images and videos in, "
                              "merged visual tokens out (see docs/api.md).", **telemetry_options())
    app.state.service = service
    app.add_middleware(FaultBarrier)
    docs.install_pages(app)  # /docs and /redoc without a CDN

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return ApiError(exc.status_code, kind, str(exc.detail), kind, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.post("/encode", response_model=EncodeResponse, responses={
        200: {"content": {encoders.SAFETENSORS_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
              "description": "Embeddings (JSON), or one safetensors file with Accept: application/vnd.safetensors"},
        **ERROR_RESPONSES,
    }, openapi_extra={"requestBody": REQUEST_BODY}, summary="Encode images and videos")
    async def encode(request: Request) -> Response:
        t0 = time.perf_counter()
        response = await service.respond(request)
        elapsed = time.perf_counter() - t0
        metrics.requests.labels(str(response.status_code)).inc()
        metrics.request_seconds.observe(elapsed)
        response.headers["server-timing"] = f"encode;dur={elapsed * 1000:.3f}"  # what the server spent on it
        return response

    @app.get("/health", summary="Liveness")
    async def health() -> dict[str, str]:
        return {"status": "ok", "state": engine.state}

    @app.get("/ready", summary="Readiness: 200 once weights are loaded and graphs captured",
             responses={503: {"model": ErrorResponse, "description": "starting or shutting down"}})
    async def ready(scope: str = "server") -> Response:
        """Ready when this front is and, with several fronts, every sibling too (`scope=front`: this one)."""
        if engine.ready:
            problem = engine.unavailable()
            if problem is not None:
                return ApiError(503, "unavailable", problem, "restarting", headers={"Retry-After": "1"}).response()
            if front is None or front.count == 1 or scope == "front":
                return JSONResponse(engine.readiness())
            answers = await ask_siblings(front, "/ready")
            waiting = [name for name, r in answers if r is None or r.status_code != 200]
            if not waiting:
                return JSONResponse({**engine.readiness(), "fronts": front.count})
            return ApiError(503, "unavailable", f"front(s) {', '.join(waiting)} of {front.count} not ready yet",
                            "starting", headers={"Retry-After": "1"}).response()
        try:
            engine.check_accepting()
        except NotReady as exc:
            return from_engine(exc).response()
        return JSONResponse({"status": engine.state})

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {METRICS_CONTENT_TYPE: {}}}})
    async def prometheus(scope: str = "server") -> Response:
        """The whole server's series; `scope=front`: this front's alone (what siblings read of each other)."""
        if front is None or front.count == 1 or scope == "front":
            return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)
        parts = [(str(front.index), metrics.render().decode()),
                 *((name, r.text if r is not None and r.status_code == 200 else None)
                   for name, r in await ask_siblings(front, "/metrics"))]
        missing = [name for name, text in parts if text is None]
        headers = {"x-vitserve-fronts-missing": ",".join(missing)} if missing else None
        body = merge_expositions((name, text) for name, text in parts if text is not None)
        return Response(body, media_type=METRICS_CONTENT_TYPE, headers=headers)

    @app.get("/info", summary="Model, limits, graph pool and version",
             responses={401: ERROR_RESPONSES[401]})
    async def info(request: Request) -> Response:
        try:
            service.check_auth(request)
        except ApiError as exc:
            return exc.response()
        fronts = {"front": {"index": front.index, "of": front.count, "pid": os.getpid()}} if front is not None else {}
        replicas = {"replicas": service.peers.info()} if service.peers is not None else {}
        return JSONResponse({"version": VERSION, **engine.info(), "cache": service.handoff.info(),
                             "sglang": sglang_route.info(), "settings": settings.public_dict(), **fronts,
                             **replicas})

    encoder_cache.install(app, service, front)
    sglang_route = sglang.install(app, service, front)  # SGLang's encoder API (docs/sglang.md)
    if settings.llm_url:
        openai.install(app, service)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (EncodeRequest, MultipartOptions):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        if settings.api_key is not None:
            docs.add_bearer_auth(schema, {"/encode": "post", "/info": "get", "/v1/encoder_cache/{item_id}": "get"})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


REQUEST_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/EncodeRequest"}},
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {
                    "files": {"type": "array", "items": {"type": "string", "format": "binary"},
                              "description": "one part per file; images or videos, sniffed from the bytes"},
                    "options": {"type": "string", "description": "JSON text of a MultipartOptions object"},
                },
                "required": ["files"],
            }
        },
    },
}
