"""Sidecar features: media URLs from an allow-list (loopback HTTP server) and vLLM's shared-storage
encoder cache (`--ec-shared-storage`)."""

from __future__ import annotations

import base64
import io
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open

from service.handoff.ec_storage import FILE_NAME, TENSOR_KEY
from tests.http_helpers import (
    QuietHandler,
    ServerThread,
    b64,
    image_bytes,
    loopback_http_server,
    server_url,
    settings,
)
from tests.videos import make_video

IMAGE = image_bytes(160, 120, seed=11)
VIDEO = make_video(6, fps=3, width=64, height=48)
LIMIT = 256 * 1024
DRIPS_CLOSED: list[float] = []  # when the server closed a /drip connection


class MediaHandler(QuietHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/img.png":
            self.reply(200, IMAGE)
        elif self.path == "/clip.mp4":
            self.reply(200, VIDEO)
        elif self.path == "/big":
            self.reply(200, b"\x89PNG\r\n\x1a\n" + b"\x00" * (LIMIT + 10))
        elif self.path == "/big-chunked":  # no Content-Length: the cap applies while reading
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(40):
                chunk = b"\x00" * 8192
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/img.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/slow":
            time.sleep(2.5)
            self.reply(200, IMAGE)
        elif self.path == "/drip":  # a byte at a time, never finishing: only a deadline ends the fetch
            self.send_response(200)
            self.send_header("Content-Length", str(len(IMAGE)))
            self.end_headers()
            try:
                for byte in IMAGE:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.1)
            except ConnectionError:
                DRIPS_CLOSED.append(time.monotonic())
        else:
            self.reply(404, b"missing")



@pytest.fixture(scope="module")
def media_url():
    with loopback_http_server(MediaHandler) as httpd:
        yield server_url(httpd)


@pytest.fixture(scope="module")
def url_server():
    cfg = settings(allow_url=True, allowed_hosts="127.0.0.1", url_timeout_s=1, max_payload_bytes=LIMIT)
    with ServerThread(cfg) as srv:
        yield srv


def test_urls_from_allowed_hosts(url_server, media_url):
    with url_server.client() as c:
        by_url = c.post("/encode", json={"items": [{"type": "image", "image": media_url + "/img.png"},
                                                   {"type": "video", "video": media_url + "/clip.mp4"}]})
        by_bytes = c.post("/encode", json={"items": [{"type": "image", "image": b64(IMAGE)},
                                                     {"type": "video", "video": b64(VIDEO)}]})
    assert by_url.status_code == 200, by_url.text
    assert by_url.json()["data"] == by_bytes.json()["data"]


@pytest.mark.parametrize("path,code", [
    ("/missing", "fetch_failed"),
    ("/redirect", "fetch_failed"),  # redirects are not followed (they could leave the allow-list)
    ("/big", "too_large"),
    ("/big-chunked", "too_large"),
    ("/slow", "fetch_timeout"),
])
def test_url_failures(url_server, media_url, path, code):
    with url_server.client() as c:
        r = c.post("/encode", json={"items": [{"type": "image", "image": b64(IMAGE)},
                                              {"type": "image", "image": media_url + path}]})
        assert r.status_code == 422
        assert (r.json()["error"]["code"], r.json()["error"]["index"]) == (code, 1)
        assert c.post("/encode", json={"items": [{"type": "image", "image": b64(IMAGE)}]}).status_code == 200


def test_slow_urls_hold_only_their_own_requests(url_server, media_url):
    """Four URLs that send a byte every 0.1 s, more than the server has worker threads or processes: each
    gets its 422 at the fetch deadline (1 s) and its connection closed, while other requests are served."""
    DRIPS_CLOSED.clear()
    slow = {"items": [{"type": "image", "image": media_url + "/drip"}]}
    with url_server.client() as c, ThreadPoolExecutor(4) as pool:
        started = time.monotonic()
        drips = [pool.submit(c.post, "/encode", json=slow) for _ in range(4)]
        time.sleep(0.2)
        while not all(d.done() for d in drips):
            t = time.monotonic()
            assert c.post("/encode", json={"items": [{"type": "image", "image": b64(IMAGE)}]}).status_code == 200
            assert time.monotonic() - t < 1.0
        answered = time.monotonic()
        for d in drips:
            r = d.result()
            assert r.status_code == 422 and r.json()["error"]["code"] == "fetch_timeout"
    assert answered - started < 2.5
    deadline = time.monotonic() + 2
    while len(DRIPS_CLOSED) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(DRIPS_CLOSED) == 4  # the fetches stopped: nothing keeps reading from the slow host
    assert max(DRIPS_CLOSED) - started < 3.0


@pytest.mark.parametrize("url", [
    "http://localhost:{port}/img.png",  # same machine, but not the listed host name
    "http://127.0.0.2:{port}/img.png",
    "ftp://127.0.0.1/img.png",
    "file:///etc/hostname",
])
def test_urls_outside_the_allow_list(url_server, media_url, url):
    port = media_url.rsplit(":", 1)[1]
    with url_server.client() as c:
        r = c.post("/encode", json={"items": [{"type": "image", "image": url.format(port=port)}]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "url_not_allowed"


def read_ec(path) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as f:
        assert list(f.keys()) == [TENSOR_KEY]
        return f.get_tensor(TENSOR_KEY)


def test_ec_shared_storage(tmp_path):
    store = tmp_path / "ec"
    cfg = settings(model="tiny-qwen3-vl", ec_shared_storage=str(store))
    items = [{"type": "image", "image": b64(IMAGE), "id": "img-a"},
             {"type": "image", "image": b64(image_bytes(96, 96, seed=2))}]
    with ServerThread(cfg) as srv, srv.client() as c:
        r = c.post("/encode", json={"items": items, "include_deepstack": True, "encoding_format": "base64"})
        assert r.status_code == 200, r.text
        entry = r.json()["data"][0]
        # The vLLM layout: <root>/<id>/encoder_cache.safetensors holding `ec_cache`.
        path = store / "img-a" / FILE_NAME
        ec = read_ec(path)
        parts = [entry["embedding"], *entry["deepstack"]]
        want = torch.cat([torch.frombuffer(bytearray(base64.b64decode(p)), dtype=torch.float32)
                          .reshape(entry["shape"]) for p in parts], dim=-1)
        assert ec.dtype == torch.float32 and ec.shape == (entry["num_tokens"], 80 * 3)
        assert torch.equal(ec, want)
        assert sorted(p.name for p in store.iterdir()) == ["img-a"]  # no folder for the item without id
        assert [p.name for p in (store / "img-a").iterdir()] == [FILE_NAME]  # no temp file left behind

        # Same id again, other image, bf16 response: the file is replaced and stays in the served dtype.
        r = c.post("/encode", json={"items": [{"type": "image", "image": b64(image_bytes(64, 64)), "id": "img-a"}],
                                    "dtype": "bfloat16", "encoding_format": "vllm"})
        assert r.status_code == 200
        part = r.json()["data"][0]["content_part"]
        assert part["uuid"] == "img-a"
        joined = torch.load(io.BytesIO(base64.b64decode(part["image_embeds"]["image_embeds"])), weights_only=True)
        ec = read_ec(path)
        assert ec.dtype == torch.float32 and ec.shape == joined.shape
        torch.testing.assert_close(ec.to(torch.bfloat16), joined)

        for bad in ("../escape", "a/b", "..", ".hidden", "x" * 201):
            r = c.post("/encode", json={"items": [{"type": "image", "image": b64(IMAGE), "id": bad}]})
            assert r.status_code == 422 and r.json()["error"]["index"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ec"]
