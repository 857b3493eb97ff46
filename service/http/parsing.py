"""Request bodies -> items: JSON and multipart/form-data parsing, media fields decoded to bytes. Runs on the
front's event loop for bodies up to `app.PARSE_HERE_BYTES`, on a parse thread above; never touches the
filesystem."""

from __future__ import annotations

import binascii
import json
import re
from dataclasses import dataclass, field
from typing import Any

import pybase64
from pydantic import ValidationError
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from service.engine.types import MediaItem
from service.http.errors import ApiError, item_error, validation_error, video_option_on_image
from service.http.schemas import (
    VIDEO_ONLY,
    EncodeRequest,
    FileOptions,
    ImageItem,
    MultipartOptions,
    OutputOptions,
)
from service.media.sniff import sniff_modality
from service.settings import ServeSettings

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_WHITESPACE = str.maketrans("", "", " \t\r\n")
_PATH_START = re.compile(r"^(?:/|~[/\\]|\.{1,2}[/\\]|[A-Za-z]:[/\\])")
_NOT_BASE64 = re.compile(r"[^A-Za-z0-9+/=]")


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
        hint = " (it looks like a file path: the server never reads local files, send the bytes)"
        raise item_error(index, "not valid base64 nor a data URL" + (hint if looks_like_path(value) else ""),
                         "invalid_base64") from None


def looks_like_path(value: str) -> bool:
    """Whether a value that failed to decode as base64 was meant as a local file path.

    A path starts like one ('/', '~/', './', '../', 'C:\\' or 'C:/'), is one short line, and holds a character
    base64 never does (a dot before an extension, '-', '_', '~', a space, a backslash). Base64 can start with '/'
    too: every JPEG's starts with '/9j/' (its FF D8 FF magic), so a broken JPEG upload is not taken for a path.
    """
    if len(value) > 1024 or "\n" in value or "\r" in value or value.startswith("/9j/"):
        return False
    return bool(_PATH_START.match(value)) and bool(_NOT_BASE64.search(value))


def lean_errors(exc: ValidationError) -> list[Any]:
    """A validation failure's errors without their inputs and contexts, which the error response does not
    use: a body of many unknown fields has one error each, and building them in full took 4.6 us each
    (138 ms for 30,000 in a 476 KiB body), 0.8 us this way (2-core dev box)."""
    return exc.errors(include_url=False, include_context=False, include_input=False)


def parse_json_request(body: bytes, settings: ServeSettings) -> Parsed:
    try:
        req = EncodeRequest.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(lean_errors(exc), tagged=True) from None
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


def check_video_options(raw: bytes, modalities: list[str | None]) -> None:
    """Video-only options given for a file that is an image: refused before the options' own validation,
    as the JSON path refuses them for an image item (an image item has no such fields)."""
    try:
        entries = json.loads(raw).get("items")
    except (ValueError, AttributeError):
        return  # not a JSON object: the validation that follows says how
    if not isinstance(entries, list):
        return
    for i, (entry, modality) in enumerate(zip(entries, modalities)):
        if modality == "image" and isinstance(entry, dict) and set(entry) & set(VIDEO_ONLY):
            raise video_option_on_image(i, sorted(set(entry) & set(VIDEO_ONLY)))


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
    raw = bytes(raw_options[0].data) if raw_options else b"{}"
    datas = [bytes(part.data) for part in files]
    modalities = [sniff_modality(data) if data else None for data in datas]
    check_video_options(raw, modalities)
    try:
        options = MultipartOptions.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(lean_errors(exc), where="options") from None
    per_file = options.items or [FileOptions() for _ in files]
    if len(per_file) != len(files):
        raise ApiError(422, "invalid_request", f"options.items has {len(per_file)} entries for {len(files)} files",
                       "invalid_value")
    items = []
    for i, (data, modality, opts) in enumerate(zip(datas, modalities, per_file)):
        if modality is None:
            raise item_error(i, "the file is empty", "empty")
        values = opts.model_dump(exclude={"id"}, exclude_none=True)
        items.append(Pending(i, modality, data, None, values, opts.id))
    check_ids(items)
    return Parsed(items, OutputOptions(encoding_format=options.encoding_format, dtype=options.dtype,
                                       include_deepstack=options.include_deepstack))

