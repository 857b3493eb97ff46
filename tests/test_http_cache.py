"""The encoder-output cache and the shared encoder-cache folder through the HTTP API (real servers on
loopback): hits skip the engine and return the same tensors, ids name model, options and bytes, the folder
is written atomically, bounded, and a full disk is a 507."""

from __future__ import annotations

import base64
import errno
import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors import safe_open

from service import shm
from service.handoff import ec_storage
from service.handoff.ec_storage import FILE_NAME, TENSOR_KEY
from tests.http_helpers import ServerThread, b64, image_bytes, settings, shm_entries
from tests.videos import make_video

JPEG = image_bytes(448, 448, seed=5, fmt="JPEG")
PNG = image_bytes(96, 64, seed=6)
VIDEO = make_video(8, fps=4, width=64, height=48)


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def encode(client: httpx.Client, items: list[dict], **options) -> httpx.Response:
    r = client.post("/encode", json={"items": items, **options})
    assert r.status_code == 200, r.text
    return r


def rows(entry: dict, dtype: str = "float32") -> np.ndarray:
    raw = base64.b64decode(entry["embedding"])
    if dtype == "bfloat16":
        return torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).reshape(entry["shape"]).float().numpy()
    return np.frombuffer(raw, "<f4").reshape(entry["shape"])


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    store = tmp_path_factory.mktemp("ec")
    cfg = settings(model="tiny-qwen3-vl", cache_bytes=32 << 20, ec_shared_storage=str(store))
    with ServerThread(cfg) as srv:
        srv.store = store  # type: ignore[attr-defined]
        yield srv


def test_a_stopped_server_leaves_no_cached_segment_behind():
    # /dev/shm outlives the server, and a server restarted under the same pid (a container's) would not
    # sweep them as a dead server's: the cache's segments go when the server stops.
    with ServerThread(settings(cache_bytes=32 << 20)) as srv, srv.client() as c:
        assert encode(c, [{"type": "image", "image": b64(JPEG)}], encoding_format="base64").status_code == 200
        prefix = srv.engine.names.prefix
        assert shm_entries(prefix, pools=False)  # the cached output, kept while serving
    assert shm_entries(prefix) == []  # and the pool of retired files


def test_a_repeated_request_is_served_from_the_cache(cached):
    items = [{"type": "image", "image": b64(JPEG)}, {"type": "video", "video": b64(VIDEO)}]
    with cached.client() as c:
        before = metrics(cached.url)
        first = encode(c, items, encoding_format="base64", include_deepstack=True)
        middle = metrics(cached.url)
        second = encode(c, items, encoding_format="base64", include_deepstack=True)
        after = metrics(cached.url)
    assert first.headers["x-vitserve-cache-hits"] == "0" and second.headers["x-vitserve-cache-hits"] == "2"
    assert first.json()["data"] == second.json()["data"]  # the very same tensors, and the same fields
    assert after["vitserve_items_total{modality=image}"] == middle["vitserve_items_total{modality=image}"]
    assert after["vitserve_cache_hits_total{source=memory}"] - middle["vitserve_cache_hits_total{source=memory}"] == 2
    assert middle["vitserve_cache_misses_total"] - before.get("vitserve_cache_misses_total", 0) == 2
    assert after["vitserve_cache_bytes{store=memory}"] > 0 and after["vitserve_cache_items{store=memory}"] >= 2
    assert "encode;dur=" in second.headers["server-timing"]


def test_a_hit_converts_like_the_engine(cached):
    """A hit in another dtype, or another format, equals what the engine gives for that request."""
    item = [{"type": "image", "image": b64(PNG)}]
    with cached.client() as c:
        engine_bf16 = encode(c, item, encoding_format="base64", dtype="bfloat16", include_deepstack=True)
        hit_fp32 = encode(c, item, encoding_format="base64", include_deepstack=True)
        hit_bf16 = encode(c, item, encoding_format="base64", dtype="bfloat16", include_deepstack=True)
        hit_float = encode(c, item, encoding_format="float")
    assert engine_bf16.headers["x-vitserve-cache-hits"] == "0"
    assert hit_fp32.headers["x-vitserve-cache-hits"] == hit_bf16.headers["x-vitserve-cache-hits"] == "1"
    assert hit_bf16.json()["data"] == engine_bf16.json()["data"]
    fp32, bf16 = hit_fp32.json()["data"][0], hit_bf16.json()["data"][0]
    np.testing.assert_array_equal(rows(bf16, "bfloat16"),
                                  torch.from_numpy(rows(fp32).copy()).to(torch.bfloat16).float().numpy())
    assert np.array_equal(np.array(hit_float.json()["data"][0]["embedding"], np.float32), rows(fp32))


def test_options_and_repeats_within_a_request(cached):
    with cached.client() as c:
        before = metrics(cached.url)
        r = encode(c, [{"type": "image", "image": b64(JPEG), "max_pixels": 200000},
                       {"type": "image", "image": b64(JPEG), "max_pixels": 200000},
                       {"type": "image", "image": b64(JPEG)}])
        after = metrics(cached.url)
    a, b, c_ = r.json()["data"]
    assert a["content_id"] == b["content_id"] != c_["content_id"]  # another max_pixels, another id
    assert a["embedding"] == b["embedding"] and a["grid_thw"] != c_["grid_thw"]
    # the repeat ran once; the default-options item was cached by the first test
    assert after["vitserve_cache_misses_total"] - before["vitserve_cache_misses_total"] == 1
    assert r.headers["x-vitserve-cache-hits"] == "2"


def test_concurrent_identical_requests(cached):
    item = [{"type": "image", "image": b64(image_bytes(120, 90, seed=77))}]
    with cached.client() as c:
        reference = encode(c, item, encoding_format="base64").json()["data"]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: httpx.post(cached.url + "/encode", json={"items": item,
                                                                                  "encoding_format": "base64"},
                                                     timeout=60), range(16)))
    assert all(a.status_code == 200 and a.json()["data"] == reference for a in answers)


def test_vllm_ref_writes_files_once_and_hits_them_after_a_restart(cached, tmp_path):
    items = [{"type": "image", "image": b64(PNG)}, {"type": "image", "image": b64(JPEG), "id": "cat-1"}]
    with cached.client() as c:
        r = encode(c, items, encoding_format="vllm_ref")
    first, named = r.json()["data"]
    assert first["content_part"]["uuid"] == first["content_id"] and named["content_part"]["uuid"] == "cat-1"
    for uuid in (first["content_id"], "cat-1"):
        path = cached.store / uuid / FILE_NAME
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~ec_storage.process_umask()
        with safe_open(str(path), framework="pt") as f:
            assert list(f.keys()) == [TENSOR_KEY]
            meta = f.metadata()
            assert f.get_tensor(TENSOR_KEY).shape == (first["num_tokens"] if uuid != "cat-1" else named["num_tokens"],
                                                      80 * 3)
        assert meta["model"] == "tiny-qwen3-vl" and json.loads(meta["grid_thw"])
        assert [p.name for p in path.parent.iterdir()] == [FILE_NAME]
    mtime = (cached.store / "cat-1" / FILE_NAME).stat().st_mtime_ns
    with cached.client() as c:
        encode(c, items, encoding_format="vllm_ref")  # valid files: touched, not rewritten
    assert (cached.store / "cat-1" / FILE_NAME).stat().st_mtime_ns >= mtime

    # A new server on the same folder, its memory cache empty: the files are hits.
    cfg = settings(model="tiny-qwen3-vl", cache_bytes=32 << 20, ec_shared_storage=str(cached.store))
    with ServerThread(cfg) as srv, srv.client() as c:
        again = encode(c, items, encoding_format="base64", include_deepstack=True)
        m = metrics(srv.url)
    assert again.headers["x-vitserve-cache-hits"] == "2" and m["vitserve_cache_hits_total{source=storage}"] == 2
    with cached.client() as c:
        fresh = encode(c, items, encoding_format="base64", include_deepstack=True)
    assert again.json()["data"] == fresh.json()["data"]


def test_a_stale_file_under_an_id_is_replaced(cached):
    with cached.client() as c:
        encode(c, [{"type": "image", "image": b64(PNG), "id": "reused"}], encoding_format="vllm_ref")
        other = encode(c, [{"type": "image", "image": b64(JPEG), "id": "reused"}], encoding_format="vllm_ref")
    with safe_open(str(cached.store / "reused" / FILE_NAME), framework="pt") as f:
        assert f.metadata()["content_id"] == other.json()["data"][0]["content_id"]


def test_another_model_never_takes_a_file(cached, tmp_path):
    """Same folder, same bytes, same id: a Qwen2-VL server does not serve Qwen3-VL's file."""
    with cached.client() as c:
        encode(c, [{"type": "image", "image": b64(PNG), "id": "shared-id"}], encoding_format="vllm_ref")
    cfg = settings(model="tiny-qwen2-vl", cache_bytes=32 << 20, ec_shared_storage=str(cached.store))
    with ServerThread(cfg) as srv, srv.client() as c:
        r = encode(c, [{"type": "image", "image": b64(PNG), "id": "shared-id"}], encoding_format="vllm_ref")
    assert r.headers["x-vitserve-cache-hits"] == "0"
    with safe_open(str(cached.store / "shared-id" / FILE_NAME), framework="pt") as f:
        assert f.metadata()["model"] == "tiny-qwen2-vl" and f.get_tensor(TENSOR_KEY).shape[1] == 96


def test_a_full_disk_is_a_507_and_leaves_nothing(tmp_path, monkeypatch):
    store = tmp_path / "ec"
    with ServerThread(settings(ec_shared_storage=str(store), cache_bytes=1 << 20)) as srv, srv.client() as c:
        real_writev = os.writev

        def full(fd: int, buffers: object) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(ec_storage.os, "writev", full)
        r = c.post("/encode", json={"items": [{"type": "image", "image": b64(PNG)}], "encoding_format": "vllm_ref"})
        assert r.status_code == 507
        assert r.json()["error"]["type"] == "insufficient_storage" and "full" in r.json()["error"]["message"]
        assert list(store.iterdir()) == []
        monkeypatch.setattr(ec_storage.os, "writev", real_writev)
        r = c.post("/encode", json={"items": [{"type": "image", "image": b64(PNG)}], "encoding_format": "vllm_ref"})
        assert r.status_code == 200 and r.headers["x-vitserve-cache-hits"] == "1"  # the output had been cached
        assert metrics(srv.url)["vitserve_ec_storage_write_errors_total"] == 1


def test_the_folder_is_bounded(tmp_path):
    store = tmp_path / "ec"
    cfg = settings(ec_shared_storage=str(store), ec_max_bytes=12_000, cache_bytes=0)  # files of about 5 kB
    with ServerThread(cfg) as srv, srv.client() as c:
        srv.app.state.service.handoff.storage.grace_s = 0  # no consumer reads here: trim at once
        names = []
        for seed in range(6):
            item = {"type": "image", "image": b64(image_bytes(120, 90, seed=seed))}
            names.append(encode(c, [item], encoding_format="vllm_ref").json()["data"][0]["content_part"]["uuid"])
        info = c.get("/info").json()["cache"]
    left = sorted(p.name for p in store.iterdir())
    assert left == sorted(names[-2:])  # oldest first out
    assert sum((store / n / FILE_NAME).stat().st_size for n in left) <= 12_000
    assert info["storage"]["evictions"] == 4 and info["ec_max_bytes"] == 12_000 and info["cache_bytes"] == 0


def test_memory_bound_evicts():
    with ServerThread(settings(cache_bytes=20_000)) as srv, srv.client() as c:
        for seed in range(4):  # each entry: 24 x 96 floats and a little bookkeeping, about 9.7 kB
            encode(c, [{"type": "image", "image": b64(image_bytes(160, 120, seed=seed))}])
        m = metrics(srv.url)
        info = c.get("/info").json()["cache"]
    assert m["vitserve_cache_bytes{store=memory}"] <= 20_000 and m["vitserve_cache_items{store=memory}"] == 2
    assert m["vitserve_cache_evictions_total{store=memory}"] == 2
    assert info["memory"]["max_bytes"] == 20_000 and info["ec_shared_storage"] is None


@pytest.mark.parametrize("where", ["worker", "server"])
def test_repeats_without_a_cache_share_one_output_until_the_response_is_encoded(where, monkeypatch):
    """vLLM's formats key items by content: a repeat shares the first one's output. An output read by one
    encoder only is retired by that encoder; a shared one stays until the response is encoded."""
    from service.http import service as http_service

    monkeypatch.setattr(http_service, "renders_here", lambda *args: where == "server")  # which encoder runs
    with ServerThread(settings(cache_bytes=0)) as srv, srv.client() as c:
        prefix = srv.engine.names.prefix
        for items in ([JPEG, JPEG, PNG], [PNG], [JPEG, PNG, JPEG, JPEG]):
            r = encode(c, [{"type": "image", "image": b64(data)} for data in items], encoding_format="vllm")
            parts = [entry["content_part"] for entry in r.json()["data"]]
            for i, a in enumerate(items):
                for j, b in enumerate(items):
                    assert (parts[i] == parts[j]) == (a == b)  # a repeat gets the first one's embedding
            assert shm_entries(prefix, pools=False) == []  # every output gone with its response


@pytest.mark.parametrize("where", ["worker", "server"])
def test_pixels_and_outputs_are_written_into_retired_files_without_mixing_answers(where, monkeypatch):
    """The engine retires the pixels it has read and the encoder the output it has encoded; the next writes
    take those files (service.shm.retire). Answers of different sizes, one after another, stay exact, and
    the pool holds a few files rather than one per segment written."""
    from service.http import service as http_service

    monkeypatch.setattr(http_service, "renders_here", lambda *args: where == "server")
    images = [JPEG, image_bytes(320, 240, seed=7, fmt="JPEG"), image_bytes(640, 448, seed=8, fmt="JPEG")]
    with ServerThread(settings(cache_bytes=0)) as srv, srv.client() as c:
        prefix = srv.engine.names.prefix
        def embedding(data: bytes) -> np.ndarray:
            r = encode(c, [{"type": "image", "image": b64(data)}], encoding_format="base64")
            return rows(r.json()["data"][0])

        first = [embedding(data) for data in images]
        for k in range(12):
            np.testing.assert_array_equal(embedding(images[k % 3]), first[k % 3])
        sizes = [int(p.split("_")[0]) for p in os.listdir(shm.SHM_DIR / (prefix + shm.POOL))]
        # pixels and outputs of the three sizes, taken again and again, and a spare of each output's
        # (shm.Stocker: the requests come one at a time)
        assert 2 <= len(sizes) <= 9, sizes
        assert shm_entries(prefix, pools=False) == []
    assert shm_entries(prefix) == []  # the pool goes with the server
