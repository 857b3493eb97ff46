"""The HTTP layer: authenticate, bound and parse the body, turn media fields into bytes, hand the
items to the engine and serialise what it returns. No batching or device work happens here.

Every error status carries one JSON shape: `{"error": {"type", "message", "index", "code"}}`.
"""

from __future__ import annotations

import asyncio
import binascii
import hmac
import http.client
import inspect
import json
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TypeVar

import pybase64
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.engine.core import (
    Engine,
    EngineDied,
    EngineError,
    EngineFailure,
    ItemError,
    ItemResult,
    MediaItem,
    NotReady,
    OutputSpec,
    Overloaded,
    RequestRejected,
)
from service.handoff.ec_storage import ECSharedStorage
from service.http import encoders
from service.http.schemas import (
    EncodeRequest,
    EncodeResponse,
    ErrorResponse,
    FileOptions,
    ImageItem,
    MultipartOptions,
    OutputOptions,
)
from service.media.sniff import sniff_modality
from service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from service.metrics import Metrics
from service.settings import ServeSettings

log = logging.getLogger("vitserve.http")
T = TypeVar("T")

try:
    VERSION = metadata.version("vitserve")
except metadata.PackageNotFoundError:  # running from a checkout
    VERSION = "0.1.0"

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_WHITESPACE = str.maketrans("", "", " \t\r\n")


# ---- errors ------------------------------------------------------------------------------------
class ApiError(Exception):
    def __init__(self, status: int, type_: str, message: str, code: str | None = None, index: int | None = None,
                 headers: dict[str, str] | None = None, error_id: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message
        self.code, self.index, self.headers, self.error_id = code, index, headers, error_id

    def response(self) -> JSONResponse:
        body: dict[str, Any] = {"type": self.type, "message": self.message, "index": self.index, "code": self.code}
        if self.error_id:
            body["error_id"] = self.error_id
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client disconnected while its items were queued or running."""


def item_error(index: int, message: str, code: str) -> ApiError:
    return ApiError(422, "invalid_item", message, code, index)


def from_engine(exc: Exception) -> ApiError:
    if isinstance(exc, ItemError):
        return item_error(exc.index, exc.message, exc.code)
    if isinstance(exc, RequestRejected):
        return ApiError(422, "invalid_request", exc.message, exc.code)
    if isinstance(exc, Overloaded):
        return ApiError(429, "overloaded", exc.message, exc.code, headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, NotReady):
        return ApiError(503, "unavailable", exc.message, exc.code, headers={"Retry-After": "5"})
    if isinstance(exc, EngineFailure):
        return ApiError(500, "internal", exc.message, exc.code, error_id=exc.error_id)
    if isinstance(exc, EngineDied):  # one engine of several exited: a retry lands on another
        return ApiError(503, "engine_failed", exc.message, exc.code, headers={"Retry-After": "1"})
    raise TypeError(exc)


def pydantic_error(exc: ValidationError, prefix: tuple = ()) -> ApiError:
    """The first problem, with the item index when it lies inside `items[i]`."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(prefix) + tuple(err["loc"])
    where = ".".join(str(p) for p in loc) or "body"
    message = f"{where}: {err['msg'].removeprefix('Value error, ')}"
    code = {"extra_forbidden": "unknown_field", "union_tag_invalid": "unsupported_type",
            "missing": "missing_field", "json_invalid": "invalid_json"}.get(err["type"], "invalid_value")
    if len(loc) >= 2 and loc[0] == "items" and isinstance(loc[1], int):
        return item_error(loc[1], message, code)
    return ApiError(422, "invalid_request", message, code)


# ---- parsed requests ---------------------------------------------------------------------------
@dataclass
class Pending:
    """An item after parsing: bytes, or a URL still to fetch."""

    index: int
    modality: str
    data: bytes | None
    url: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    id: str | None = None

    def media(self) -> MediaItem:
        assert self.data is not None
        return MediaItem(self.index, self.modality, self.data, self.options, self.id)  # type: ignore[arg-type]


@dataclass
class Parsed:
    items: list[Pending]
    output: OutputOptions


def decode_media(value: str, index: int, modality: str, allow_url: bool) -> tuple[bytes | None, str | None]:
    """A media field -> (bytes, None) or (None, url). Never touches the filesystem."""
    head = value[:16].lower()
    if head.startswith(("http://", "https://")):
        if not allow_url:
            raise item_error(index, "URLs are not accepted by this server (it runs without --allow-url): "
                                    "send the file's bytes as base64", "url_not_allowed")
        return None, value
    if head.startswith("data:"):
        meta, sep, payload = value.partition(",")
        if not sep or not meta.lower().endswith(";base64"):
            raise item_error(index, "a data URL must look like data:<mime>;base64,<payload>", "invalid_data_url")
        mime = meta[5:-7].split(";")[0].strip().lower()
        family = mime.split("/")[0]
        if family in ("image", "video") and family != modality:
            raise item_error(index, f"a {mime} data URL in a {modality} item", "type_mismatch")
        value = payload
    elif _SCHEME.match(value[:40]):  # base64 has no ':', so this names a scheme (file:, ftp:, C:...)
        raise item_error(index, f"{value.split(':', 1)[0]}: URLs are never read (only http(s) with "
                                "--allow-url); send the file's bytes as base64", "url_not_allowed")
    data = b64decode(value, index)
    if not data:
        raise item_error(index, f"the {modality} is empty", "empty")
    return data, None


def b64decode(value: str, index: int) -> bytes:
    try:  # strict standard base64, the common case: one SIMD pass
        return pybase64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        pass
    text = value.translate(_WHITESPACE)
    if "-" in text or "_" in text:
        text = text.replace("-", "+").replace("_", "/")
    text += "=" * (-len(text) % 4)
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        hint = ""
        if value[:1] in ("/", "~", ".") or value[1:3] in (":\\", ":/"):
            hint = " (it looks like a file path: the server never reads local files, send the bytes)"
        raise item_error(index, "not valid base64 nor a data URL" + hint, "invalid_base64") from None


def parse_json_request(body: bytes, settings: ServeSettings) -> Parsed:
    try:
        req = EncodeRequest.model_validate_json(body)
    except ValidationError as exc:
        raise pydantic_error(exc) from None
    check_count(len(req.items), settings)
    items = []
    for i, it in enumerate(req.items):
        media_field = "image" if isinstance(it, ImageItem) else "video"
        raw = getattr(it, media_field)
        data, url = decode_media(raw, i, it.type, settings.allow_url)
        options = it.model_dump(exclude={"type", "image", "video", "id"}, exclude_none=True)
        items.append(Pending(i, it.type, data, url, options, it.id))
    check_ids(items)
    return Parsed(items, OutputOptions(encoding_format=req.encoding_format, dtype=req.dtype,
                                       include_deepstack=req.include_deepstack))


def check_count(n: int, settings: ServeSettings) -> None:
    if n > settings.max_items_per_request:
        raise ApiError(422, "invalid_request", f"{n} items; at most {settings.max_items_per_request} per request "
                                               "(--max-items-per-request)", "too_many_items")


def check_ids(items: list[Pending]) -> None:
    seen: dict[str, int] = {}
    for it in items:
        if it.id is None:
            continue
        if it.id in seen:
            raise item_error(it.index, f"id {it.id!r} is also item {seen[it.id]}'s", "duplicate_id")
        seen[it.id] = it.index


VIDEO_ONLY = ("fps", "nframes", "min_frames", "max_frames", "video_start", "video_end", "total_pixels")


@dataclass
class Part:
    name: str
    filename: str | None
    data: bytearray = field(default_factory=bytearray)


def split_multipart(content_type: str, body: bytes, max_parts: int) -> list[Part]:
    """multipart/form-data -> parts, in memory (the body is already size-capped)."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise ApiError(422, "invalid_request", "multipart body without a boundary", "invalid_multipart")
    parts: list[Part] = []
    header: dict[str, bytearray] = {"field": bytearray(), "value": bytearray()}
    headers: dict[bytes, bytes] = {}

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header["value"] += data[start:end]

    def on_header_end() -> None:
        headers[bytes(header["field"]).lower()] = bytes(header["value"])
        header["field"], header["value"] = bytearray(), bytearray()

    def on_headers_finished() -> None:
        disposition, opts = parse_options_header(headers.get(b"content-disposition", b""))
        if disposition != b"form-data" or b"name" not in opts:
            raise ApiError(422, "invalid_request", "a multipart part without a form-data name", "invalid_multipart")
        if len(parts) >= max_parts:
            raise ApiError(422, "invalid_request", f"more than {max_parts} multipart parts", "too_many_items")
        filename = opts.get(b"filename")
        parts.append(Part(opts[b"name"].decode("utf-8", "replace"),
                          None if filename is None else filename.decode("utf-8", "replace")))
        headers.clear()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        parts[-1].data += data[start:end]

    callbacks = {"on_header_field": on_header_field, "on_header_value": on_header_value,
                 "on_header_end": on_header_end, "on_headers_finished": on_headers_finished,
                 "on_part_data": on_part_data}
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError as exc:
        raise ApiError(422, "invalid_request", f"malformed multipart body: {exc}", "invalid_multipart") from None
    return parts


def parse_multipart(content_type: str, body: bytes, settings: ServeSettings) -> Parsed:
    parts = split_multipart(content_type, body, settings.max_items_per_request + 2)
    unknown = sorted({p.name for p in parts} - {"files", "options"})
    if unknown:
        raise ApiError(422, "invalid_request", f"unknown multipart field(s): {', '.join(unknown)}; "
                                               "use 'files' and 'options'", "unknown_field")
    files = [p for p in parts if p.name == "files"]
    if not files:
        raise ApiError(422, "invalid_request", "no files: send each file under the field 'files'", "missing_field")
    check_count(len(files), settings)
    raw_options = [p for p in parts if p.name == "options"]
    if len(raw_options) > 1:
        raise ApiError(422, "invalid_request", "'options' must be one JSON text field", "invalid_multipart")
    try:
        options = MultipartOptions.model_validate_json(bytes(raw_options[0].data) if raw_options else b"{}")
    except ValidationError as exc:
        raise pydantic_error(exc, ("options",)) from None
    per_file = options.items or [FileOptions() for _ in files]
    if len(per_file) != len(files):
        raise ApiError(422, "invalid_request", f"options.items has {len(per_file)} entries for {len(files)} files",
                       "invalid_value")
    items = []
    for i, (part, opts) in enumerate(zip(files, per_file)):
        data = bytes(part.data)
        if not data:
            raise item_error(i, "the file is empty", "empty")
        modality = sniff_modality(data)
        values = opts.model_dump(exclude={"id"}, exclude_none=True)
        misplaced = sorted(set(values) & set(VIDEO_ONLY)) if modality == "image" else []
        if misplaced:
            raise item_error(i, f"option(s) {', '.join(misplaced)} apply to videos; this file is an image",
                             "invalid_option")
        items.append(Pending(i, modality, data, None, values, opts.id))
    check_ids(items)
    return Parsed(items, OutputOptions(encoding_format=options.encoding_format, dtype=options.dtype,
                                       include_deepstack=options.include_deepstack))


# ---- URLs (off unless --allow-url) -------------------------------------------------------------
class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a 3xx becomes an HTTPError: a redirect could leave the allow-list


class UrlFetcher:
    """http(s) GET of allow-listed hosts only: no redirects, no proxies from the environment, no
    other schemes (the opener has no file/ftp/data handlers), size-capped, with a total timeout.
    Blocking urllib in the worker pool keeps the server free of an HTTP-client dependency."""

    def __init__(self, settings: ServeSettings, pool: Executor) -> None:
        self.allowed = set(settings.allowed_hosts)
        self.max_bytes = settings.max_payload_bytes
        self.timeout = settings.url_timeout_s
        self.pool = pool
        self.opener = urllib.request.OpenerDirector()
        for handler in (urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(),
                        urllib.request.HTTPDefaultErrorHandler(), _NoRedirect(), urllib.request.HTTPErrorProcessor()):
            self.opener.add_handler(handler)

    def host_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == h or (h.startswith("*.") and host.endswith(h[1:])) for h in self.allowed)

    def check(self, url: str, index: int) -> None:
        try:
            parts = urllib.parse.urlsplit(url)
            host = parts.hostname or ""
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError as exc:
            raise item_error(index, f"invalid URL: {exc}", "invalid_url") from None
        if parts.scheme not in ("http", "https"):
            raise item_error(index, "only http and https URLs are fetched", "url_not_allowed")
        if not self.host_allowed(host):
            raise item_error(index, f"host {host!r} is not in --allowed-hosts", "url_not_allowed")

    async def fetch(self, url: str, index: int) -> bytes:
        self.check(url, index)
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self.pool, self._get, url, index), self.timeout + 1)
        except (asyncio.TimeoutError, TimeoutError):
            raise self._timeout(index) from None

    def _timeout(self, index: int) -> ApiError:
        return item_error(index, f"fetching the URL took longer than {self.timeout:g}s", "fetch_timeout")

    def _get(self, url: str, index: int) -> bytes:
        deadline = time.monotonic() + self.timeout
        request = urllib.request.Request(url, headers={"User-Agent": f"vitserve/{VERSION}"})
        try:
            with self.opener.open(request, timeout=self.timeout) as resp:
                length = resp.headers.get("content-length")
                if length and length.isdigit() and int(length) > self.max_bytes:
                    raise item_error(index, f"the URL's content is {length} bytes, above the limit of "
                                            f"{self.max_bytes}", "too_large")
                data = bytearray()
                while chunk := resp.read(1 << 16):
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise item_error(index, f"the URL's content is above the limit of {self.max_bytes} bytes",
                                         "too_large")
                    if time.monotonic() > deadline:
                        raise self._timeout(index)
                return bytes(data)
        except urllib.error.HTTPError as exc:
            raise item_error(index, f"fetching the URL returned HTTP {exc.code}", "fetch_failed") from None
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
                raise self._timeout(index) from None
            raise item_error(index, f"fetching the URL failed: {type(exc).__name__}", "fetch_failed") from None


# ---- the service -------------------------------------------------------------------------------
class Service:
    def __init__(self, settings: ServeSettings, engine: Engine, metrics: Metrics) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.storage = ECSharedStorage(settings.ec_shared_storage) if settings.ec_shared_storage else None
        self.fetcher: UrlFetcher | None = None
        self._api_key = settings.api_key_bytes()

    async def run_in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.engine.pool, fn, *args)

    def check_auth(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key):
            raise ApiError(401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           "unauthorized", headers={"WWW-Authenticate": "Bearer"})

    async def read_body(self, request: Request) -> bytes:
        """The whole body, refused with 413 by Content-Length and again while streaming."""
        limit = self.settings.max_payload_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, "invalid_request", "bad Content-Length", "bad_content_length")
            if int(declared) > limit:
                raise too_large(f"declares {declared} bytes", limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large(f"passed {limit} bytes while streaming", limit)
        return bytes(body)

    async def parse(self, request: Request, body: bytes) -> Parsed:
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if ctype in ("application/json", "text/json") or ctype.endswith("+json"):
            return await self.run_in_pool(parse_json_request, body, self.settings)
        if ctype == "multipart/form-data":
            return await self.run_in_pool(parse_multipart, request.headers["content-type"], body, self.settings)
        raise ApiError(415, "unsupported_media_type", f"content type {ctype!r}: send application/json or "
                                                      "multipart/form-data", "unsupported_media_type")

    async def resolve_urls(self, parsed: Parsed) -> None:
        todo = [it for it in parsed.items if it.url is not None]
        if not todo:
            return
        if self.fetcher is None:
            self.fetcher = UrlFetcher(self.settings, self.engine.pool)
        datas = await asyncio.gather(*(self.fetcher.fetch(it.url, it.index) for it in todo))  # type: ignore[arg-type]
        for it, data in zip(todo, datas):
            if not data:
                raise item_error(it.index, "the URL returned no bytes", "empty")
            it.data = data

    async def encode_items(self, request: Request, parsed: Parsed, spec: OutputSpec) -> list[ItemResult]:
        """engine.encode raced against the client going away (then its queued items are dropped)."""
        work = asyncio.ensure_future(self.engine.encode([it.media() for it in parsed.items], spec))
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise ClientGone()
            return work.result()
        finally:
            for task in (work, gone):
                if not task.done():
                    task.cancel()
            await asyncio.gather(work, gone, return_exceptions=True)

    async def respond(self, request: Request) -> Response:
        """Every outcome of one /encode call as a response (499: the client is gone, nobody reads it)."""
        try:
            return await self.handle_encode(request)
        except ApiError as exc:
            return exc.response()
        except EngineError as exc:
            return from_engine(exc).response()
        except (asyncio.TimeoutError, TimeoutError):
            return ApiError(504, "timeout", f"the request took longer than {self.settings.request_timeout_s:g}s "
                                            "(--request-timeout-s)", "timeout").response()
        except ClientGone:
            log.info("client went away; its queued work was dropped")
            return Response(status_code=499)
        except Exception as exc:
            error_id = "err-" + uuid.uuid4().hex[:12]
            log.exception("internal error %s", error_id)
            return ApiError(500, "internal", f"internal error {error_id}: {type(exc).__name__}", "internal",
                            error_id=error_id).response()

    async def handle_encode(self, request: Request) -> Response:
        self.check_auth(request)
        self.engine.check_accepting()
        with self.engine.request_slot():
            return await asyncio.wait_for(self._encode(request), self.settings.request_timeout_s)

    async def _encode(self, request: Request) -> Response:
        body = await self.read_body(request)
        parsed = await self.parse(request, body)
        del body
        await self.resolve_urls(parsed)
        out = parsed.output
        want_st = encoders.SAFETENSORS_MEDIA_TYPE in request.headers.get("accept", "")
        spec = OutputSpec(
            dtype=encoders.DTYPES[out.dtype],
            deepstack=out.include_deepstack,
            joined=out.encoding_format == "vllm" and not want_st,
            ec_cache=self.storage is not None,
        )
        results = await self.encode_items(request, parsed, spec)
        if self.storage is not None:
            await self.run_in_pool(self.write_ec, results)
        request_id = "enc-" + uuid.uuid4().hex
        model = self.settings.model_name
        if want_st:
            family = self.engine.family
            content = await self.run_in_pool(lambda: encoders.safetensors_body(
                results, request_id=request_id, model=model, dtype=out.dtype, include_deepstack=out.include_deepstack,
                family=family))
            return Response(content, media_type=encoders.SAFETENSORS_MEDIA_TYPE, headers={"x-request-id": request_id})
        content = await self.run_in_pool(lambda: encoders.json_body(
            results, request_id=request_id, model=model, fmt=out.encoding_format, dtype=out.dtype,
            include_deepstack=out.include_deepstack))
        return Response(content, media_type="application/json", headers={"x-request-id": request_id})

    def write_ec(self, results: list[ItemResult]) -> None:
        assert self.storage is not None
        for r in results:
            if r.ec_cache is not None and r.id is not None:
                self.storage.write(r.id, r.ec_cache, {"model": self.settings.model_name,
                                                      "grid_thw": json.dumps(list(r.grid_thw))})

    async def drain(self, timeout: float) -> bool:
        """SIGTERM: refuse new work, let admitted requests finish (True if all did in time)."""
        self.engine.begin_drain()
        done = await self.engine.wait_idle(timeout)
        if not done:
            log.warning("drain timed out after %.1fs with %d request(s) in flight", timeout, self.engine.inflight)
        return done


def telemetry_options() -> dict[str, Any]:
    """FastAPI's OpenTelemetry hooks, off unless OpenTelemetry is configured through the environment
    (an OTEL_* or FASTAPI_OTEL_* variable): unconfigured, they still look up the global providers
    on every request, on the event loop that every request shares."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}  # a FastAPI without them
    if any(k.startswith(("OTEL_", "FASTAPI_OTEL_")) for k in os.environ):
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def too_large(what: str, limit: int) -> ApiError:
    return ApiError(413, "payload_too_large", f"the body {what}: the limit is {limit} bytes (--max-payload-bytes)",
                    "payload_too_large")


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---- the app -----------------------------------------------------------------------------------
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in [
        (400, "malformed request (bad Content-Length)"),
        (401, "API key missing or wrong"),
        (413, "body over --max-payload-bytes"),
        (415, "neither JSON nor multipart"),
        (422, "invalid request or item (the error names the item index)"),
        (429, "over --max-queued-tokens or --max-concurrent-requests; see Retry-After"),
        (500, "internal error; error_id is logged with the traceback"),
        (503, "starting or shutting down, or the engine running the request exited (engine_failed)"),
        (504, "over --request-timeout-s"),
    ]
}


def create_app(settings: ServeSettings, engine: Engine | None = None, metrics: Metrics | None = None,
               start_engine: bool = True) -> FastAPI:
    metrics = metrics or (engine.metrics if engine else Metrics())
    engine = engine or Engine(settings, metrics)
    service = Service(settings, engine, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if service.storage is not None:
            service.storage.check()
        if start_engine and engine.state == "starting":
            engine.start(background=engine.runner is None)
        try:
            yield
        finally:
            await service.drain(settings.request_timeout_s)
            engine.stop()

    app = FastAPI(title="vitserve", version=VERSION, lifespan=lifespan,
                  description="Vision encoder for Qwen2-VL, Qwen2.5-VL and Qwen3-VL: images and videos in, "
                              "merged visual tokens out (see docs/api.md).", **telemetry_options())
    app.state.service = service

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return ApiError(exc.status_code, kind, str(exc.detail), kind, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return ApiError(422, "invalid_request", str(exc.errors()[:1]), "invalid_value").response()

    @app.post("/encode", response_model=EncodeResponse, responses={
        200: {"content": {encoders.SAFETENSORS_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
              "description": "Embeddings (JSON), or one safetensors file with Accept: application/vnd.safetensors"},
        **ERROR_RESPONSES,
    }, openapi_extra={"requestBody": REQUEST_BODY}, summary="Encode images and videos")
    async def encode(request: Request) -> Response:
        t0 = time.perf_counter()
        response = await service.respond(request)
        metrics.requests.labels(str(response.status_code)).inc()
        metrics.request_seconds.observe(time.perf_counter() - t0)
        return response

    @app.get("/health", summary="Liveness")
    async def health() -> dict[str, str]:
        return {"status": "ok", "state": engine.state}

    @app.get("/ready", summary="Readiness: 200 once weights are loaded and graphs captured",
             responses={503: {"model": ErrorResponse, "description": "starting or shutting down"}})
    async def ready() -> Response:
        if engine.ready:
            return JSONResponse(engine.readiness())
        try:
            engine.check_accepting()
        except NotReady as exc:
            return from_engine(exc).response()
        return JSONResponse({"status": engine.state})

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {METRICS_CONTENT_TYPE: {}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/info", summary="Model, limits, graph pool and version",
             responses={401: ERROR_RESPONSES[401]})
    async def info(request: Request) -> Response:
        try:
            service.check_auth(request)
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"version": VERSION, **engine.info(), "settings": settings.public_dict()})

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (EncodeRequest, MultipartOptions):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
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

