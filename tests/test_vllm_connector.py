"""`VitserveConnector` judged by vLLM 0.33.0's own code, fetching from a real vitserve on loopback.

vitserve (tiny Qwen3-VL, no shared folder) answers `vllm_ref` requests and serves the outputs at
`GET /v1/encoder_cache/{id}`; tests/vllm_connector_driver.py, in vLLM's environment (VITSERVE_VLLM_PYTHON, as
for tests/test_vllm_handoff.py), builds vLLM's consumer config with the connector's `--ec-transfer-config`,
creates the connector through vLLM's factory and makes the scheduler's and the worker's calls. The chats it
parses are a client's own `vllm_ref` parts and the request vitserve's OpenAI front forwarded (captured by a
stub LLM server). One chat's connector finds vitserve through `replicas_from` (a name in a hosts file the
driver's resolver reads, tests/hooks/hosts.py) beside a member that does not answer. About 40 s on two
cores.
"""

from __future__ import annotations

import base64

import pytest
import torch
from safetensors.torch import load, load_file

from service.handoff.membership import rendezvous
from tests.checkpoints import write_vllm_model_folder
from tests.hooks import hosts
from tests.http_helpers import ServerThread, image_bytes, loopback_http_server, server_url, settings
from tests.test_vllm_handoff import Recorder, run_driver, vllm_python
from tests.videos import make_video

MODEL = "tiny-qwen3-vl"
IMAGES = [image_bytes(160, 120, seed=61, fmt="JPEG"), image_bytes(96, 96, seed=62, fmt="PNG")]
VIDEO = make_video(8, fps=4, width=64, height=48)
UNKNOWN = "vit-" + "0" * 64
RING = "vitserve-ring.test"


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    vllm_python()  # skips here, before any server starts, where vLLM's environment is not configured
    work = tmp_path_factory.mktemp("vllm-connector")
    with loopback_http_server(Recorder) as llm, \
            ServerThread(settings(model=MODEL, cache_bytes=64 << 20, api_key="secret",
                                  llm_url=server_url(llm))) as srv, \
            srv.client(headers={"Authorization": "Bearer secret"}) as c:
        llm.bodies = []  # type: ignore[attr-defined]
        proxied = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What happens?"},
            {"type": "image_url", "image_url": {"url": data_url(IMAGES[1], "image/png")}},
            {"type": "video_url", "video_url": {"url": data_url(VIDEO, "video/mp4")}}]}]})
        assert proxied.status_code == 200, proxied.text
        forwarded = llm.bodies[-1]  # type: ignore[attr-defined]
        items = [{"type": "image", "image": base64.b64encode(IMAGES[0]).decode()},
                 {"type": "image", "image": base64.b64encode(IMAGES[1]).decode()},
                 {"type": "video", "video": base64.b64encode(VIDEO).decode()}]
        r = c.post("/encode", json={"items": items, "encoding_format": "vllm_ref"})
        assert r.status_code == 200, r.text
        parts = [e["content_part"] for e in r.json()["data"]]
        served = {p["uuid"]: load(c.get(f"/v1/encoder_cache/{p['uuid']}").content)["ec_cache"] for p in parts}
        chats = [
            {"name": "ref", "messages": [{"role": "user", "content": [{"type": "text", "text": "Describe."}, *parts]}]},
            {"name": "unknown", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Describe."},
                {**parts[0], "uuid": UNKNOWN}]}]},
            {"name": "proxy", "messages": forwarded["messages"]},
        ]
        # A ring of two by DNS: vitserve, and a member whose pod is gone (nothing listens there) that comes
        # first in some ids' order and not in others'.
        uuids = [p["uuid"] for p in parts]
        dead = next(f"http://127.0.0.{k}:{srv.port}" for k in range(9, 250)
                    if 0 < sum(rendezvous([srv.url, f"http://127.0.0.{k}:{srv.port}"], u)[0] != srv.url
                               for u in uuids) < len(uuids))
        hosts.write(str(work / "hosts"), {RING: ["127.0.0.1", dead.split("//")[1].split(":")[0]]})
        chats.append({"name": "ring", "messages": chats[0]["messages"],
                      "extra": {"replicas_from": f"dns:{RING}:{srv.port}", "api_key": "secret"}})
        request = {"model_dir": str(write_vllm_model_folder(MODEL, work / MODEL)),
                   "extra": {"url": srv.url, "api_key": "secret"}, "chats": chats,
                   "tensors_out": str(work / "out.safetensors"), "hosts_file": str(work / "hosts")}
        report = run_driver("vllm_connector_driver.py", request, work, import_vitserve=True, timeout=600)
    return {"parts": parts, "served": served, "forwarded": forwarded, "report": report,
            "tensors": load_file(request["tensors_out"]), "url": srv.url, "dead": dead}


def test_created_by_vllms_factory_and_loads_exactly_what_vitserve_serves(run):
    case = run["report"]["chats"]["ref"]
    assert case["ok"], case.get("error", "") + case.get("traceback", "")
    assert case["class"] == "service.handoff.vllm_connector.VitserveConnector"
    assert case["mm_embeds_enabled"]  # vLLM turns it on for a consumer: metadata-only parts are accepted
    uuids = [p["uuid"] for p in run["parts"]]
    assert [f["identifier"] for f in case["features"]] == uuids
    assert case["ready"] and case["failed"] == [] and case["has_cache"] == [True, True, True]
    assert case["meta_items"] == 3 and case["meta_after_reset"] == 0
    assert case["loaded"] == sorted(uuids)
    for f in case["features"]:
        got = run["tensors"][f"ref.{f['identifier']}"]
        want = run["served"][f["identifier"]]
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert got.shape[0] == f["num_embeds"]  # the placeholder is exactly as long as the output


def test_an_unknown_id_is_not_in_the_cache_and_fails_its_request(run):
    case = run["report"]["chats"]["unknown"]
    assert case["ok"], case.get("error", "") + case.get("traceback", "")
    assert case["has_cache"] == [False]
    assert not case["ready"] and case["failed"] == ["req-unknown"]


def test_the_connector_imports_nothing_of_the_server(run):
    assert set(run["report"]["service_modules"]) == {"service", "service.handoff", "service.handoff.ec_client",
                                                     "service.handoff.membership", "service.handoff.vllm_connector"}


def test_a_connector_given_a_dns_name_follows_the_ring_past_a_member_that_does_not_answer(run):
    """`replicas_from`: both records are members; an id whose first replica does not answer is found on the
    next by the scheduler's check, and the worker loads it from there: the same tensors as from `url`."""
    case = run["report"]["chats"]["ring"]
    assert case["ok"], case.get("error", "") + case.get("traceback", "")
    assert sorted(case["members"]) == sorted([run["url"], run["dead"]])
    uuids = [p["uuid"] for p in run["parts"]]
    assert case["ready"] and case["failed"] == [] and case["loaded"] == sorted(uuids)
    assert {u: case["found_by_check"][u] for u in uuids} == dict.fromkeys(uuids, run["url"])
    assert case["worker_found"]["missing"] == 0 and case["worker_found"]["elsewhere"] >= 1
    for u in uuids:
        assert torch.equal(run["tensors"][f"ring.{u}"], run["served"][u])


def test_the_request_the_proxy_forwards_is_parsed_and_loaded_by_a_consumer(run):
    """The proxy's rewrite (an image, and a video with Qwen3-VL's timestamps) passes vLLM's chat parser and
    processor as an encoder-cache consumer parses it, and the connector loads every item."""
    case = run["report"]["chats"]["proxy"]
    assert case["ok"], case.get("error", "") + case.get("traceback", "")
    content = run["forwarded"]["messages"][0]["content"]
    assert [p["type"] for p in content] == ["text", "image_embeds", "video_embeds"]
    assert len(content[2]["video_embeds"]["timestamps"]) == content[2]["video_embeds"]["video_grid_thw"][0]
    uuids = [content[1]["uuid"], content[2]["uuid"]]
    assert [f["identifier"] for f in case["features"]] == uuids
    assert [f["modality"] for f in case["features"]] == ["image", "video"]
    assert case["ready"] and case["loaded"] == sorted(uuids)
    assert uuids[0] == run["parts"][1]["uuid"]  # the same picture as the client's own vllm_ref request: one id
