"""`GET /v1/encoder_cache/{id}`: an encoder output the LLM server fetches by the uuid a `vllm_ref` part gave it.

The body is the safetensors file the shared encoder-cache folder would hold for that id (one tensor
`ec_cache`, the rows in the served dtype, the same metadata), built from the encoder-output cache where the
output is held (`Handoff.encoder_cache_entry`), else the folder's file as it is (`--ec-shared-storage`).
`POST /v1/encoder_cache/check` answers which of a list of ids would be found, and holds those again: the
LLM server's scheduler asks it, off its loop, before it schedules the items (`service.handoff.ec_client`).
An unknown id is a 404, counted (`vitserve_encoder_cache_fetches_total{result="miss"}`): a miss means the
LLM server asked after the output left the cache (raise --cache-bytes or --cache-hold-s). The API key
applies. With several fronts, an id another front answered is asked of its siblings over their Unix sockets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.types import Receive, Scope, Send

from service import shm
from service.handoff.ec_storage import id_problem
from service.http.errors import ApiError
from service.http.fronts import SIBLING_TIMEOUT_S, FrontRole
from service.http.responses import PartsResponse

if TYPE_CHECKING:
    from service.http.service import Service

SAFETENSORS = "application/vnd.safetensors"


class CheckRequest(BaseModel):
    ids: list[str] = Field(max_length=4096, description="uuids of vllm_ref parts")


class CheckResponse(BaseModel):
    present: list[bool] = Field(description="per id: GET /v1/encoder_cache/{id} would find it (it is now held)")


class PinnedResponse(PartsResponse):
    """A body sent from a cached output's segment: `done` unpins the entry once the body is sent, or the
    client went away meanwhile."""

    def __init__(self, parts: list[Any], media_type: str, headers: dict[str, str],
                 done: Callable[[], None] | None = None) -> None:
        super().__init__(parts, media_type, headers)
        self.done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.done is not None:
                self.done()


def install(app: FastAPI, service: Service, front: FrontRole | None) -> None:
    @app.post("/v1/encoder_cache/check", response_model=CheckResponse,
              summary="Which ids GET /v1/encoder_cache/{id} would find")
    async def check(body: CheckRequest, request: Request, scope: str = "server") -> Response:
        try:
            service.check_auth(request)
        except ApiError as exc:
            return exc.response()
        if service.peers is not None:
            service.peers.fetched()
        present = [service.handoff.holds(i) for i in body.ids]
        missing = [i for i, p in zip(body.ids, present) if not p]
        if missing and front is not None and front.count > 1 and scope != "front":
            found = await sibling_check(front, missing, request.headers.get("authorization"))
            present = [p or i in found for i, p in zip(body.ids, present)]
        return JSONResponse({"present": present})

    @app.get("/v1/encoder_cache/{item_id}", summary="An encoder output by its uuid, as a safetensors file",
             response_class=Response, responses={
                 200: {"content": {SAFETENSORS: {"schema": {"type": "string", "format": "binary"}}},
                       "description": "one tensor, ec_cache: [tokens, hidden x (1 + DeepStack levels)]"},
                 401: {"description": "API key missing or wrong"},
                 404: {"description": "no output under this id (never made, or evicted)"}})
    async def encoder_cache(item_id: str, request: Request, scope: str = "server") -> Response:
        started = time.perf_counter()
        if service.peers is not None:
            service.peers.fetched()
        try:
            service.check_auth(request)
            parts, done = await local_body(service, item_id)
            if parts is None and front is not None and front.count > 1 and scope != "front":
                body = await sibling_body(front, item_id, request.headers.get("authorization"))
                parts = None if body is None else [body]
            if scope != "front":
                service.handoff.count_fetch(parts is not None)
            if parts is None:
                raise ApiError(404, "not_found", f"no encoder output under id {item_id!r}: never made here, or "
                                                 "evicted before it was fetched (--cache-bytes, --cache-hold-s)",
                               "unknown_id")
            response: Response = PinnedResponse(parts, SAFETENSORS, {}, done=done)
        except ApiError as exc:
            response = exc.response()
        response.headers["server-timing"] = f"encoder_cache;dur={(time.perf_counter() - started) * 1000:.3f}"
        return response


async def local_body(service: Service, item_id: str) -> tuple[list[Any] | None, Callable[[], None] | None]:
    """(the body's parts, what to call once they are sent), or (None, None). A cached output is sent from
    its segment, mapped (no copy here; large bodies go to the socket from a writer thread), and stays
    pinned in the cache until the response is sent."""
    if id_problem(item_id):
        return None, None
    handoff = service.handoff
    model = service.engine.model
    found = handoff.encoder_cache_entry(item_id) if model is not None else None
    if found is not None:
        cid, entry = found
        try:
            head = handoff.file_head(item_id, cid, entry, handoff.identity(model), model)  # type: ignore[arg-type]
            rows = memoryview(shm.open_segment(entry.output.segment))[:entry.output.nbytes] if entry.output.nbytes \
                else memoryview(b"")
        except BaseException:
            handoff.release_entry(entry)
            raise
        return [head, rows], lambda: handoff.release_entry(entry)
    if handoff.storage is not None:
        body = await service.run_in_pool(handoff.stored_file, item_id)
        return (None, None) if body is None else ([body], None)
    return None, None


async def sibling_body(front: FrontRole, item_id: str, authorization: str | None) -> bytes | None:
    import asyncio

    import httpx

    headers = {"authorization": authorization} if authorization else {}

    async def one(socket_path: str) -> bytes | None:
        try:
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path),
                                         timeout=SIBLING_TIMEOUT_S) as client:
                r = await client.get(f"http://front/v1/encoder_cache/{item_id}", params={"scope": "front"},
                                     headers=headers)
        except (httpx.HTTPError, OSError):
            return None
        return r.content if r.status_code == 200 else None

    for body in await asyncio.gather(*(one(path) for _, path in front.siblings)):
        if body is not None:
            return body
    return None


async def sibling_check(front: FrontRole, ids: list[str], authorization: str | None) -> set[str]:
    import asyncio

    import httpx

    headers = {"authorization": authorization} if authorization else {}

    async def one(socket_path: str) -> set[str]:
        try:
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path),
                                         timeout=SIBLING_TIMEOUT_S) as client:
                r = await client.post("http://front/v1/encoder_cache/check", params={"scope": "front"},
                                      json={"ids": ids}, headers=headers)
            return {i for i, p in zip(ids, r.json()["present"]) if p} if r.status_code == 200 else set()
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            return set()

    found: set[str] = set()
    for some in await asyncio.gather(*(one(path) for _, path in front.siblings)):
        found |= some
    return found
