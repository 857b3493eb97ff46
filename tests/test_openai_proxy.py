"""The OpenAI-compatible front (`--llm-url`) against a stub LLM server on loopback: answers pass through byte
for byte (JSON and SSE), the LLM server's errors are passed on, a request without media is forwarded
untouched, media parts become metadata-only parts whose outputs wait at GET /v1/encoder_cache/{uuid}, a
client gone mid-stream closes the upstream stream, and with replicas each item is encoded where its id
points."""

from __future__ import annotations

import base64
import json
import threading
import time
from typing import Any

import httpx
import pytest

from service.handoff.ec_client import Loader, Replicas, check_output, replica_for
from service.http.peers import Peers
from service.metrics import Metrics
from tests.http_helpers import QuietHandler, ServerThread, image_bytes, loopback_http_server, server_url, settings

PNG = image_bytes(96, 64, seed=71)
JPEG = image_bytes(160, 120, seed=72, fmt="JPEG")
ANSWER = b'{"id":"chatcmpl-1",  "object":"chat.completion","choices":[{"message":{"content":"a cat"}}]}'
MODELS = b'{"object":"list","data":[{"id":"qwen","object":"model"}]}'
ERROR = b'{"error":{"message":"max_tokens is too large","type":"BadRequestError","param":"max_tokens","code":400}}'
CHUNKS = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b'data: {"choices":[{"delta":{"content":" cat"}}]}\n\n',
          b"data: [DONE]\n\n"]


class Stub(QuietHandler):
    """The LLM server: records what reaches it; answers JSON, SSE, errors, or a long stream."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.server.seen.append(("GET", self.path, {k.lower(): v for k, v in self.headers.items()}, b""))  # type: ignore[attr-defined]
        self.reply(200, MODELS, "application/json")

    def do_POST(self) -> None:  # noqa: N802
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.seen.append(("POST", self.path, {k.lower(): v for k, v in self.headers.items()}, raw))  # type: ignore[attr-defined]
        body = json.loads(raw)
        if body.get("max_tokens", 0) > 1000:
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(ERROR)))
            self.send_header("x-upstream", "yes")
            self.end_headers()
            self.wfile.write(ERROR)
            return
        if not body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(ANSWER)))
            self.send_header("x-upstream", "yes")
            self.end_headers()
            self.wfile.write(ANSWER)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        chunks = CHUNKS if body.get("n", 1) == 1 else [b"data: {}\n\n"] * 400
        sent = 0
        try:
            for chunk in chunks:
                self.wfile.write(chunk)
                self.wfile.flush()
                sent += 1
                time.sleep(0.001 if len(chunks) < 10 else 0.02)
        except OSError:
            self.server.aborted.append(sent)  # type: ignore[attr-defined]
            self.server.gone.set()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def stack():
    with loopback_http_server(Stub) as llm:
        llm.seen, llm.aborted, llm.gone = [], [], threading.Event()  # type: ignore[attr-defined]
        cfg = settings(model="tiny-qwen3-vl", cache_bytes=32 << 20, llm_url=server_url(llm))
        with ServerThread(cfg) as srv:
            srv.llm = llm  # type: ignore[attr-defined]
            yield srv


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "qwen", "messages": [{"role": "user", "content": [{"type": "text", "text": "What?"}, *parts]}],
            **extra}


def image_part(data: bytes, mime: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}


def last(srv: Any) -> tuple[str, str, dict[str, str], bytes]:
    return srv.llm.seen[-1]


def test_a_request_without_media_passes_through_untouched(stack):
    raw = b'{"model": "qwen",\n "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}'
    with stack.client() as c:
        r = c.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json",
                                                                 "Authorization": "Bearer llm-key"})
    assert r.status_code == 200 and r.content == ANSWER and r.headers["x-upstream"] == "yes"
    method, path, headers, body = last(stack)
    assert (method, path, body) == ("POST", "/v1/chat/completions", raw)
    assert headers["authorization"] == "Bearer llm-key"


def test_several_images_in_one_message_become_reference_parts(stack):
    with stack.client() as c:
        r = c.post("/v1/chat/completions", json=chat(image_part(PNG), image_part(JPEG, "image/jpeg"),
                                                     {"type": "text", "text": "and?"}))
        assert r.status_code == 200 and r.content == ANSWER, r.text
        forwarded = json.loads(last(stack)[3])
        content = forwarded["messages"][0]["content"]
        assert [p["type"] for p in content] == ["text", "image_embeds", "image_embeds", "text"]
        for part in content[1:3]:
            assert set(part) == {"type", "image_embeds", "uuid"} and part["uuid"].startswith("vit-")
            t, h, w = part["image_embeds"]["image_grid_thw"]
            fetched = c.get(f"/v1/encoder_cache/{part['uuid']}")
            assert fetched.status_code == 200
        again = c.post("/v1/chat/completions", json=chat(image_part(PNG), image_part(JPEG, "image/jpeg")))
        assert again.headers["x-vitserve-cache-hits"] == "2"
        assert json.loads(last(stack)[3])["messages"][0]["content"][1:] == content[1:3]


def test_sse_passes_through_chunk_by_chunk(stack):
    with stack.client() as c, c.stream("POST", "/v1/chat/completions",
                                       json=chat(image_part(PNG), stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = b"".join(r.iter_raw())
    assert got == b"".join(CHUNKS)


def test_the_llm_servers_errors_and_ours_are_openai_errors(stack):
    with stack.client() as c:
        r = c.post("/v1/chat/completions", json=chat(image_part(PNG), max_tokens=5000))
        assert r.status_code == 400 and r.content == ERROR and r.headers["x-upstream"] == "yes"
        broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}
        bad = c.post("/v1/chat/completions", json=chat(image_part(PNG), broken))
        assert bad.status_code == 422
        err = bad.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == "messages[0].content[2].image_url"
        assert err["code"] == "invalid_base64"
        url = c.post("/v1/chat/completions", json=chat({"type": "image_url",
                                                        "image_url": {"url": "http://example.com/a.png"}}))
        assert url.status_code == 422 and url.json()["error"]["code"] == "url_not_allowed"
        hashed = c.post("/v1/chat/completions", json=chat(image_part(PNG), mm_processor_kwargs={"max_pixels": 1}))
        assert hashed.status_code == 400 and hashed.json()["error"]["code"] == "unsupported_field"
        models = c.get("/v1/models")
        assert models.status_code == 200 and models.content == MODELS


def test_an_llm_server_that_does_not_answer_is_a_502():
    with ServerThread(settings(llm_url="http://127.0.0.1:9", cache_bytes=1 << 20)) as srv, srv.client() as c:
        r = c.post("/v1/chat/completions", json=chat(image_part(PNG)))
    assert r.status_code == 502 and r.json()["error"]["code"] == "llm_unreachable"


def test_a_client_gone_mid_stream_closes_the_upstream_stream(stack):
    stack.llm.gone.clear()
    with stack.client() as c, c.stream("POST", "/v1/chat/completions",
                                       json=chat(image_part(PNG), stream=True, n=2)) as r:
        stream = r.iter_raw()
        next(stream)
    assert stack.llm.gone.wait(10), "the LLM server kept streaming to nobody"
    assert stack.llm.aborted[-1] < 400


def test_the_api_key_applies():
    with loopback_http_server(Stub) as llm:
        llm.seen = []  # type: ignore[attr-defined]
        with ServerThread(settings(llm_url=server_url(llm), api_key="k", cache_bytes=1 << 20)) as srv:
            assert httpx.post(srv.url + "/v1/chat/completions", json=chat()).status_code == 401
            assert httpx.get(srv.url + "/v1/models").status_code == 401
            ok = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer k"})
            assert ok.status_code == 200 and llm.seen[-1][2]["authorization"] == "Bearer k"


def test_replicas_act_as_one_cache():
    """Two servers, each item encoded on the replica its id picks: the connector's rule finds it there."""
    with loopback_http_server(Stub) as llm:
        llm.seen = []  # type: ignore[attr-defined]
        cfg = settings(model="tiny-qwen3-vl", llm_url=server_url(llm), cache_bytes=32 << 20)
        with ServerThread(cfg) as a, ServerThread(settings(model="tiny-qwen3-vl", cache_bytes=32 << 20)) as b:
            # The fixed list as --replicas and --advertise-url give it (the ports are known only now).
            ring = settings(model="tiny-qwen3-vl", replicas=[a.url, b.url], advertise_url=a.url)
            a.app.state.service.peers = Peers(ring, Metrics())
            # The replicas' ports are random, so which one an id picks is too: requests of six new images go
            # out until both replicas hold some (all on one side has odds of 1 in 32 a request).
            uuids: list[str] = []
            for round_ in range(6):
                images = [image_bytes(64 + 8 * k, 64, seed=80 + 10 * round_ + k) for k in range(6)]
                r = httpx.post(a.url + "/v1/chat/completions", json=chat(*(image_part(i) for i in images)),
                               timeout=60)
                assert r.status_code == 200, r.text
                uuids += [p["uuid"] for p in json.loads(llm.seen[-1][3])["messages"][0]["content"][1:]]
                owners = {replica_for([a.url, b.url], u) for u in uuids}
                if owners == {a.url, b.url}:
                    break
            assert owners == {a.url, b.url}, (uuids, a.url, b.url)  # both replicas hold some
            for u in uuids:
                home = replica_for([a.url, b.url], u)
                other = b.url if home == a.url else a.url
                assert httpx.get(f"{home}/v1/encoder_cache/{u}").status_code == 200, a.app.state.service.peers.info()
                assert httpx.get(f"{other}/v1/encoder_cache/{u}").status_code == 404
            # As the connector loads them: the same list, each id from its replica, each answer checked.
            loader = Loader(Replicas([b.url, a.url]), "cpu")
            for u in uuids:
                tensor, header = loader.load(u)
                check_output(u, header, tensor.shape[0])
                assert header["__metadata__"]["uuid"] == u
            assert loader.replicas.found == {"home": len(uuids), "elsewhere": 0, "missing": 0}
