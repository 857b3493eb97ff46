"""Embeddings over HTTP, in every output format, against the graph runner, eager and transformers.

A real checkpoint written by transformers is served from its folder by a real uvicorn server on
loopback; the same bytes are preprocessed locally and run through `GraphRunner.encode`, through the
eager forward, and through transformers' `get_image_features` in fp32.
"""

from __future__ import annotations

import base64
import io
import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors

from graphs.runner import GraphRunner, plan_for
from models.loader import load_tower
from service.media.image_preprocess import preprocess_image_bytes
from tests.checkpoints import write_checkpoint
from tests.http_helpers import ServerThread, b64, image_bytes, settings, shm_entries
from tests.videos import make_video

FAMILIES = ["tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-glm4v"]
IMAGES = [(200, 150, "PNG"), (96, 320, "JPEG"), (448, 448, "WEBP")]
NP_DTYPES = {"float32": np.float32, "float16": np.float16}


class Family:
    def __init__(self, name: str, folder, reference) -> None:
        self.name = name
        self.reference = reference
        self.settings = settings(model=str(folder), served_model_name=f"served-{name}")
        self.tower = load_tower(str(folder), device="cpu", dtype="float32")
        plan = plan_for(self.tower, self.settings.max_batch_tokens)
        self.runner = GraphRunner(self.tower, torch.device("cpu"), plan)
        self.runner.capture()

    def expected(self, data: bytes):
        visual = preprocess_image_bytes(data, self.tower.processor)
        return visual, self.runner.encode([visual])[0]

    def transformers(self, visual):
        x = torch.from_numpy(self.tower.processor.normalize(visual.pixels))
        with torch.no_grad():
            out = self.reference.model.get_image_features(pixel_values=x,
                                                          image_grid_thw=torch.tensor([visual.grid_thw]))
        deepstack = [torch.cat(f) for f in (getattr(out, "deepstack_features", None) or [])]
        return torch.cat(out.pooler_output), deepstack


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    fam = Family(request.param, folder, write_checkpoint(request.param, folder))
    with ServerThread(fam.settings) as srv:
        yield fam, srv


def raw(value: str, dtype: str, shape: list[int]) -> torch.Tensor:
    data = base64.b64decode(value)
    if dtype == "bfloat16":
        return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).reshape(shape)
    little_endian = np.dtype(NP_DTYPES[dtype]).newbyteorder("<")
    return torch.from_numpy(np.frombuffer(bytearray(data), dtype=little_endian).reshape(shape))


def torch_b64(value: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(value)), weights_only=True)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    tol = {torch.float32: (1e-5, 1e-6), torch.float16: (2e-3, 1e-4), torch.bfloat16: (2e-2, 1e-3)}[dtype]
    torch.testing.assert_close(a.float(), b.to(dtype).float(), rtol=tol[0], atol=tol[1])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_float_json_matches_runner_eager_and_transformers(served):
    fam, srv = served
    datas = [image_bytes(w, h, seed=i, fmt=fmt) for i, (w, h, fmt) in enumerate(IMAGES)]
    with srv.client() as c:
        r = c.post("/encode", json={"items": [{"type": "image", "image": b64(d), "id": f"img-{i}"}
                                              for i, d in enumerate(datas)], "include_deepstack": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("enc-") and body["model"] == f"served-{fam.name}"
    patches = 0
    for i, (data, entry) in enumerate(zip(datas, body["data"])):
        visual, want = fam.expected(data)
        got = torch.tensor(entry["embedding"], dtype=torch.float32)
        assert entry["index"] == i and entry["id"] == f"img-{i}" and entry["type"] == "image"
        assert entry["grid_thw"] == list(visual.grid_thw) and entry["dtype"] == "float32"
        assert entry["shape"] == list(got.shape) == list(want.embeds.shape) and entry["num_tokens"] == got.shape[0]
        close(got, want.embeds)
        eager = fam.runner.eager(visual.pixels, [visual.grid_thw])
        ref_embeds, ref_deepstack = fam.transformers(visual)
        assert rel_err(got, eager.embeds) <= 1e-5
        assert rel_err(got, ref_embeds) <= 1e-5
        assert len(entry["deepstack"]) == len(ref_deepstack) == fam.tower.num_deepstack
        for layer, ref in zip(entry["deepstack"], ref_deepstack):
            assert rel_err(torch.tensor(layer), ref) <= 1e-5
        patches += visual.num_patches
    assert body["usage"] == {"images": 3, "videos": 0, "patches": patches,
                             "tokens": sum(e["num_tokens"] for e in body["data"])}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_base64_is_raw_little_endian(served, dtype):
    fam, srv = served
    data = image_bytes(*IMAGES[0][:2])
    with srv.client() as c:
        r = c.post("/encode", json={"items": [{"type": "image", "image": b64(data)}], "encoding_format": "base64",
                                    "dtype": dtype, "include_deepstack": True})
    assert r.status_code == 200, r.text
    entry = r.json()["data"][0]
    _, want = fam.expected(data)
    tdtype = getattr(torch, dtype)
    got = raw(entry["embedding"], dtype, entry["shape"])
    assert got.dtype == tdtype and entry["dtype"] == dtype
    close(got, want.embeds, tdtype)
    for layer, ref in zip(entry["deepstack"], want.deepstack):
        close(raw(layer, dtype, entry["shape"]), ref, tdtype)


def test_vllm_content_part(served):
    fam, srv = served
    data = image_bytes(*IMAGES[1][:2], seed=4)
    with srv.client() as c:
        r = c.post("/encode", json={"items": [{"type": "image", "image": b64(data), "id": "cat-42"}],
                                    "encoding_format": "vllm", "dtype": "bfloat16"})
    assert r.status_code == 200, r.text
    entry = r.json()["data"][0]
    assert "embedding" not in entry
    part = entry["content_part"]
    assert part["type"] == "image_embeds" and part["uuid"] == "cat-42"
    assert set(part["image_embeds"]) == {"image_embeds", "image_grid_thw"}
    embeds = torch_b64(part["image_embeds"]["image_embeds"])
    grid = torch_b64(part["image_embeds"]["image_grid_thw"])
    visual, want = fam.expected(data)
    # One item's grid: int64 [3]; vLLM stacks the parts' grids into [n, 3].
    assert grid.dtype == torch.int64 and grid.tolist() == list(visual.grid_thw)
    d = fam.tower.out_hidden_size
    assert embeds.dtype == torch.bfloat16 and embeds.shape == (want.embeds.shape[0], d * (1 + fam.tower.num_deepstack))
    # DeepStack layers follow the main embedding along hidden, the order vLLM splits them in.
    for k, part_want in enumerate([want.embeds, *want.deepstack]):
        close(embeds[:, k * d:(k + 1) * d], part_want, torch.bfloat16)


def test_safetensors_body(served):
    fam, srv = served
    datas = [image_bytes(w, h, seed=i, fmt=fmt) for i, (w, h, fmt) in enumerate(IMAGES[:2])]
    with srv.client() as c:
        r = c.post("/encode", json={"items": [{"type": "image", "image": b64(d)} for d in datas],
                                    "include_deepstack": True},
                   headers={"Accept": "application/vnd.safetensors"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/vnd.safetensors"
    tensors = load_safetensors(r.content)
    (header_len,) = struct.unpack("<Q", r.content[:8])
    meta = json.loads(r.content[8:8 + header_len])["__metadata__"]
    assert meta["model"] == f"served-{fam.name}" and meta["family"] == fam.tower.family
    inputs = json.loads(meta["inputs"])
    expected_keys = set()
    for i, data in enumerate(datas):
        visual, want = fam.expected(data)
        close(tensors[f"embeds.{i}"], want.embeds)
        assert tensors[f"grid_thw.{i}"].dtype == torch.int64
        assert tensors[f"grid_thw.{i}"].tolist() == [list(visual.grid_thw)]
        for j, ref in enumerate(want.deepstack):
            close(tensors[f"deepstack.{i}.{j}"], ref)
        expected_keys |= {f"embeds.{i}", f"grid_thw.{i}", *(f"deepstack.{i}.{j}" for j in range(len(want.deepstack)))}
        assert inputs[i]["grid_thw"] == list(visual.grid_thw) and inputs[i]["type"] == "image"
    assert set(tensors) == expected_keys


def test_multipart_matches_json(served):
    fam, srv = served
    datas = [image_bytes(120, 90, seed=7, fmt="JPEG"), image_bytes(64, 200, seed=8, fmt="PNG")]
    options = {"encoding_format": "base64", "items": [{"id": "a"}, {"id": "b", "max_pixels": 100000}]}
    with srv.client() as c:
        r = c.post("/encode", files=[("files", (f"f{i}", d, "application/octet-stream")) for i, d in enumerate(datas)],
                   data={"options": json.dumps(options)})
    assert r.status_code == 200, r.text
    entries = r.json()["data"]
    assert [e["id"] for e in entries] == ["a", "b"]
    for data, entry, opts in zip(datas, entries, options["items"]):
        visual = preprocess_image_bytes(data, fam.tower.processor, max_pixels=opts.get("max_pixels"))
        want = fam.runner.encode([visual])[0]
        assert entry["grid_thw"] == list(visual.grid_thw)
        close(raw(entry["embedding"], "float32", entry["shape"]), want.embeds)


def test_video_over_http():
    from service.media.video_preprocess import preprocess_video_bytes

    cfg = settings()
    tower = load_tower(cfg.model, device="cpu", dtype="float32")
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower, cfg.max_batch_tokens))
    runner.capture()
    video = make_video(12, fps=6, width=112, height=84)
    image = image_bytes(100, 100)
    with ServerThread(cfg) as srv, srv.client() as c:
        r = c.post("/encode", json={"items": [
            {"type": "video", "video": "data:video/mp4;base64," + b64(video), "fps": 2.0, "id": "clip"},
            {"type": "image", "image": b64(image)},
        ]})
        multipart = c.post("/encode", files=[("files", ("clip", video, "video/mp4"))],
                           data={"options": json.dumps({"items": [{"fps": 2.0}]})})
        raised = c.post("/encode", json={"items": [{"type": "video", "video": b64(video), "fps": 0.5}]})
    assert r.status_code == 200, r.text
    entry = r.json()["data"][0]
    visual = preprocess_video_bytes(video, tower.processor, fps=2.0)
    want = runner.encode([visual])[0]
    assert entry["type"] == "video" and entry["grid_thw"] == list(visual.grid_thw)
    assert entry["timestamps"] == visual.meta["timestamps"]
    assert entry["second_per_grid_ts"] == pytest.approx(visual.meta["second_per_grid_ts"])
    assert entry["fps"] == pytest.approx(visual.meta["fps"])
    close(torch.tensor(entry["embedding"]), want.embeds)
    assert entry["requested_fps"] == 2.0 and "fps_adjusted_by" not in entry
    # Half a frame a second over 2 s is one frame: the minimum frame count raises it, and the entry says so.
    assert raised.status_code == 200, raised.text
    slow = raised.json()["data"][0]
    assert slow["requested_fps"] == 0.5 and slow["fps_adjusted_by"] == "min_frames"
    assert slow["fps"] > 0.5
    assert slow["fps"] == pytest.approx(preprocess_video_bytes(video, tower.processor, fps=0.5).meta["fps"])
    assert r.json()["usage"]["videos"] == 1 and r.json()["usage"]["images"] == 1
    assert multipart.status_code == 200, multipart.text
    assert multipart.json()["data"][0]["type"] == "video"
    close(torch.tensor(multipart.json()["data"][0]["embedding"]), want.embeds)


@pytest.mark.parametrize("where", ["front", "workers"])
def test_a_response_is_the_same_whether_the_front_or_a_worker_encodes_it(served, monkeypatch, where):
    """A request alone in its front has its body encoded there; others have it encoded in the workers.
    Every format and dtype comes out byte for byte the same either way (less the request id; a
    safetensors header's keys come in no set order, so that body is compared once parsed)."""
    fam, srv = served
    service = srv.app.state.service
    datas = [image_bytes(120, 90, seed=3, fmt="JPEG"), image_bytes(64, 200, seed=4, fmt="PNG")]
    items = [{"type": "image", "image": b64(d)} for d in datas]
    asks = [({"encoding_format": fmt, "dtype": dtype, "include_deepstack": True}, {})
            for fmt in ("float", "base64") for dtype in ("float32", "bfloat16", "float16")]
    asks += [({"encoding_format": "vllm"}, {}),
             ({"include_deepstack": True}, {"Accept": "application/vnd.safetensors"})]

    def bodies() -> list:
        out = []
        with srv.client() as c:
            for options, headers in asks:
                r = c.post("/encode", json={"items": items, **options}, headers=headers)
                assert r.status_code == 200, r.text
                request_id = r.headers["x-request-id"].encode()
                body = r.content.replace(request_id, b"ID")
                if headers:
                    (n,) = struct.unpack("<Q", r.content[:8])
                    tensors = {k: v.tolist() for k, v in load_safetensors(r.content).items()}
                    body = (json.loads(r.content[8:8 + n].replace(request_id, b"ID"))["__metadata__"], tensors)
                out.append(body)
        return out

    calls: list[str] = []
    workers = service.engine.workers
    monkeypatch.setattr(workers, "call", _recording(workers.call, calls))
    monkeypatch.setattr(service, "renders_here", lambda *_: where == "front")
    got = bodies()
    encodes = [c for c in calls if c.endswith(("encode_item", "encode_safetensors"))]
    assert (encodes == []) == (where == "front")  # the forced path is the one that ran
    monkeypatch.setattr(service, "renders_here", lambda *_: where != "front")
    assert bodies() == got
    assert shm_entries(service.engine.names.prefix, pools=False) == []  # no segment left behind


def _recording(call, calls: list[str]):
    async def recorded(owner, fn, *args, **kwargs):
        calls.append(fn)
        return await call(owner, fn, *args, **kwargs)
    return recorded


def test_a_response_is_encoded_in_the_front_only_when_alone_small_and_not_float_lists():
    from service.http.service import RENDER_HERE_BYTES, renders_here

    assert renders_here(1, "base64", 1 << 20) and renders_here(1, "safetensors", RENDER_HERE_BYTES)
    assert not renders_here(2, "base64", 1 << 20)  # another request is in flight: the loop is theirs too
    assert not renders_here(1, "float", 1 << 10)  # formatted in Python: a worker's job
    assert not renders_here(1, "vllm", RENDER_HERE_BYTES + 1)


def test_a_small_body_is_parsed_on_the_event_loop_and_a_large_one_on_a_parse_thread(served, monkeypatch):
    from service.http.service import PARSE_HERE_BYTES

    fam, srv = served
    service = srv.app.state.service
    threaded: list[str] = []
    in_pool = service.run_in_pool

    async def recording(fn, *args):
        threaded.append(getattr(fn, "func", fn).__name__)  # parsing comes as a functools.partial
        return await in_pool(fn, *args)

    monkeypatch.setattr(service, "run_in_pool", recording)
    small = {"items": [{"type": "image", "image": b64(image_bytes(64, 64, seed=1, fmt="PNG"))}]}
    large = {"items": small["items"], "id": "x" * PARSE_HERE_BYTES}  # padded past the bound
    with srv.client() as c:
        for body, multipart in ((small, False), (large, False), (small, True)):
            if multipart:
                r = c.post("/encode", files=[("files", ("a.png", image_bytes(64, 64, seed=1, fmt="PNG")))])
            else:
                r = c.post("/encode", json=body)
            assert r.status_code in (200, 422), r.text
    assert [name for name in threaded if name.startswith("parse")] == ["parse_json_request"]  # the large one
