"""The API's errors: one JSON shape for every error status, `{"error": {"type", "message", "index", "code"}}`,
and the mapping from the engine's exceptions and from validation failures onto it."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from service.engine.types import (
    EngineDied,
    EngineFailure,
    ItemError,
    NotReady,
    Overloaded,
    RequestRejected,
)


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



def too_large(what: str, limit: int) -> ApiError:
    return ApiError(413, "payload_too_large", f"the body {what}: the limit is {limit} bytes (--max-payload-bytes)",
                    "payload_too_large")

