"""The vLLM hand-off example (`service/handoff/sidecar.py`) end to end: a real vitserve on loopback, a fake vLLM
endpoint recording the chat request, the parts decoded exactly as vLLM decodes them."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from http.server import ThreadingHTTPServer
from typing import Any

import pytest
import torch
from safetensors import safe_open

from service.handoff import sidecar
from service.handoff.ec_storage import FILE_NAME, TENSOR_KEY
from tests.http_helpers import (
    ROOT,
    QuietHandler,
    ServerThread,
    image_bytes,
    loopback_http_server,
    server_url,
    settings,
)

IMAGES = [image_bytes(160, 120, seed=21, fmt="JPEG"), image_bytes(96, 96, seed=22, fmt="PNG")]
ANSWER = {"id": "chatcmpl-test", "object": "chat.completion",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "a test picture"}}]}
# (out_hidden_size, DeepStack layers) of the tiny presets.
DIMS = {"tiny-qwen2-vl": (96, 0), "tiny-qwen3-vl": (80, 2)}


class FakeVLLM(QuietHandler):
    """Records every POST (path, headers, JSON body) and answers like vLLM's chat endpoint."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, dict(self.headers), body))  # type: ignore[attr-defined]
        self.reply(200, json.dumps(ANSWER).encode(), "application/json")


@pytest.fixture(scope="module")
def vllm():
    with loopback_http_server(FakeVLLM) as httpd:
        httpd.requests = []  # type: ignore[attr-defined]
        yield httpd


@pytest.fixture(scope="module", params=list(DIMS))
def server(request, tmp_path_factory):
    store = tmp_path_factory.mktemp("ec")
    with ServerThread(settings(model=request.param, ec_shared_storage=str(store))) as srv:
        srv.store = store  # type: ignore[attr-defined]
        srv.model = request.param  # type: ignore[attr-defined]
        yield srv


def vllm_url(httpd: ThreadingHTTPServer) -> str:
    return server_url(httpd)


def last_chat(httpd: ThreadingHTTPServer) -> dict[str, Any]:
    path, _, body = httpd.requests[-1]  # type: ignore[attr-defined]
    assert path == "/v1/chat/completions"
    return body


def float_reference(srv: ServerThread, dtype: str) -> list[dict[str, Any]]:
    """The `float` format of the same images: embedding rows and DeepStack rows as numbers."""
    body = sidecar.encode_request(IMAGES, encoding_format="float", dtype=dtype)
    body["include_deepstack"] = True
    with srv.client() as c:
        r = c.post("/encode", json=body)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def joined(entry: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """Main embedding with the DeepStack layers after it along hidden: the layout vLLM takes."""
    return torch.cat([torch.tensor(m, dtype=torch.float64).to(dtype)
                      for m in [entry["embedding"], *entry["deepstack"]]], dim=-1)


def check_parts(parts: list[dict[str, Any]], reference: list[dict[str, Any]], model: str,
                dtype: torch.dtype) -> None:
    out_hidden, layers = DIMS[model]
    assert len(parts) == len(reference) == len(IMAGES)
    for part, ref in zip(parts, reference):
        assert part["type"] == "image_embeds" and set(part["image_embeds"]) == {"image_embeds", "image_grid_thw"}
        embeds, grid = sidecar.decode_content_part(part)
        # vLLM's Qwen2-VL field config: one item's grid, int64, shape [3]; tokens = t*h*w / merge^2.
        assert grid.dtype == torch.int64 and grid.shape == (3,)
        assert grid.tolist() == ref["grid_thw"]
        t, h, w = grid.tolist()
        assert embeds.dtype == dtype
        assert embeds.shape == (t * h * w // 4, out_hidden * (1 + layers))
        assert torch.equal(embeds, joined(ref, dtype))


def test_example_end_to_end(server, vllm, tmp_path):
    """`python -m service.handoff.sidecar` as a user runs it: both POSTs, vLLM's answer on stdout."""
    paths = []
    for i, data in enumerate(IMAGES):
        paths.append(tmp_path / f"img{i}.bin")
        paths[-1].write_bytes(data)
    cmd = [sys.executable, "-m", "service.handoff.sidecar", "--vitserve", server.url, "--vllm", vllm_url(vllm),
           "--model", "qwen-vl-test", "--prompt", "What is in the pictures?", "--max-tokens", "16", *map(str, paths)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ANSWER

    body = last_chat(vllm)
    assert body["model"] == "qwen-vl-test" and body["max_tokens"] == 16
    (message,) = body["messages"]
    assert message["role"] == "user"
    text, *parts = message["content"]
    assert text == {"type": "text", "text": "What is in the pictures?"}
    check_parts(parts, float_reference(server, "bfloat16"), server.model, torch.bfloat16)


def test_library_calls(server, vllm):
    """encode_for_vllm from bytes and paths, with ids as uuids; chat_request; errors carry the status."""
    parts = sidecar.encode_for_vllm(server.url, IMAGES, ids=["first", "second"], dtype="float32")
    assert [p["uuid"] for p in parts] == ["first", "second"]
    check_parts(parts, float_reference(server, "float32"), server.model, torch.float32)
    body = sidecar.chat_request("m", "hi", parts)
    assert body == {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]}
    with pytest.raises(sidecar.SidecarError) as err:
        sidecar.encode_for_vllm(server.url, [b"not an image"])
    assert err.value.status == 422 and json.loads(err.value.body)["error"]["index"] == 0
    with pytest.raises(ValueError):
        sidecar.encode_for_vllm(server.url, IMAGES, ids=["only-one"])


def read_ec(path) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as f:
        assert list(f.keys()) == [TENSOR_KEY]
        return f.get_tensor(TENSOR_KEY)


def test_encoder_cache_mode(server, vllm, tmp_path, capsys):
    """`--ec`: vitserve writes PATH/<id>/encoder_cache.safetensors (`ec_cache`) and vLLM gets the images
    with uuid = id; the cached tensor equals the `float` format's values and the vllm part's tensor."""
    paths = []
    for i, data in enumerate(IMAGES):
        paths.append(tmp_path / f"img{i}")
        paths[-1].write_bytes(data)
    argv = ["--vitserve", server.url, "--vllm", vllm_url(vllm), "--model", "m", "--prompt", "why?", "--ec"]
    assert sidecar.main([*argv, *map(str, paths)]) == 0
    assert json.loads(capsys.readouterr().out) == ANSWER

    ids = [sidecar.content_id(d) for d in IMAGES]
    text, *parts = last_chat(vllm)["messages"][0]["content"]
    assert text == {"type": "text", "text": "why?"}
    assert [p["uuid"] for p in parts] == ids
    for part, data, mime in zip(parts, IMAGES, ["image/jpeg", "image/png"]):
        assert part["type"] == "image_url"
        head, payload = part["image_url"]["url"].split(",", 1)
        assert head == f"data:{mime};base64" and base64.b64decode(payload) == data

    reference = float_reference(server, "float32")  # the served dtype on the CPU
    vllm_parts = sidecar.encode_for_vllm(server.url, IMAGES, ids=ids, dtype="float32")
    out_hidden, layers = DIMS[server.model]
    for item_id, ref, part in zip(ids, reference, vllm_parts):
        ec = read_ec(server.store / item_id / FILE_NAME)
        t, h, w = ref["grid_thw"]
        assert ec.dtype == torch.float32 and ec.shape == (t * h * w // 4, out_hidden * (1 + layers))
        assert torch.equal(ec, joined(ref, torch.float32))
        assert torch.equal(ec, sidecar.decode_content_part(part)[0])
    assert set(ids) <= {p.name for p in server.store.iterdir()}
