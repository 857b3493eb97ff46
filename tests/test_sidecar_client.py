"""The request flow of `service/handoff/sidecar.py` (client -> vitserve -> vLLM chat request) against a real
vitserve on loopback.

The LLM server here is a fake that records the chat request: only what vLLM's code cannot show without a GPU
(an OpenAI server accepting a POST). What vLLM makes of such a request, its content parts and the shared
folder's files, is tested with vLLM's own code in tests/test_vllm_handoff.py, which feeds it a request
recorded the same way.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from typing import Any

import httpx
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
from tests.videos import make_video

IMAGES = [image_bytes(160, 120, seed=21, fmt="JPEG"), image_bytes(96, 96, seed=22, fmt="PNG")]
VIDEO = make_video(8, fps=4, width=64, height=48)
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
    with ServerThread(settings(model=request.param, ec_shared_storage=str(store), cache_bytes=64 << 20)) as srv:
        srv.store = store  # type: ignore[attr-defined]
        srv.model = request.param  # type: ignore[attr-defined]
        yield srv


def last_chat(httpd) -> dict[str, Any]:
    path, _, body = httpd.requests[-1]
    assert path == "/v1/chat/completions"
    return body


def float_reference(srv: ServerThread, media: list[bytes]) -> list[dict[str, Any]]:
    """The `float` format of the same media: embedding rows and DeepStack rows as numbers."""
    kinds = ["video" if m is VIDEO else "image" for m in media]
    items = [{"type": kind, kind: base64.b64encode(m).decode()} for kind, m in zip(kinds, media)]
    with srv.client() as c:
        r = c.post("/encode", json={"items": items, "include_deepstack": True})
    assert r.status_code == 200, r.text
    return r.json()["data"]


def joined(entry: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """Main embedding with the DeepStack layers after it along hidden: the layout vLLM takes."""
    return torch.cat([torch.tensor(m, dtype=torch.float64).to(dtype)
                      for m in [entry["embedding"], *entry["deepstack"]]], dim=-1)


def read_ec(path) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as f:
        assert list(f.keys()) == [TENSOR_KEY]
        return f.get_tensor(TENSOR_KEY)


def test_ref_mode_end_to_end(server, vllm, tmp_path):
    """`python -m service.handoff.sidecar` as a user runs it: vitserve writes the files, vLLM gets
    metadata-only parts naming them."""
    paths = []
    for i, data in enumerate([*IMAGES, VIDEO]):
        paths.append(tmp_path / f"media{i}.bin")
        paths[-1].write_bytes(data)
    cmd = [sys.executable, "-m", "service.handoff.sidecar", "--vitserve", server.url, "--vllm", server_url(vllm),
           "--model", "qwen-vl-test", "--prompt", "What is in these?", "--max-tokens", "16", *map(str, paths)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ANSWER

    body = last_chat(vllm)
    assert body["model"] == "qwen-vl-test" and body["max_tokens"] == 16
    (message,) = body["messages"]
    text, *parts = message["content"]
    assert text == {"type": "text", "text": "What is in these?"}
    reference = float_reference(server, [*IMAGES, VIDEO])
    out_hidden, layers = DIMS[server.model]
    for part, ref in zip(parts, reference):
        kind = ref["type"]
        assert part["type"] == f"{kind}_embeds" and part["uuid"].startswith("vit-")
        assert part[f"{kind}_embeds"][f"{kind}_grid_thw"] == ref["grid_thw"]  # metadata only: no tensor inline
        assert f"{kind}_embeds" not in part[f"{kind}_embeds"]
        assert ("timestamps" in part[f"{kind}_embeds"]) == (kind == "video" and server.model == "tiny-qwen3-vl")
        ec = read_ec(server.store / part["uuid"] / FILE_NAME)
        t, h, w = ref["grid_thw"]
        assert ec.dtype == torch.float32 and ec.shape == (t * h * w // 4, out_hidden * (1 + layers))
        assert torch.equal(ec, joined(ref, torch.float32))


def test_embeds_mode(server, vllm):
    parts = [sidecar.media_part(m) for m in IMAGES]
    body = sidecar.rewrite_chat(sidecar.chat_request("m", "hi", parts), server.url, mode="embeds", dtype="float32")
    reference = float_reference(server, IMAGES)
    out_hidden, layers = DIMS[server.model]
    for part, ref in zip(body["messages"][0]["content"][1:], reference):
        embeds, grid = sidecar.decode_content_part(part)
        assert grid.dtype == torch.int64 and grid.shape == (3,) and grid.tolist() == ref["grid_thw"]
        t, h, w = grid.tolist()
        assert embeds.shape == (t * h * w // 4, out_hidden * (1 + layers))
        assert torch.equal(embeds, joined(ref, torch.float32))
        assert part["uuid"] == ref["content_id"]
    assert sidecar.run(server.url, server_url(vllm), "m", "hi", IMAGES, mode="embeds") == ANSWER


def test_every_turn_resends_the_images_and_vitserve_answers_from_its_cache(server, vllm):
    """A chat: each turn's request holds the earlier turns' images again; the rewrite of turn 2 costs vitserve
    no encoding for them."""
    first = sidecar.chat_request("m", "What is this?", [sidecar.media_part(IMAGES[0])])
    before = httpx.get(server.url + "/metrics").text
    sidecar.rewrite_chat(first, server.url)
    second = copy_with_turn(first, "And this one?", [sidecar.media_part(IMAGES[1])])
    rewritten = sidecar.rewrite_chat(second, server.url)
    after = httpx.get(server.url + "/metrics").text
    assert counter(after, "vitserve_cache_hits_total") - counter(before, "vitserve_cache_hits_total") >= 1
    turn1, turn2 = rewritten["messages"][0]["content"][1], rewritten["messages"][2]["content"][1]
    assert turn1["uuid"] != turn2["uuid"]
    assert rewritten["messages"][1] == {"role": "assistant", "content": "a test picture"}


def copy_with_turn(body: dict[str, Any], text: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    messages = [*body["messages"], {"role": "assistant", "content": "a test picture"},
                {"role": "user", "content": [{"type": "text", "text": text}, *parts]}]
    return {**body, "messages": messages}


def counter(metrics_text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines() if line.startswith(name))


def test_client_errors(server):
    with pytest.raises(sidecar.SidecarError) as err:
        sidecar.encode_parts(server.url, [sidecar.media_part(b"not an image")])
    assert err.value.status == 422 and json.loads(err.value.body)["error"]["index"] == 0
    body = sidecar.chat_request("m", "hi", [sidecar.media_part(IMAGES[0])])
    with pytest.raises(sidecar.SidecarError, match="mm_processor_kwargs"):
        sidecar.rewrite_chat({**body, "mm_processor_kwargs": {"max_pixels": 10000}}, server.url)
    with pytest.raises(ValueError):
        sidecar.rewrite_chat(body, server.url, mode="other")
    named = sidecar.rewrite_chat(sidecar.chat_request("m", "hi", [sidecar.media_part(IMAGES[0], uuid="cat-1")]),
                                 server.url)
    assert named["messages"][0]["content"][1]["uuid"] == "cat-1"  # a client's uuid names the file
    assert (server.store / "cat-1" / FILE_NAME).is_file()
    plain = {"model": "m", "messages": [{"role": "user", "content": "text only"}]}
    assert sidecar.rewrite_chat(plain, server.url) == plain
