"""vitserve's hand-off judged by vLLM 0.33.0's own code, not by a fake.

Real vitserve servers on loopback (the three tiny presets, one shared encoder-cache folder) answer real HTTP
requests; tests/vllm_driver.py, in vLLM's own environment (tools/vllm_env.sh builds it; .ci/run sets
VITSERVE_VLLM_PYTHON), feeds their outputs to vLLM's chat parser, renderer, multimodal processor, input
processor, models and `ECExampleConnector`, once for the whole module, and the tests read its report.

Without VITSERVE_VLLM_PYTHON these tests skip and say how to build the environment; with it, a broken
environment fails them.

Where vLLM's code cannot run here: Qwen2-VL's vision tower cannot be built without a GPU driver (its
QuickGELU binds a compiled CUDA kernel at construction), so for Qwen2-VL the cases stop after the processor
and the connector; the step of the GPU model runner that slices encoder outputs to placeholders is restated
in the driver; and no vLLM OpenAI server runs (tests/test_sidecar_client.py fakes that HTTP hop, and a chat
request recorded from it is parsed here).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from service.handoff import sidecar
from service.handoff.ec_storage import FILE_NAME
from tests.checkpoints import write_vllm_model_folder
from tests.http_helpers import ROOT, QuietHandler, ServerThread, image_bytes, loopback_http_server, server_url, settings
from tests.videos import make_video

PYTHON_VAR = "VITSERVE_VLLM_PYTHON"
HOW = "build vLLM's environment with tools/vllm_env.sh and set VITSERVE_VLLM_PYTHON=.ci/vllm-env/bin/python"
MODELS = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]
BUILDS_MODEL = {"tiny-qwen2-vl": False, "tiny-qwen2.5-vl": True, "tiny-qwen3-vl": True}
DEEPSTACK = {"tiny-qwen2-vl": 0, "tiny-qwen2.5-vl": 0, "tiny-qwen3-vl": 2}
IMAGES = [image_bytes(160, 120, seed=21, fmt="JPEG"), image_bytes(96, 96, seed=22, fmt="PNG")]
VIDEO = make_video(8, fps=4, width=64, height=48)
LONG_VIDEO = make_video(32, fps=4, width=64, height=48)  # 8 s: at 1 fps, 8 frames
MEDIA = [("image", IMAGES[0]), ("image", IMAGES[1]), ("video", VIDEO)]
VLLM_DTYPE = torch.bfloat16  # the language model's dtype in vLLM; vitserve serves float32 on the CPU


def vllm_python() -> str:
    python = os.environ.get(PYTHON_VAR)
    if not python:
        pytest.skip(f"vLLM's environment is not configured: {HOW}")
    if not Path(python).is_file():
        pytest.fail(f"{PYTHON_VAR}={python} does not exist: {HOW}")
    return python


def run_driver(driver: str, request: dict[str, Any], work: Path, import_vitserve: bool = False,
               timeout: float = 900) -> dict[str, Any]:
    """`tests/<driver>` in vLLM's environment on `request` (JSON on stdin); its report (the last line of its
    output). vLLM on the CPU, offline, two threads; vitserve importable only where the driver needs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")}
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="2",
               PYTHONPATH=str(ROOT) if import_vitserve else "")
    proc = subprocess.run([vllm_python(), str(ROOT / "tests" / driver)], input=json.dumps(request), text=True,
                          capture_output=True, timeout=timeout, cwd=work, env=env)
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"{driver} failed (exit {proc.returncode}); {HOW}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def items(options: dict[str, Any] | None = None, ids: list[str] | None = None) -> list[dict[str, Any]]:
    out = []
    for k, (kind, data) in enumerate(MEDIA):
        item: dict[str, Any] = {"type": kind, kind: base64.b64encode(data).decode(), **(options or {})}
        if ids:
            item["id"] = ids[k]
        out.append(item)
    return out


def post(client, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/encode", json=body)
    assert r.status_code == 200, r.text
    return {"body": r.json(), "cache_hits": int(r.headers["x-vitserve-cache-hits"])}


def encode_three_ways(name: str, store: Path, items: list[dict[str, Any]], media_parts: list[dict[str, Any]],
                      prompt: str = "Describe.") -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """A server of preset `name` writing its outputs to the shared folder `store`: POST /encode's entries for
    `items` as floats ("float"), inline vLLM parts ("vllm") and references ("ref"), and the chat request of
    `media_parts` as the sidecar rewrites it to reference them."""
    got: dict[str, list[dict[str, Any]]] = {}
    with ServerThread(settings(model=name, ec_shared_storage=str(store), cache_bytes=64 << 20)) as srv, \
            srv.client() as c:
        for kind, fmt in {"float": None, "vllm": "vllm", "ref": "vllm_ref"}.items():
            r = c.post("/encode", json={"items": items, **({"encoding_format": fmt} if fmt else {})})
            assert r.status_code == 200, r.text
            got[kind] = r.json()["data"]
        chat = sidecar.rewrite_chat(sidecar.chat_request("m", prompt, media_parts), srv.url, mode="ref")
    return got, chat


class Recorder(QuietHandler):
    """The LLM server's HTTP hop (no vLLM server runs without a GPU): records the chat request."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self.server.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))  # type: ignore
        self.reply(200, b'{"choices": []}', "application/json")


@dataclass
class Run:
    http: dict[str, dict[str, Any]]  # model -> scenario -> vitserve's answer
    report: dict[str, Any]  # "<model>/<case>" -> what vLLM made of it
    tensors: dict[str, torch.Tensor]
    store: Path
    versions: tuple[str, str]

    def case(self, model: str, name: str) -> dict[str, Any]:
        return self.report[f"{model}/{name}"]

    def tensor(self, model: str, name: str, what: str) -> torch.Tensor:
        return self.tensors[f"{model}/{name}.{what}"]


def reference(entry: dict[str, Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The `float` format's main embedding and DeepStack layers (float32 values, exactly)."""
    main = torch.tensor(entry["embedding"], dtype=torch.float64).float()
    return main, [torch.tensor(d, dtype=torch.float64).float() for d in entry.get("deepstack", [])]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    vllm_python()  # skips here, before any server starts, where vLLM's environment is not configured
    store = tmp_path_factory.mktemp("ec")  # one folder for all three models: content ids keep them apart
    work = tmp_path_factory.mktemp("vllm")
    http: dict[str, dict[str, Any]] = {}
    request: dict[str, Any] = {"models": [], "tensors_out": str(work / "out.safetensors")}
    for name in MODELS:
        cfg = settings(model=name, ec_shared_storage=str(store), cache_bytes=64 << 20)
        with ServerThread(cfg) as srv, srv.client() as c, loopback_http_server(Recorder) as llm:
            llm.bodies = []  # type: ignore[attr-defined]
            got = {
                "float": post(c, {"items": items(), "include_deepstack": True}),
                "vllm": post(c, {"items": items(), "encoding_format": "vllm"}),
                "ref": post(c, {"items": items(), "encoding_format": "vllm_ref"}),
                "ids": post(c, {"items": items(ids=[f"{name}-a", f"{name}-b", f"{name}-v"]),
                                "encoding_format": "vllm_ref"}),
                "small": post(c, {"items": items({"min_pixels": 3136, "max_pixels": 12544})[:1],
                                  "encoding_format": "vllm_ref"}),
            }
            if name == "tiny-qwen2.5-vl":  # 1 fps: 2 s per temporal step, which vLLM will not see
                slow = {"type": "video", "video": base64.b64encode(LONG_VIDEO).decode(), "fps": 1.0}
                got["slow"] = post(c, {"items": [slow], "encoding_format": "vllm"})
            sidecar.run(srv.url, server_url(llm), "m", "What is in these?", [m for _, m in MEDIA])
            got["chat"] = llm.bodies[-1]  # type: ignore[attr-defined]
        http[name] = got
        parts = {k: [e["content_part"] for e in got[k]["body"]["data"]] for k in ("vllm", "ref", "ids")}
        builds = BUILDS_MODEL[name]
        cases = [
            {"name": "embeds", "parts": parts["vllm"], "model": builds},
            {"name": "ref", "parts": parts["ref"], "consumer": str(store), "model": builds},
            {"name": "ids", "parts": parts["ids"], "consumer": str(store), "model": False},
            {"name": "chat", "messages": got["chat"]["messages"], "consumer": str(store), "model": builds},
            {"name": "media_io_kwargs", "parts": parts["ref"], "consumer": str(store), "model": False,
             "media_io_kwargs": {"image": {"image_mode": "RGB"}}},
            {"name": "mm_processor_kwargs", "parts": parts["ref"], "consumer": str(store), "model": False,
             "mm_processor_kwargs": {"max_pixels": 1003520}},
            {"name": "ref_without_consumer", "parts": parts["ref"], "model": False},
        ]
        if name == "tiny-qwen3-vl":  # what vitserve used to send: no timestamps
            old = json.loads(json.dumps(parts["vllm"][2]))
            del old["video_embeds"]["timestamps"]
            cases.append({"name": "no_timestamps", "parts": [old], "model": False})
        if name == "tiny-qwen2.5-vl":
            cases.append({"name": "slow", "parts": [got["slow"]["body"]["data"][0]["content_part"]], "model": False})
            short = json.loads(json.dumps(parts["ref"][0]))
            t, h, w = short["image_embeds"]["image_grid_thw"]
            short["image_embeds"]["image_grid_thw"] = [t, h - 2, w]  # a grid smaller than the file's tensor
            cases.append({"name": "short_grid", "parts": [short], "consumer": str(store), "model": True})
        folder = write_vllm_model_folder(name, work / name)
        request["models"].append({"name": name, "dir": str(folder), "dtype": "bfloat16", "cases": cases})

    report = run_driver("vllm_driver.py", request, work)
    return Run(http, report["cases"], load_file(request["tensors_out"]), store, (report["vllm"], report["torch"]))


def test_the_vllm_release(run):
    assert run.versions[0] == "0.33.0"


@pytest.mark.parametrize("model", MODELS)
def test_inline_parts_parse_size_and_merge(run, model):
    """`encoding_format: "vllm"`: several parts of both modalities in one message pass vLLM's parser and
    processor; each placeholder has the item's token count; the uuid (the content id) is vLLM's identifier;
    and the model casts the float32 embeddings to its dtype, splits off DeepStack and merges them."""
    case = run.case(model, "embeds")
    assert case["ok"], case.get("error")
    data = run.http[model]["vllm"]["body"]["data"]
    ids = [e["content_id"] for e in data]
    assert [f["identifier"] for f in case["features"]] == ids == [e["content_part"]["uuid"] for e in data]
    assert case["mm_hashes"] == {"image": ids[:2], "video": ids[2:]}
    assert [f["num_embeds"] for f in case["features"]] == [e["num_tokens"] for e in data]
    if not BUILDS_MODEL[model]:
        return
    floats = run.http[model]["float"]["body"]["data"]
    assert case["model_dtype"] == "bfloat16"
    for k, entry in enumerate(floats):
        main, deepstack = reference(entry)
        enc = run.tensor(model, "embeds", f"enc.{k}")  # what vLLM's encoder cache holds: cast to the model dtype
        assert enc.dtype == VLLM_DTYPE and torch.equal(enc, torch.cat([main, *deepstack], -1).to(VLLM_DTYPE))
        assert torch.equal(run.tensor(model, "embeds", f"merged.{k}"), main.to(VLLM_DTYPE))
        for j, layer in enumerate(deepstack):  # split by vision_config.out_hidden_size
            assert torch.equal(run.tensor(model, "embeds", f"deepstack.{k}.{j}"), layer.to(VLLM_DTYPE))
        assert len(deepstack) == DEEPSTACK[model]


@pytest.mark.parametrize("model", MODELS)
def test_reference_parts_load_from_the_shared_folder(run, model):
    """`encoding_format: "vllm_ref"`: metadata-only parts on an encoder-cache consumer. The uuid is the
    identifier verbatim, the connector finds and loads every file (the tensor as written, float32), the
    placeholder is exactly as long as the file, and the merge gives the same rows as inline parts."""
    case = run.case(model, "ref")
    assert case["ok"], case.get("error")
    data = run.http[model]["ref"]["body"]["data"]
    uuids = [e["content_part"]["uuid"] for e in data]
    assert uuids == [e["content_id"] for e in data]
    assert [f["identifier"] for f in case["features"]] == uuids
    assert case["has_cache"] == [True] * 3 and case["loaded"] == sorted(uuids)
    assert all(f["data_keys"] and not any(k.endswith("_embeds") for k in f["data_keys"]) for f in case["features"])
    floats = run.http[model]["float"]["body"]["data"]
    for k, (feature, entry) in enumerate(zip(case["features"], floats)):
        main, deepstack = reference(entry)
        loaded = run.tensor(model, "ref", f"enc.{k}")
        assert loaded.dtype == torch.float32 and torch.equal(loaded, torch.cat([main, *deepstack], -1))
        assert feature["num_embeds"] == loaded.shape[0] == entry["num_tokens"]
        if BUILDS_MODEL[model]:
            assert torch.equal(run.tensor(model, "ref", f"merged.{k}"), main.to(VLLM_DTYPE))
            for j, layer in enumerate(deepstack):
                assert torch.equal(run.tensor(model, "ref", f"deepstack.{k}.{j}"), layer.to(VLLM_DTYPE))
    assert run.http[model]["ref"]["cache_hits"] == 3  # the same items as the two requests before


@pytest.mark.parametrize("model", MODELS)
def test_item_ids_are_the_uuids(run, model):
    case = run.case(model, "ids")
    assert case["ok"], case.get("error")
    ids = [f"{model}-a", f"{model}-b", f"{model}-v"]
    assert [f["identifier"] for f in case["features"]] == ids and case["has_cache"] == [True] * 3
    for k, name in enumerate(ids):
        assert torch.equal(run.tensor(model, "ids", f"enc.{k}"), run.tensor(model, "ref", f"enc.{k}"))
        assert (run.store / name / FILE_NAME).is_file()


@pytest.mark.parametrize("model", MODELS)
def test_the_sidecar_chat_request(run, model):
    """The chat request service/handoff/sidecar.py posts (recorded from the HTTP hop) is one vLLM accepts and
    serves from the shared folder."""
    case = run.case(model, "chat")
    assert case["ok"], case.get("error")
    assert case["has_cache"] == [True] * 3
    assert [f["modality"] for f in case["features"]] == ["image", "image", "video"]


@pytest.mark.parametrize("kwargs", ["media_io_kwargs", "mm_processor_kwargs"])
@pytest.mark.parametrize("model", MODELS)
def test_request_kwargs_make_vllm_hash_the_uuid(run, model, kwargs):
    """vLLM uses the uuid verbatim only without hash factors (ProcessorInputs.get_mm_hashes): with the
    request's media_io_kwargs or mm_processor_kwargs it looks for another folder, and finds nothing."""
    case = run.case(model, kwargs)
    assert case["ok"], case.get("error")
    uuids = [e["content_part"]["uuid"] for e in run.http[model]["ref"]["body"]["data"]]
    identifiers = [f["identifier"] for f in case["features"]]
    hashed = [i != u for i, u in zip(identifiers, uuids)]
    # media_io_kwargs for images change the images' identifiers only; processor kwargs change every one
    assert hashed == ([True, True, False] if kwargs == "media_io_kwargs" else [True, True, True])
    assert case["has_cache"] == [not h for h in hashed]


@pytest.mark.parametrize("model", MODELS)
def test_reference_parts_need_an_encoder_cache_consumer(run, model):
    case = run.case(model, "ref_without_consumer")
    assert not case["ok"] and "should contain the fields" in case["error"]


def test_qwen3_video_parts_need_timestamps(run):
    """Without `timestamps` vLLM 0.33.0 refuses a Qwen3-VL video part; vitserve's carry one per grid step."""
    case = run.case("tiny-qwen3-vl", "no_timestamps")
    assert not case["ok"] and "timestamps" in case["error"]
    entry = run.http["tiny-qwen3-vl"]["vllm"]["body"]["data"][2]
    assert len(entry["content_part"]["video_embeds"]["timestamps"]) == entry["grid_thw"][0]
    # vLLM sized the placeholder with them: its prompt text holds one "<t seconds>" per step around the tokens
    video = run.case("tiny-qwen3-vl", "embeds")["features"][2]
    assert video["length"] > video["num_embeds"]


def test_qwen25_video_off_two_fps_is_flagged(run):
    """vLLM keeps no second_per_grid_ts for Qwen2.5-VL video embeddings (M-RoPE then takes 1.0): the part is
    accepted, the field never reaches the model, and vitserve's response says so."""
    case = run.case("tiny-qwen2.5-vl", "slow")
    assert case["ok"], case.get("error")
    assert case["features"][0]["data_keys"] == ["video_embeds", "video_grid_thw"]
    entry = run.http["tiny-qwen2.5-vl"]["slow"]["body"]["data"][0]
    assert entry["second_per_grid_ts"] == 2.0 and "second_per_grid_ts" in entry["warnings"][0]
    assert "warnings" not in run.http["tiny-qwen2.5-vl"]["vllm"]["body"]["data"][2]  # 2 fps: exact


def test_vllm_cuts_a_longer_cached_tensor_silently(run):
    """Why the grid must come from the producer: a placeholder sized from a smaller grid than the file's
    tensor is accepted without a word and only its first rows are used."""
    case = run.case("tiny-qwen2.5-vl", "short_grid")
    assert case["ok"], case.get("error")
    (feature,) = case["features"]
    loaded = run.tensor("tiny-qwen2.5-vl", "short_grid", "enc.0")
    assert feature["num_embeds"] < loaded.shape[0]
    assert run.tensor("tiny-qwen2.5-vl", "short_grid", "merged.0").shape[0] == feature["num_embeds"]


def test_one_folder_serves_several_models_and_settings(run):
    """The same bytes under three models, and under another max_pixels, are different entries."""
    per_model = [[e["content_id"] for e in run.http[m]["ref"]["body"]["data"]] for m in MODELS]
    assert len({cid for ids in per_model for cid in ids}) == 9
    small = [run.http[m]["small"]["body"]["data"][0] for m in MODELS]
    assert all(s["content_id"] not in ids for s, ids in zip(small, per_model))
    assert all(s["grid_thw"] != run.http[m]["ref"]["body"]["data"][0]["grid_thw"] for s, m in zip(small, MODELS))
    folders = {p.name for p in run.store.iterdir()}
    assert {cid for ids in per_model for cid in ids} <= folders
