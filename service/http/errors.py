"""The API's errors: one JSON shape for every error status, `{"error": {"type", "message", "index", "code"}}`,
and the mapping from the engine's exceptions and from validation failures (JSON bodies, multipart
options, FastAPI's own) onto it.

A 4xx is for what the client can change. Anything else is the server's (5xx) and carries an `error_id`
that one log line at WARNING or above also carries (`server_fault`): an operator finds what happened
from the id a client reports."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse

from service.engine.types import (
    EngineDied,
    EngineFailure,
    ItemError,
    NotReady,
    Overloaded,
    RequestRejected,
    StorageFull,
    WorkerLost,
    new_error_id,
)
from service.http.schemas import VIDEO_ONLY

log = logging.getLogger("vitserve.http")


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


def server_fault(error: ApiError, logged: bool = False) -> ApiError:
    """`error` (a 5xx) with an error id, and one WARNING line that carries it unless a line with the id
    was `logged` where the fault happened (an engine's or a worker's traceback)."""
    if error.error_id is None:
        error.error_id = new_error_id()
    if not logged:
        log.warning("answered %d %s (%s), error id %s: %s", error.status, error.type, error.code, error.error_id,
                    error.message)
    return error


class ClientGone(Exception):
    """The client disconnected while its items were queued or running."""


def item_error(index: int, message: str, code: str, status: int = 422) -> ApiError:
    """`invalid_item`: 422, or 413 where the item needs more work than the server allows; the message names
    the item, as `index` does."""
    return ApiError(status, "invalid_item", f"item {index}: {message}", code, index)


def from_engine(exc: Exception) -> ApiError:
    if isinstance(exc, ItemError):
        return item_error(exc.index, exc.message, exc.code, exc.status)
    if isinstance(exc, StorageFull):
        return ApiError(507, "insufficient_storage", exc.message, exc.code, headers={"Retry-After": "5"})
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
    if isinstance(exc, WorkerLost):  # a fresh worker replaces it at once
        return ApiError(503, "unavailable", exc.message, exc.code, headers={"Retry-After": "1"})
    raise TypeError(exc)


# pydantic error types -> the API's codes; anything else is an invalid value.
_CODES = {"extra_forbidden": "unknown_field", "union_tag_invalid": "unsupported_type",
          "union_tag_not_found": "missing_field", "missing": "missing_field", "json_invalid": "invalid_json"}


def validation_error(errors: Sequence[Mapping[str, Any]], *, tagged: bool = False, where: str = "") -> ApiError:
    """The first problem of a validation failure (pydantic's, or FastAPI's RequestValidationError), in
    one shape whichever content type carried the request: a problem inside `items[i]` is item i's
    (`invalid_item`, `index` i, a message that starts with "item i"), anything else the request's
    (`invalid_request`). `tagged`: item locations carry the union's tag (image/video) after the index,
    as JSON requests' do; `where` prefixes request-level locations (multipart: "options")."""
    err = errors[0]
    loc = [p for p in err["loc"] if p != "body"]  # FastAPI puts the body's errors under "body"
    message = str(err["msg"]).removeprefix("Value error, ")
    code = _CODES.get(err["type"], "invalid_value")
    if len(loc) >= 2 and loc[0] == "items" and isinstance(loc[1], int):
        index, tag, rest = loc[1], None, loc[2:]
        if tagged and rest:
            tag, rest = rest[0], rest[1:]
        field = ".".join(str(p) for p in rest)
        if err["type"] == "extra_forbidden" and tag == "image" and field in VIDEO_ONLY:
            same_item = [e["loc"][-1] for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == len(loc)
                         and list(e["loc"][:3]) == list(err["loc"][:3]) and e["loc"][-1] in VIDEO_ONLY]
            return video_option_on_image(index, same_item)
        if err["type"] == "union_tag_not_found":
            field, message = "type", "required: image or video"
        return item_error(index, f"{field + ': ' if field else ''}{message}", code)
    path = ".".join(str(p) for p in ([where] if where else []) + loc) or "body"
    return ApiError(422, "invalid_request", f"{path}: {message}", code)


def video_option_on_image(index: int, names: Sequence[str]) -> ApiError:
    verb = "applies" if len(names) == 1 else "apply"
    return item_error(index, f"{', '.join(sorted(names))} {verb} only to videos, and this item is an image",
                      "invalid_option")


def too_large(what: str, limit: int) -> ApiError:
    return ApiError(413, "payload_too_large", f"the body {what}: the limit is {limit} bytes (--max-payload-bytes)",
                    "payload_too_large")


class FaultBarrier:
    """ASGI middleware: an exception that escapes a route before its response started becomes a 500 in the
    API's error shape, with an error id that the one log line (with the traceback) carries too. Without
    it a bug outside /encode (whose service answers its own faults) reached the client as a bare
    "Internal Server Error" and the log as a traceback without an id."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception:
            if started:  # part of the response went: the connection is all that can be closed
                raise
            error_id = new_error_id()
            log.exception("%s %s failed, error id %s", scope.get("method"), scope.get("path"), error_id)
            error = ApiError(500, "internal", f"internal error {error_id}", "internal", error_id=error_id)
            await error.response()(scope, receive, send)
