"""Bad input over HTTP: every case gets its documented status and the one JSON error shape, and the
server keeps answering a good request correctly after each."""

from __future__ import annotations

import json
import socket
import struct
import zlib
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.http_helpers import ServerThread, b64, image_bytes, settings
from tests.videos import make_video

LIMIT = 256 * 1024
GOOD = image_bytes(120, 90, seed=1)
JPEG = image_bytes(64, 64, seed=2, fmt="JPEG")
VIDEO = make_video(4, fps=4, width=64, height=48)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


# A valid PNG whose header claims 100000 x 100000 pixels.
GIANT = (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0))
         + png_chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + png_chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def server():
    with ServerThread(settings(max_payload_bytes=LIMIT, max_items_per_request=4)) as srv:
        yield srv


@pytest.fixture(scope="module")
def baseline(server):
    with server.client() as c:
        r = c.post("/encode", json=good_request())
    assert r.status_code == 200
    return r.json()["data"][0]["embedding"]


def good_request() -> dict[str, Any]:
    return {"items": [{"type": "image", "image": b64(GOOD)}]}


def one(**item: Any) -> dict[str, Any]:
    return {"items": [{"type": "image", "image": b64(GOOD), **item}]}


def post_json(body: Any) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.post("/encode", json=body)


def post_raw(content: bytes, ctype: str = "application/json") -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.post("/encode", content=content, headers={"content-type": ctype})


def post_files(files: list, data: dict | None = None) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.post("/encode", files=files, data=data or {})


# (name, call, status, error type, code, index)
CASES = [
    ("corrupt image", post_json({"items": [{"type": "image", "image": b64(b"\x89PNG\r\n\x1a\n" + b"\x00" * 200)}]}),
     422, "invalid_item", "corrupt_image", 0),
    ("truncated jpeg", post_json({"items": [{"type": "image", "image": b64(GOOD)},
                                            {"type": "image", "image": b64(JPEG[: len(JPEG) // 2])}]}),
     422, "invalid_item", "corrupt_image", 1),
    ("empty media", post_json({"items": [{"type": "image", "image": ""}]}), 422, "invalid_item", "empty", 0),
    ("giant dimensions", post_json({"items": [{"type": "image", "image": b64(GIANT)}]}),
     413, "invalid_item", "too_large", 0),
    ("bad base64", post_json({"items": [{"type": "image", "image": "@@not base64@@"}]}),
     422, "invalid_item", "invalid_base64", 0),
    ("local path", post_json({"items": [{"type": "image", "image": "./photo.jpg"}]}),
     422, "invalid_item", "invalid_base64", 0),
    # Valid base64 by accident: decoded, never opened as a path.
    ("absolute path", post_json({"items": [{"type": "image", "image": "/etc/passwd"}]}),
     422, "invalid_item", "unsupported_format", 0),
    ("file url", post_json({"items": [{"type": "image", "image": "file:///etc/passwd"}]}),
     422, "invalid_item", "url_not_allowed", 0),
    ("http url while disabled", post_json({"items": [{"type": "image", "image": "http://127.0.0.1/a.png"}]}),
     422, "invalid_item", "url_not_allowed", 0),
    ("unsupported type", post_json({"items": [{"type": "image", "image": b64(GOOD)}, {"type": "audio", "audio": "x"}]}),
     422, "invalid_item", "unsupported_type", 1),
    ("video bytes as image", post_json({"items": [{"type": "image", "image": b64(VIDEO)}]}),
     422, "invalid_item", "unsupported_format", 0),
    ("image bytes as video", post_json({"items": [{"type": "video", "video": b64(JPEG)}]}),
     422, "invalid_item", "unsupported_format", 0),
    ("data url of the wrong kind",
     post_json({"items": [{"type": "image", "image": "data:video/mp4;base64," + b64(VIDEO)}]}),
     422, "invalid_item", "type_mismatch", 0),
    ("negative max_pixels", post_json(one(max_pixels=-5)), 422, "invalid_item", "invalid_value", 0),
    ("min above max pixels", post_json(one(min_pixels=10**6, max_pixels=10**4)),
     422, "invalid_item", "invalid_value", 0),
    ("max_pixels above the server's", post_json(one(max_pixels=10**9)), 422, "invalid_item", "invalid_option", 0),
    ("video option on an image", post_json(one(fps=2)), 422, "invalid_item", "invalid_option", 0),
    ("fps and nframes", post_json({"items": [{"type": "video", "video": b64(VIDEO), "fps": 2, "nframes": 4}]}),
     422, "invalid_item", "invalid_value", 0),
    ("unknown item field", post_json(one(colour="red")), 422, "invalid_item", "unknown_field", 0),
    ("unknown top-level field", post_json({**good_request(), "stream": True}), 422, "invalid_request", "unknown_field",
     None),
    ("thousands of unknown fields", post_json({**good_request(), **{f"k{i}": i for i in range(8000)}}), 422,
     "invalid_request", "unknown_field", None),
    ("thousands of unknown item fields", post_json(one(fps=2, **{f"k{i}": i for i in range(8000)})), 422,
     "invalid_item", "invalid_option", 0),
    ("bad dtype", post_json({**good_request(), "dtype": "int8"}), 422, "invalid_request", "invalid_value", None),
    ("bad encoding_format", post_json({**good_request(), "encoding_format": "xml"}), 422, "invalid_request",
     "invalid_value", None),
    ("missing media", post_json({"items": [{"type": "image"}]}), 422, "invalid_item", "missing_field", 0),
    ("no items", post_json({"items": []}), 422, "invalid_request", "invalid_value", None),
    ("too many items", post_json({"items": [{"type": "image", "image": b64(GOOD)}] * 5}), 422, "invalid_request",
     "too_many_items", None),
    ("duplicate ids", post_json({"items": [{"type": "image", "image": b64(GOOD), "id": "x"}] * 2}),
     422, "invalid_item", "duplicate_id", 1),
    ("unsafe id", post_json(one(id="../../etc")), 422, "invalid_item", "invalid_value", 0),
    ("not json", post_raw(b"{not json"), 422, "invalid_request", "invalid_json", None),
    ("json array", post_raw(b"[1, 2]"), 422, "invalid_request", "invalid_value", None),
    ("wrong content type", post_raw(b"hello", "text/plain"), 415, "unsupported_media_type", "unsupported_media_type",
     None),
    ("oversize body", post_json({"items": [{"type": "image", "image": "A" * LIMIT}]}), 413, "payload_too_large",
     "payload_too_large", None),
    ("multipart without files", post_files([("options", (None, "{}"))]), 422, "invalid_request", "missing_field", None),
    ("multipart unknown field", post_files([("files", ("a", GOOD))], {"colour": "red"}), 422, "invalid_request",
     "unknown_field", None),
    ("multipart bad options", post_files([("files", ("a", GOOD))], {"options": "{bad"}), 422, "invalid_request",
     "invalid_json", None),
    ("multipart video option on image", post_files([("files", ("a", GOOD))],
                                                   {"options": json.dumps({"items": [{"fps": 2}]})}),
     422, "invalid_item", "invalid_option", 0),
    ("multipart options count", post_files([("files", ("a", GOOD))], {"options": json.dumps({"items": [{}, {}]})}),
     422, "invalid_request", "invalid_value", None),
    ("multipart empty file", post_files([("files", ("a", b""))]), 422, "invalid_item", "empty", 0),
    ("wrong method", lambda c: c.get("/encode"), 405, "method_not_allowed", "method_not_allowed", None),
    ("unknown path", lambda c: c.post("/nope", json={}), 404, "not_found", "not_found", None),
]


@pytest.mark.parametrize("name,call,status,kind,code,index", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server, baseline, name, call, status, kind, code, index):
    with server.client() as c:
        r = call(c)
        assert r.status_code == status, r.text
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert set(err) >= {"type", "message", "index", "code"}
        assert (err["type"], err["code"], err["index"]) == (kind, code, index), err
        assert err["message"]
        if kind == "invalid_item":
            assert err["message"].startswith(f"item {index}: "), err
        ok = c.post("/encode", json=good_request())  # the server still serves, and correctly
    assert ok.status_code == 200
    assert ok.json()["data"][0]["embedding"] == baseline


def test_413_by_declared_length_before_the_body(server):
    """A Content-Length over the limit is refused before any of the body is sent."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /encode HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n")
        answer = b""
        while b'"payload_too_large"' not in answer and (chunk := s.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413")
    assert b'"payload_too_large"' in answer


def test_413_while_streaming_a_chunked_body(server):
    def chunks():
        for _ in range(64):
            yield b"A" * 8192  # 512 KiB in all, no Content-Length

    with server.client() as c:
        r = c.post("/encode", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"


def test_metrics_count_statuses(server, baseline):
    with server.client() as c:
        text = c.get("/metrics").text
    assert 'vitserve_requests_total{status="422"}' in text
    assert 'vitserve_requests_total{status="200"}' in text


# The same problem sent as JSON and as multipart: (name, options per item, top-level keys, expected
# type, code, index). An item given as {} is a good image; "video": True makes it a good video.
SAME_PROBLEM = [
    ("negative max_pixels", [{}, {"max_pixels": -5}], None, "invalid_item", "invalid_value", 1),
    ("video option on an image", [{"fps": 2}], None, "invalid_item", "invalid_option", 0),
    ("unknown item field", [{}, {"colour": "red"}], None, "invalid_item", "unknown_field", 1),
    ("min above max pixels", [{"min_pixels": 10**6, "max_pixels": 10**4}], None, "invalid_item", "invalid_value", 0),
    ("unsafe id", [{"id": "../../etc"}], None, "invalid_item", "invalid_value", 0),
    ("duplicate ids", [{"id": "x"}, {"id": "x"}], None, "invalid_item", "duplicate_id", 1),
    ("video options on an image", [{}, {"fps": 1, "nframes": 4}], None, "invalid_item", "invalid_option", 1),
    ("fps and nframes on a video", [{}, {"video": True, "fps": 1, "nframes": 4}], None, "invalid_item",
     "invalid_value", 1),
    ("unknown top-level field", [{}], {"stream": True}, "invalid_request", "unknown_field", None),
    ("bad dtype", [{}], {"dtype": "int8"}, "invalid_request", "invalid_value", None),
    ("bad encoding_format", [{}], {"encoding_format": "xml"}, "invalid_request", "invalid_value", None),
]


def media(item: dict) -> tuple[str, bytes, dict]:
    options = {k: v for k, v in item.items() if k != "video"}
    return ("video", VIDEO, options) if item.get("video") else ("image", GOOD, options)


def as_json(items: list[dict], top: dict | None) -> Callable[[httpx.Client], httpx.Response]:
    body = [{"type": kind, kind: b64(data), **options} for kind, data, options in map(media, items)]
    return post_json({"items": body, **(top or {})})


def as_multipart(items: list[dict], top: dict | None) -> Callable[[httpx.Client], httpx.Response]:
    files = [("files", (f"f{i}", data)) for i, (_, data, _) in enumerate(map(media, items))]
    return post_files(files, {"options": json.dumps({**(top or {}), "items": [media(it)[2] for it in items]})})


@pytest.mark.parametrize("name,items,top,kind,code,index", SAME_PROBLEM, ids=[c[0] for c in SAME_PROBLEM])
def test_json_and_multipart_report_a_problem_alike(server, name, items, top, kind, code, index):
    with server.client() as c:
        answers = [call(items, top)(c) for call in (as_json, as_multipart)]
    for r in answers:
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"], err["index"]) == (kind, code, index), err
        if kind == "invalid_item":
            assert err["message"].startswith(f"item {index}: "), err
    json_msg, multipart_msg = (r.json()["error"]["message"] for r in answers)
    if kind == "invalid_item":  # the same words, whichever way the item came
        assert json_msg == multipart_msg


def test_invalid_json_is_reported_alike(server):
    with server.client() as c:
        raw = post_raw(b"{not json")(c)
        options = post_files([("files", ("a.png", GOOD))], {"options": "{not json"})(c)
    for r in (raw, options):
        assert r.status_code == 422
        err = r.json()["error"]
        assert (err["type"], err["code"], err["index"]) == ("invalid_request", "invalid_json", None)
