"""`vllm_ref` without a shared folder: outputs held in the encoder-output cache and fetched by the LLM server
from `GET /v1/encoder_cache/{id}` (real servers on loopback): the body is the folder's file, an unknown id is
a counted 404, the API key applies, an answered output outlives the cache's bound for the fetch."""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file

from service.handoff.ec_storage import FILE_NAME, TENSOR_KEY
from tests.http_helpers import ServerThread, b64, image_bytes, settings, slow_engine
from tests.test_http_cache import metrics

PNG = image_bytes(96, 64, seed=31)
JPEG = image_bytes(160, 120, seed=32, fmt="JPEG")


def ref(client: httpx.Client, data: bytes, **item) -> dict:
    r = client.post("/encode", json={"items": [{"type": "image", "image": b64(data), **item}],
                                     "encoding_format": "vllm_ref"})
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["content_part"]


def test_fetch_serves_exactly_the_folders_file(tmp_path):
    """The same model in two servers: one writes the folder, one only holds outputs; the fetched body holds
    the very tensor and metadata of the file."""
    store = tmp_path / "ec"
    with ServerThread(settings(model="tiny-qwen3-vl", ec_shared_storage=str(store), cache_bytes=0)) as srv, \
            srv.client() as c:
        uuid = ref(c, JPEG)["uuid"]
    on_disk = load_file(str(store / uuid / FILE_NAME))
    with safe_open(str(store / uuid / FILE_NAME), framework="pt") as st:
        disk_meta = st.metadata()
    with ServerThread(settings(model="tiny-qwen3-vl", cache_bytes=8 << 20)) as srv, srv.client() as c:
        part = ref(c, JPEG)
        assert part["uuid"] == uuid
        t, h, w = part["image_embeds"]["image_grid_thw"]
        r = c.get(f"/v1/encoder_cache/{uuid}")
        assert r.status_code == 200 and r.headers["content-type"] == "application/vnd.safetensors"
        assert "server-timing" in r.headers
        fetched = load(r.content)
        assert list(fetched) == [TENSOR_KEY]
        assert torch.equal(fetched[TENSOR_KEY], on_disk[TENSOR_KEY])
        assert fetched[TENSOR_KEY].shape[0] == t * h * w // 4
        path = tmp_path / "fetched.safetensors"
        path.write_bytes(r.content)
        with safe_open(str(path), framework="pt") as st:
            assert st.metadata() == disk_meta
        missing = c.get("/v1/encoder_cache/vit-" + "0" * 64)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_id"
        assert c.get("/v1/encoder_cache/..%2Fetc").status_code == 404
        m = metrics(srv.url)
    assert m['vitserve_encoder_cache_fetches_total{result=hit}'] == 1
    assert m['vitserve_encoder_cache_fetches_total{result=miss}'] == 1  # the path outside the route is not a fetch


def test_a_client_id_names_the_output_and_the_api_key_applies():
    with ServerThread(settings(cache_bytes=8 << 20, api_key="k")) as srv, \
            srv.client(headers={"Authorization": "Bearer k"}) as c:
        part = ref(c, PNG, id="mine-1")
        assert part["uuid"] == "mine-1"
        by_id = c.get("/v1/encoder_cache/mine-1")
        assert by_id.status_code == 200
        cache = srv.app.state.service.handoff.cache
        deadline = time.monotonic() + 5
        while cache._pins and time.monotonic() < deadline:  # the body is sent from the segment, then unpinned
            time.sleep(0.01)
        assert not cache._pins
        assert httpx.get(srv.url + "/v1/encoder_cache/mine-1").status_code == 401
        r = c.post("/encode", json={"items": [{"type": "image", "image": b64(PNG)}], "encoding_format": "base64"})
        got = load(by_id.content)[TENSOR_KEY]
    entry = r.json()["data"][0]
    want = np.frombuffer(base64.b64decode(entry["embedding"]), "<f4").reshape(entry["shape"])
    np.testing.assert_array_equal(got.numpy(), want)


def test_answered_outputs_are_held_past_the_bound_for_the_fetch():
    # Each entry is about 9.7 kB (24 x 96 floats): a bound of 20 kB holds two, the holds keep all four.
    with ServerThread(settings(cache_bytes=20_000)) as srv, srv.client() as c:
        uuids = [ref(c, image_bytes(160, 120, seed=40 + k))["uuid"] for k in range(4)]
        assert all(c.get(f"/v1/encoder_cache/{u}").status_code == 200 for u in uuids)
        info = c.get("/info").json()["cache"]["memory"]
        assert info["held"] == 4 and info["bytes"] <= 2 * 20_000
        # Without the hold the oldest go first, as for any other format.
        srv.app.state.service.handoff.cache.hold_s = 0
        srv.app.state.service.handoff.cache._held.clear()
        c.post("/encode", json={"items": [{"type": "image", "image": b64(image_bytes(160, 120, seed=50))}]})
        assert c.get(f"/v1/encoder_cache/{uuids[0]}").status_code == 404


def test_an_output_the_cache_cannot_hold_is_refused_without_a_folder():
    with ServerThread(settings(cache_bytes=1024)) as srv, srv.client() as c:  # one output: 2.3 kB
        r = c.post("/encode", json={"items": [{"type": "image", "image": b64(PNG)}], "encoding_format": "vllm_ref"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "too_large_for_cache"


def test_vllm_ref_needs_the_cache_or_the_folder():
    with ServerThread(settings(cache_bytes=0)) as srv, srv.client() as c:
        r = c.post("/encode", json={"items": [{"type": "image", "image": b64(PNG)}], "encoding_format": "vllm_ref"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "storage_not_configured"


def test_identical_items_in_flight_are_encoded_once(monkeypatch):
    """8 concurrent requests with the same new image: one encode, the 7 others wait for it (coalesced) and
    answer its very rows."""
    slow_engine(monkeypatch, 0.5)  # the first encode is still running when the others arrive
    image = b64(image_bytes(128, 96, seed=90))
    with ServerThread(settings(cache_bytes=8 << 20)) as srv:

        def one(_: int) -> httpx.Response:
            return httpx.post(srv.url + "/encode", json={"items": [{"type": "image", "image": image}],
                                                         "encoding_format": "base64"}, timeout=60)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, range(8)))
        m = metrics(srv.url)
    assert [r.status_code for r in answers] == [200] * 8
    assert m["vitserve_cache_misses_total"] == 1 and m["vitserve_items_total{modality=image}"] == 1
    assert m["vitserve_cache_coalesced_total"] + m["vitserve_cache_hits_total{source=memory}"] == 7
    assert m["vitserve_cache_coalesced_total"] >= 5  # the requests overlapped the half-second encode
    assert sorted(r.headers["x-vitserve-cache-hits"] for r in answers) == ["0"] + ["1"] * 7
    assert len({r.json()["data"][0]["embedding"] for r in answers}) == 1
