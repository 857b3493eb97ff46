"""The OpenAI-compatible front (`--llm-url`): chat requests with media go through vitserve to the LLM server.

`POST /v1/chat/completions` takes an OpenAI chat request. Its `image_url` and `video_url` parts (data URLs, or
http(s) URLs under --allow-url and --allowed-hosts) are encoded here, all of the request's in one batch (cache
hits included), and each is replaced by vLLM 0.33's metadata-only part (`vllm.reference_part`: the grid,
Qwen3-VL video's timestamps, and the item's content id as `uuid`). The LLM server, an encoder-cache consumer
(`service.handoff.vllm_connector`, or the shared folder), loads the tensors by that uuid. The rewritten
request goes to `<llm-url>/v1/chat/completions` and its answer comes back as it is: status, body, the headers
that describe it, and a `text/event-stream` chunk by chunk as the LLM server sends it. A request without media
is forwarded byte for byte. `GET /v1/models` is forwarded.

With `--replicas` or `--replicas-from`, each item is encoded on the replica its content id picks, the first
of the id's rendezvous order that answers (`service.http.peers`, the connector's order): this server's own
items in process, the others through their `/encode` with the content id as the item's id, so that N
replicas act as one cache.

Errors are OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`); an error the LLM server answered
is passed on with its own status and body. vitserve's --api-key applies to these routes, and the client's
Authorization header is forwarded to the LLM server unchanged (run it without a key behind this front, or
with the same one). A client that goes away stops the encode, or closes the LLM server's stream (vLLM then
aborts the generation).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from service.engine.types import ItemResult
from service.handoff.vllm import handed_off, reference_part
from service.http.errors import ApiError, ClientGone, server_fault
from service.http.parsing import Parsed, Pending, check_count, decode_media
from service.http.peers import ReplicaUnavailable
from service.http.schemas import OutputOptions

if TYPE_CHECKING:
    from service.http.service import Service

log = logging.getLogger("vitserve.openai")
MEDIA_PARTS = {"image_url": "image", "video_url": "video"}
# Not passed on either way: they describe one hop, or are set again for the next.
HOP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length", "date", "server"}
# Chat request fields under which vLLM hashes each uuid instead of looking it up (docs/sidecar.md).
HASHING_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")


def openai_error(status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, error_id: str | None = None) -> JSONResponse:
    """OpenAI's error shape; a server fault's id (logged with it) rides along as `error_id`."""
    error: dict[str, Any] = {"message": message, "type": type_, "param": param, "code": code}
    if error_id:
        error["error_id"] = error_id
    return JSONResponse({"error": error}, status_code=status, headers=headers)


class Slot:
    """One media part of the chat request: where it sits, and the item made from it."""

    def __init__(self, content: list[Any], position: int, where: str, pending: Pending) -> None:
        self.content, self.position, self.where, self.pending = content, position, where, pending


class Proxy:
    def __init__(self, service: Service) -> None:
        self.service = service
        settings = service.settings
        assert settings.llm_url
        self.llm_url = settings.llm_url.rstrip("/")
        # The LLM server takes as long as generation takes: no read deadline (the client's own applies).
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None), trust_env=False,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        service.closers.append(self.client.aclose)

    # ---- forwarding ----------------------------------------------------------------------------
    def forward_headers(self, request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        headers.setdefault("accept-encoding", "identity")  # httpx would ask for gzip the client did not
        return headers

    async def forward(self, request: Request, method: str, path: str, body: bytes | None = None,
                      extra: dict[str, str] | None = None) -> Response:
        """The LLM server's answer to the request, as it answered it."""
        req = self.client.build_request(method, self.llm_url + path, content=body,
                                        headers=self.forward_headers(request))
        try:
            upstream = await self.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            return openai_error(502, f"the LLM server at {self.llm_url} did not answer: {type(exc).__name__}: {exc}",
                                "bad_gateway", "llm_unreachable")
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        headers.update(extra or {})
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(relay(upstream), status_code=upstream.status_code, headers=headers)
        try:
            content = await upstream.aread()
        except httpx.HTTPError as exc:
            return openai_error(502, f"the LLM server's answer broke off: {exc}", "bad_gateway", "llm_broken")
        finally:
            await upstream.aclose()
        return Response(content, status_code=upstream.status_code, headers=headers)

    # ---- the chat request ------------------------------------------------------------------------
    def slots(self, chat: dict[str, Any], out: list[Slot]) -> None:
        """The media parts of every message, in order, as items (bytes or URLs still to fetch), into `out`
        (an error's index names the part being read)."""
        messages = chat.get("messages")
        if not isinstance(messages, list):
            return
        for m, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                continue
            for k, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in MEDIA_PARTS:
                    continue
                kind = part["type"]
                where = f"messages[{m}].content[{k}].{kind}"
                value = part.get(kind)
                url = value.get("url") if isinstance(value, dict) else value
                slot = Slot(content, k, where, Pending(len(out), MEDIA_PARTS[kind], None))
                out.append(slot)
                if not isinstance(url, str) or not url:
                    raise ApiError(400, "invalid_request_error", f"{where}: an object with a url is required",
                                   "invalid_media_part", index=slot.pending.index)
                slot.pending.data, slot.pending.url = decode_media(url, slot.pending.index, slot.pending.modality,
                                                                   self.service.settings.allow_url)

    async def encode(self, request: Request, slots: list[Slot]) -> tuple[list[dict[str, Any]], int]:
        """Each slot's reference part, and how many were cache hits."""
        service = self.service
        check_count(len(slots), service.settings)
        engine = service.engine
        engine.check_accepting()
        model = engine.model
        assert model is not None  # accepting: loaded
        pendings = [s.pending for s in slots]
        with engine.request_slot():
            owner = engine.new_request()
            try:
                async with asyncio.timeout(service.settings.request_timeout_s):
                    await service.resolve_urls(Parsed(pendings, OutputOptions(encoding_format="vllm_ref")))
                    items = [p.media() for p in pendings]
                    peers = service.peers
                    cids = await service.handoff.content_ids(items, model, service.run_in_pool) if peers else []
                    tried: list[set[str]] = [set() for _ in items]  # peers that did not answer, per item
                    parts: list[dict[str, Any] | None] = [None] * len(items)
                    hits = 0

                    async def local(indices: list[int]) -> None:
                        nonlocal hits
                        results: list[ItemResult] = await service.handoff.encode(
                            [items[i] for i in indices], "vllm_ref", model, lambda todo: engine.encode(todo, owner),
                            service.run_in_pool)
                        try:
                            for i, r in zip(indices, results):
                                assert r.uuid is not None
                                parts[i] = reference_part(r.modality, r.grid_thw, r.meta, r.uuid, engine.family,
                                                          model.processor.temporal_patch_size, i)
                                hits += r.cached
                        finally:
                            service.handoff.release(results)
                        if peers:
                            cached = sum(r.cached for r in results)
                            peers.count(here=cached, encoded=len(results) - cached)

                    async def remote(url: str, indices: list[int]) -> None:
                        nonlocal hits
                        assert peers is not None
                        for i in indices:
                            items[i].id = cids[i]  # the remote names the output by this id: the one vLLM asks for
                        try:
                            got, cached = await peers.encode(url, [items[i] for i in indices],
                                                             request.headers.get("authorization"))
                        except ReplicaUnavailable as exc:
                            peers.mark_down(url, str(exc), len(indices))
                            for i in indices:
                                tried[i].add(url)
                            await place(indices)
                            return
                        hits += cached
                        for i, part in zip(indices, got):
                            parts[i] = part

                    async def place(indices: list[int]) -> None:
                        """Each item to the replica its id picks (None: here), in one call per replica."""
                        groups: dict[str | None, list[int]] = {}
                        for i in indices:
                            groups.setdefault(peers.place(cids[i], tried[i]) if peers else None, []).append(i)
                        await asyncio.gather(*(local(ix) if url is None else remote(url, ix)
                                               for url, ix in groups.items()))

                    await place(list(range(len(items))))
            except BaseException:
                engine.cancel(owner)
                raise
        return parts, hits  # type: ignore[return-value]

    async def chat(self, request: Request) -> Response:
        service = self.service
        started = time.perf_counter()
        slots: list[Slot] = []
        try:
            service.check_auth(request)
            body = await service.read_body(request)
            try:
                chat = json.loads(body)
            except ValueError as exc:
                raise ApiError(400, "invalid_request_error", f"the body is not JSON: {exc}", "invalid_json") from None
            if isinstance(chat, dict):
                self.slots(chat, slots)
            if not slots:
                return await self.forward(request, "POST", "/v1/chat/completions", body)
            for name in HASHING_FIELDS:
                if chat.get(name):
                    raise ApiError(400, "invalid_request_error", f"{name} is set: vLLM then hashes each uuid instead "
                                   "of looking it up, so the encoder cache would miss; drop it", "unsupported_field")
            parts, hits = await service.until_gone(request, self.encode(request, slots))
        except ClientGone as exc:
            log.info("client went away %s (counted as 499)", exc)
            return Response(status_code=499)
        except Exception as exc:  # vitserve's errors, in OpenAI's shape
            error, logged = service.api_error(exc)
            if error.status >= 500:
                server_fault(error, logged)
            param = slots[error.index].where if error.index is not None and error.index < len(slots) else None
            return openai_error(error.status, error.message, error.type, error.code, param, error.headers,
                                error.error_id)
        for slot, part in zip(slots, parts):
            slot.content[slot.position] = handed_off(slot.content[slot.position], part)
        encoded_ms = (time.perf_counter() - started) * 1000
        extra = {"x-vitserve-cache-hits": str(hits), "server-timing": f"encode;dur={encoded_ms:.3f}"}
        return await self.forward(request, "POST", "/v1/chat/completions",
                                  json.dumps(chat, separators=(",", ":")).encode(), extra)


async def relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The LLM server's stream as it comes; closing it (the client went away) closes the upstream connection,
    which vLLM takes as an abort."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()


def install(app: FastAPI, service: Service) -> None:
    proxy = Proxy(service)
    app.state.openai_proxy = proxy

    @app.post("/v1/chat/completions", summary="OpenAI chat completions, media encoded here (--llm-url)",
              response_class=Response)
    async def chat(request: Request) -> Response:
        return await proxy.chat(request)

    @app.get("/v1/models", summary="The LLM server's models (--llm-url)", response_class=Response)
    async def models(request: Request) -> Response:
        try:
            service.check_auth(request)
        except ApiError as exc:
            return openai_error(exc.status, exc.message, exc.type, exc.code, None, exc.headers)
        return await proxy.forward(request, "GET", "/v1/models")

