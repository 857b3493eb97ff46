"""The request service the routes share: authentication, bounded bodies, media fields turned into bytes,
the hand-off to the engine and the rendering of its results. The routes (`app`, `encoder_cache`, `openai`)
call it; it knows nothing of them."""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from fastapi import Request, Response
from starlette.requests import ClientDisconnect

from service import shm
from service.engine.core import Engine
from service.engine.types import EngineError, EngineFailure, ItemResult, WorkerLost, new_error_id
from service.handoff.ec_storage import StorageError
from service.handoff.pipeline import Handoff
from service.http import encoders
from service.http.errors import (
    ApiError,
    ClientGone,
    from_engine,
    item_error,
    server_fault,
    too_large,
)
from service.http.parsing import Parsed, parse_json_request, parse_multipart
from service.http.peers import Peers
from service.http.responses import PartsResponse, json_parts, take_segment
from service.http.urls import UrlFetcher
from service.metrics import Metrics
from service.settings import ServeSettings
from service.workers import jobs
from service.workers.pool import JobFailed, Owner, WorkerDied

log = logging.getLogger("vitserve.http")
T = TypeVar("T")


class Deferred:
    """An /encode answer that waits on work past the request's slot and deadline: `Service.respond` awaits
    `finish` once the encode is done (SGLang's parts, answered when their pushes are: service.http.sglang)."""

    async def finish(self) -> Response:
        raise NotImplementedError


class Dialect(Protocol):
    """Another body /encode takes, told apart from vitserve's own by `claims` (service.http.sglang): it encodes
    the request and answers its errors in its own shape."""

    async def claims(self, request: Request, body: bytes) -> bool: ...

    async def encode(self, request: Request, owner: Owner, body: bytes, deadline: float) -> Response | Deferred: ...

    def error_response(self, request: Request, error: ApiError) -> Response: ...


class Service:
    def __init__(self, settings: ServeSettings, engine: Engine, metrics: Metrics) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.handoff = Handoff(settings, engine.names)
        metrics.attach_cache(self.handoff.stats)
        self.fetcher: UrlFetcher | None = None
        self.closers: list[Callable[[], Awaitable[None]]] = []  # run at shutdown (the LLM proxy's client)
        self.peers: Peers | None = None  # the other replicas (--replicas, --replicas-from)
        self.dialects: list[Dialect] = []
        self._api_key = settings.api_key_bytes()
        # Large request bodies are parsed off the event loop's turn (`parses_here`).
        self._parsers = ThreadPoolExecutor(2, thread_name_prefix="vitserve-parse")

    async def run_in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._parsers, fn, *args)

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
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large(f"passed {limit} bytes while streaming", limit)
        except ClientDisconnect:  # gone mid-upload: the client's doing, not a server error
            raise ClientGone(f"while sending its body, after {len(body)} bytes") from None
        return bytes(body)

    async def parse(self, request: Request, body: bytes) -> Parsed:
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if ctype in ("application/json", "text/json") or ctype.endswith("+json"):
            work = functools.partial(parse_json_request, body, self.settings)
        elif ctype == "multipart/form-data":
            work = functools.partial(parse_multipart, request.headers["content-type"], body, self.settings)
        else:
            raise ApiError(415, "unsupported_media_type", f"content type {ctype!r}: send application/json or "
                                                          "multipart/form-data", "unsupported_media_type")
        return work() if parses_here(len(body)) else await self.run_in_pool(work)

    async def resolve_urls(self, parsed: Parsed) -> None:
        todo = [it for it in parsed.items if it.url is not None]
        if not todo:
            return
        if self.fetcher is None:
            self.fetcher = UrlFetcher(self.settings)
        datas = await asyncio.gather(*(self.fetcher.fetch(it.url, it.index) for it in todo))  # type: ignore[arg-type]
        for it, data in zip(todo, datas):
            if not data:
                raise item_error(it.index, "the URL returned no bytes", "empty")
            it.data = data

    async def until_gone(self, request: Request, work: Awaitable[T]) -> T:
        """`work` raced against the client going away: then it is cancelled, and ClientGone raised."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                raise ClientGone("while its request was being served; its work was stopped")
            return task.result()
        finally:
            for t in (task, gone):
                if not t.done():
                    t.cancel()
            await asyncio.gather(task, gone, return_exceptions=True)

    async def respond(self, request: Request) -> Response:
        """Every outcome of one /encode call as a response (499: the client is gone, nobody reads it)."""
        try:
            response = await self.handle_encode(request)
            if isinstance(response, Deferred):
                response = await self.until_gone(request, response.finish())
            return response
        except ClientGone as exc:
            log.info("client went away %s (counted as 499)", exc)
            return Response(status_code=499)
        except Exception as exc:
            error, logged = self.api_error(exc)
            if error.status >= 500:
                server_fault(error, logged)
            dialect = getattr(request.state, "dialect", None)
            return dialect.error_response(request, error) if dialect is not None else error.response()

    def api_error(self, exc: Exception) -> tuple[ApiError, bool]:
        """The API's error for a failed request, and whether a log line already carries its error id."""
        if isinstance(exc, ApiError):  # one that carries an error id was logged with it
            return exc, exc.error_id is not None
        if isinstance(exc, EngineFailure):  # the engine or the worker logged the traceback with the id
            return from_engine(exc), True
        if isinstance(exc, EngineError):
            return from_engine(exc), False
        if isinstance(exc, StorageError):  # the shared encoder-cache folder: full (507) or unwritable (503)
            kind = "insufficient_storage" if exc.status == 507 else "unavailable"
            return ApiError(exc.status, kind, exc.message, exc.code, headers={"Retry-After": "5"}), False
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            return ApiError(504, "timeout", f"the request took longer than {self.settings.request_timeout_s:g}s "
                                            "(--request-timeout-s)", "timeout"), False
        if isinstance(exc, WorkerDied):  # a worker encoding the response: never the request's doing
            return from_engine(WorkerLost(f"encoding the response: {exc}")), False
        error_id = new_error_id()
        if isinstance(exc, JobFailed):  # a bug in a worker's job: its traceback came back with it
            log.error("internal error %s: %s\n%s", error_id, exc, exc.details)
        else:
            log.exception("internal error %s", error_id)
        return ApiError(500, "internal", f"internal error {error_id}: {type(exc).__name__}", "internal",
                        error_id=error_id), True

    async def handle_encode(self, request: Request) -> Response | Deferred:
        self.check_auth(request)
        self.engine.check_accepting()
        with self.engine.request_slot():
            owner = self.engine.new_request()
            try:
                deadline = time.monotonic() + self.settings.request_timeout_s
                async with asyncio.timeout(self.settings.request_timeout_s):
                    started = time.perf_counter()
                    body = await self.read_body(request)
                    self.metrics.phase_seconds.labels("body").observe(time.perf_counter() - started)
                    # One watcher for the client going away, from the end of the body to the response.
                    return await self.until_gone(request, self._encode(request, owner, body, deadline))
            except BaseException:
                self.engine.cancel(owner)  # whatever it still runs stops: media jobs, queued items, encodes
                raise

    async def _encode(self, request: Request, owner: Owner, body: bytes, deadline: float) -> Response | Deferred:
        for dialect in self.dialects:
            if await dialect.claims(request, body):
                request.state.dialect = dialect
                return await dialect.encode(request, owner, body, deadline)
        started = time.perf_counter()
        parsed = await self.parse(request, body)
        del body
        await self.resolve_urls(parsed)
        self.metrics.phase_seconds.labels("parse").observe(time.perf_counter() - started)
        items = [it.media() for it in parsed.items]
        model = self.engine.model
        assert model is not None  # loaded: handle_encode's check_accepting passed
        results = await self.handoff.encode(items, parsed.output.encoding_format, model,
                                            lambda todo: self.engine.encode(todo, owner, deadline), self.run_in_pool)
        try:
            started = time.perf_counter()
            response = await self.render(request, owner, results, parsed.output)
            self.metrics.render_seconds.observe(time.perf_counter() - started)
            return response
        finally:
            self.handoff.release(results)  # the workers have read what they needed

    async def render(self, request: Request, owner: Owner, results: list[ItemResult], out: Any) -> Response:
        """The response body. It is encoded in the worker processes, which keeps the event loop free for
        the other requests; a request alone in this front keeps it free for nobody, so its body is
        encoded here, on a parse thread, without a worker's round trip and the segment it would write."""
        model = self.engine.model
        assert model is not None
        request_id = "enc-" + uuid.uuid4().hex
        headers = {"x-request-id": request_id, "x-vitserve-cache-hits": str(sum(r.cached for r in results))}
        # The encoder retires an output it alone reads: giving up its file is then off the event loop.
        shared = [_result_fields(r, release) for r, release in zip(results, self.handoff.releasable(results))]
        safetensors = encoders.SAFETENSORS_MEDIA_TYPE in request.headers.get("accept", "")
        here = self.renders_here("safetensors" if safetensors else out.encoding_format,
                                 sum(r.output.nbytes for r in results))
        if safetensors:
            header = dict(request_id=request_id, model=self.settings.model_name, dtype=out.dtype,
                          include_deepstack=out.include_deepstack, family=self.engine.family)
            body = await self.encoded(owner, here, "safetensors_file", "encode_safetensors",
                                      shared, header, model.out_hidden_size)
            return PartsResponse([body], encoders.SAFETENSORS_MEDIA_TYPE, headers)
        args = (out.encoding_format, out.dtype, out.include_deepstack, model.out_hidden_size, self.engine.family,
                model.processor.temporal_patch_size)
        if out.encoding_format == "vllm_ref":  # metadata only, microseconds: no thread or worker round trip
            entries: list[Any] = [b"".join(jobs.item_json(fields, *args)) for fields in shared]
        else:
            entries = await asyncio.gather(*(self.encoded(owner, here, "item_json", "encode_item", fields, *args)
                                             for fields in shared))
        parts = json_parts({"id": request_id, "model": self.settings.model_name}, entries,
                           {"usage": encoders.usage(results)})
        return PartsResponse(parts, "application/json", headers)

    def renders_here(self, fmt: str, nbytes: int) -> bool:
        return renders_here(self.engine.inflight, fmt, nbytes)

    async def encoded(self, owner: Owner, here: bool, fn: str, job: str,
                      *args: Any) -> bytes | memoryview | list[bytes]:
        """`jobs.<fn>(*args)` run here (its body, whole or in parts), or in a worker as `jobs.<job>`, which
        writes it to a segment."""
        if here:  # on a thread: the loop's own arena faulted a 3 MB body's pages in anew each time (3x slower)
            return await self.run_in_pool(getattr(jobs, fn), *args)
        name = self.engine.names.next("resp")
        try:
            length = await self.engine.workers.call(owner, f"service.workers.jobs:{job}", name, *args,
                                                    leaves=(name,), priority=0)
        except BaseException:
            shm.unlink(name)
            raise
        return take_segment(name, length)

    async def drain(self, timeout: float) -> bool:
        """SIGTERM: refuse new work, let admitted requests finish (True if all did in time)."""
        self.engine.begin_drain()
        done = await self.engine.wait_idle(timeout)
        if not done:
            log.warning("drain timed out after %.1fs with %d request(s) in flight", timeout, self.engine.inflight)
        return done


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


PARSE_HERE_BYTES = 128 << 10


def parses_here(nbytes: int) -> bool:
    """Whether a request body is parsed on the event loop rather than on a parse thread: up to
    PARSE_HERE_BYTES. A 448x448 JPEG's 75 KB body takes 20 us to parse and decode, where the round trip
    to a parse thread took 0.35 ms alone and 16-23 ms at 256 clients (H200 host): the thread holds the
    same GIL, so it adds hand-offs without adding a core. The bound keeps a hostile body's cost on the
    loop small: the worst found within 128 KiB (thousands of unknown fields or invalid items) takes
    15 ms to refuse on the 2-core dev box, where a parse thread would give the loop a turn every 5 ms."""
    return nbytes <= PARSE_HERE_BYTES


RENDER_HERE_BYTES = 4 << 20  # of embeddings: 1.4 ms as base64, 3.7 ms in vLLM's format (2-core dev box)


def renders_here(inflight: int, fmt: str, nbytes: int) -> bool:
    """Whether a response body is encoded in the server process rather than in a worker: when its request
    is the only one in flight, and the body is a copy of the embeddings (base64, vLLM's, safetensors) of
    at most RENDER_HERE_BYTES. Float lists are formatted number by number in Python (over 100 ms for one
    448x448 image): those always go to a worker, off the event loop's interpreter."""
    return inflight == 1 and fmt != "float" and nbytes <= RENDER_HERE_BYTES


def _result_fields(r: ItemResult, release: bool) -> dict[str, Any]:
    """What a worker needs of a result to encode it (picklable, no tensors); `release`: the encoder retires
    the output's segment once it has read it (`shm.retire`)."""
    return {"index": r.index, "modality": r.modality, "id": r.id, "grid_thw": list(r.grid_thw),
            "num_patches": r.num_patches, "num_tokens": r.num_tokens, "meta": r.meta, "output": r.output,
            "content_id": r.content_id, "uuid": r.uuid, "release": release}
