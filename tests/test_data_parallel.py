"""`--data-parallel`: engine processes behind one front, here two CPU engines, over real HTTP.

Starting a server spawns two engines that each import torch and transformers (seconds on two
cores), so one server process serves the whole module, in file order: spreading, parity, an engine
killed, then SIGTERM with the engine left (run alone, a test gets a fresh server).
"""

from __future__ import annotations

import base64
import glob
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from graphs.runner import GraphRunner, plan_for
from models.loader import load_tower
from service import settings as settings_module
from service.media.image_preprocess import preprocess_image_bytes
from service.settings import ServeSettings, SettingsError
from service.shm import PREFIX as SEGMENT_PREFIX
from tests.http_helpers import SubprocessServer, b64, image_bytes, shm_entries

BUDGET = 256
DELAY_MS = 300  # per batch, in the engine: keeps batches in flight long enough to kill one
SIZES = [(200, 150), (90, 120), (64, 64), (150, 150), (120, 200)]


def body(k: int) -> dict:
    return {"items": [{"type": "image", "image": b64(image_bytes(*SIZES[(k + j) % len(SIZES)], seed=10 * k + j))}
                      for j in range(2)], "encoding_format": "base64"}


def embeddings(response: httpx.Response) -> list[np.ndarray]:
    return [np.frombuffer(base64.b64decode(d["embedding"]), "<f4").reshape(d["shape"]) for d in response.json()["data"]]


def metric(url: str, name: str) -> dict[str, float]:
    """`name{gpu="i"} v` lines of /metrics -> {"i": v}."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('gpu="')[1].split('"')[0]] = float(value)
    return out


def in_flight(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vitserve_requests_in_flight "):
            return float(line.split()[1])
    return 0.0


def segments(pid: int, pools: bool = True) -> list[str]:
    return shm_entries(f"{SEGMENT_PREFIX}{pid}_", pools)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference() -> GraphRunner:
    """The single engine: the same model, plan and graphs, in this process."""
    tower = load_tower("tiny-qwen2-vl", device="cpu", dtype="float32")
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower, BUDGET, max_items=2))
    runner.capture()
    return runner


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def engine_threads(url: str) -> int:
    """The CPU threads the served engines run with: a CPU reduction's result depends on how many threads
    split it, so the reference must use as many to be equal bit for bit."""
    counts = {e["threads"] for e in httpx.get(url + "/info", timeout=10).json()["engines"]}
    assert len(counts) == 1 and None not in counts, counts
    return counts.pop()


def expected(runner: GraphRunner, k: int, threads: int) -> list[np.ndarray]:
    """What one engine running `threads` threads returns for request `k` alone: its items packed and run
    together."""
    visuals = [preprocess_image_bytes(base64.b64decode(it["image"]), runner.tower.processor) for it in body(k)["items"]]
    with torch_threads(threads):
        return [out.embeds.numpy() for out in runner.encode(visuals)]


@pytest.fixture(scope="module")
def served():
    env = {"VITSERVE_MAX_WAIT_MS": "0"}
    # Two items a batch: a request's items make separate batches, so work stays in flight a while.
    with SubprocessServer("--data-parallel", "2", "--max-batch-tokens", str(BUDGET), "--max-batch-items", "2",
                          env=env, batch_delay_ms=DELAY_MS) as srv:
        yield srv


def test_settings_validate_the_engine_count(monkeypatch):
    def make(**flags) -> ServeSettings:
        return ServeSettings.from_sources({k: str(v) for k, v in flags.items()}, env={})

    for bad in ("0", "-1", "two"):
        with pytest.raises(SettingsError, match="--data-parallel takes a number of engines"):
            make(data_parallel=bad)
    assert make(data_parallel=3, device="cpu").engine_devices() == ["cpu"] * 3
    assert make(data_parallel="auto", device="cpu").engine_devices() == ["cpu"]  # auto: GPUs; one CPU engine
    assert make(data_parallel=1, device="cuda:1").engine_devices() == ["cuda:1"]  # in-process, as before
    monkeypatch.setattr(settings_module, "visible_gpus", lambda: 2)
    assert make(data_parallel=2, device="cuda").engine_devices() == ["cuda:0", "cuda:1"]
    assert make(data_parallel="auto").engine_devices() == ["cuda:0", "cuda:1"]
    with pytest.raises(SettingsError, match="needs as many GPUs, but 2 are visible"):
        make(data_parallel=3, device="cuda")
    with pytest.raises(SettingsError, match="names one GPU"):
        make(data_parallel=2, device="cuda:1")
    monkeypatch.setattr(settings_module, "visible_gpus", lambda: 1)
    assert make(data_parallel="auto").engine_devices() == ["auto"]  # one GPU: the in-process engine


def test_concurrent_requests_spread_over_both_engines(served, reference):
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda k: httpx.post(served.url + "/encode", json=body(k), timeout=60), range(8)))
    assert [r.status_code for r in responses] == [200] * 8
    for k, r in enumerate(responses):  # batched differently from the reference: equal to rounding
        for got, want in zip(embeddings(r), expected(reference, k, engine_threads(served.url))):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    batches = metric(served.url, "vitserve_engine_batches_total")
    items = metric(served.url, "vitserve_engine_items_total")
    assert set(batches) == {"0", "1"} and min(batches.values()) >= 1, batches
    assert sum(items.values()) == 16 and min(items.values()) >= 1, items
    assert min(metric(served.url, "vitserve_engine_graph_hits_total").values()) >= 1
    assert metric(served.url, "vitserve_engine_up") == {"0": 1.0, "1": 1.0}
    ready = httpx.get(served.url + "/ready").json()
    assert ready == {"status": "ready", "engines": 2, "engines_up": 2, "degraded": False}


def test_every_item_equals_the_single_engine_answer(served, reference):
    # One request at a time packs exactly as the reference does: the same batches, bit for bit.
    threads = engine_threads(served.url)
    with httpx.Client(base_url=served.url, timeout=60) as client:
        for k in range(4):
            r = client.post("/encode", json=body(k))
            assert r.status_code == 200
            for got, want in zip(embeddings(r), expected(reference, k, threads)):
                np.testing.assert_array_equal(got, want)
        info = client.get("/info").json()
    assert info["data_parallel"] == 2 and [e["state"] for e in info["engines"]] == ["ready", "ready"]
    assert info["graphs"]["mode"] == "cpu_fixed_shape" and info["captured"] == []  # the CPU: no CUDA graphs
    assert info["pool"]["graph_items"] >= 8


def test_killed_engine_fails_its_batches_the_others_keep_serving_and_it_comes_back(served, reference):
    url = served.url
    threads = engine_threads(url)
    victim = httpx.get(url + "/info").json()["engines"][1]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(httpx.post, url + "/encode", json=body(k), timeout=60) for k in range(6)]
        wait_for(lambda: metric(url, "vitserve_engine_outstanding_tokens").get("1", 0) > 0, 20,
                 "engine 1 never got work")
        killed = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        responses = [f.result(timeout=30) for f in futures]
        elapsed = time.monotonic() - killed
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503} and 503 in statuses, statuses
    assert elapsed < 10  # failed at once, not after the request timeout
    for r in responses:
        if r.status_code == 503:
            assert r.json()["error"]["type"] == "engine_failed" and "engine 1" in r.json()["error"]["message"]
            assert r.headers["retry-after"] == "1"
    assert httpx.get(url + "/ready").status_code == 200  # engine 0 serves meanwhile
    for k in range(2):
        r = httpx.post(url + "/encode", json=body(k), timeout=60)
        assert r.status_code == 200
    # The dead engine is started again (weights loaded anew), with no restart of the server.
    wait_for(lambda: [e["state"] for e in httpx.get(url + "/info").json()["engines"]] == ["ready", "ready"], 120,
             "engine 1 did not come back")
    info = httpx.get(url + "/info").json()
    assert info["engines"][1]["pid"] != victim["pid"] and info["engine_restarts"] == 1
    assert metric(url, "vitserve_engine_up") == {"0": 1.0, "1": 1.0}
    assert "vitserve_engine_restarts_total 1.0" in httpx.get(url + "/metrics").text
    ready = httpx.get(url + "/ready")
    assert ready.status_code == 200 and ready.json()["engines_up"] == 2 and not ready.json()["degraded"]
    for k in range(3):
        r = httpx.post(url + "/encode", json=body(k), timeout=60)
        assert r.status_code == 200
        for got, want in zip(embeddings(r), expected(reference, k, threads)):
            np.testing.assert_array_equal(got, want)
    assert segments(served.proc.pid, pools=False) == []  # the dead engine's segments were unlinked


def children(pid: int) -> set[int]:
    out = set()
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.split("/")[2]))
    return out


def gone(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"  # exited; reaping is up to whoever inherited it


def test_sigterm_drains_stops_the_engines_and_leaks_nothing(served):
    srv = served
    pid = srv.proc.pid
    engines = {e["pid"] for e in httpx.get(srv.url + "/info", timeout=10).json()["engines"] if e["state"] == "ready"}
    kids = children(pid)
    assert engines and engines <= kids
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(httpx.post, srv.url + "/encode", json=body(k), timeout=60) for k in range(6)]
        # on a loaded machine an early request may finish before the last one arrives: it still counts
        wait_for(lambda: in_flight(srv.url) + sum(f.done() for f in futures) == 6, 60,
                 "requests never got in flight")
        srv.terminate()
        responses = [f.result(timeout=60) for f in futures]
    code, log = srv.wait(timeout=60)
    assert [r.status_code for r in responses] == [200] * 6  # none lost
    assert code == 0, log
    assert "draining" in log and "stopped: 2 engine(s)" in log
    wait_for(lambda: all(gone(p) for p in kids), 10, f"children of the server still run: {kids}")
    assert segments(pid) == []


def test_the_cache_and_the_shared_folder_behind_engine_processes(tmp_path, reference):
    """The served-dtype output the cache keeps comes back through the engines' shared memory: a miss, the
    file it leaves for vLLM and the hit after it hold the single engine's values."""
    store = tmp_path / "ec"
    with SubprocessServer("--data-parallel", "2", "--max-batch-tokens", str(BUDGET), "--max-batch-items", "2",
                          "--cache-bytes", str(1 << 26), "--ec-shared-storage", str(store)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        threads = engine_threads(srv.url)
        miss = c.post("/encode", json={**body(0), "encoding_format": "vllm_ref"})
        hit = c.post("/encode", json=body(0))
    assert miss.headers["x-vitserve-cache-hits"] == "0" and hit.headers["x-vitserve-cache-hits"] == "2"
    for got, want, entry in zip(embeddings(hit), expected(reference, 0, threads), miss.json()["data"]):
        np.testing.assert_array_equal(got, want)
        path = store / entry["content_part"]["uuid"] / "encoder_cache.safetensors"
        np.testing.assert_array_equal(load_file(str(path))["ec_cache"].numpy(), want)


def test_every_engine_learns_a_recurring_size_and_a_restarted_one_learns_it_again():
    """Lone 80-token images (between the budgets 64 and 128): the front teaches both engine processes a budget of
    80, one after the other, and packs into it once both have it. An engine killed afterwards comes back
    without it (a new process) and is taught it again before its first batch: its answers stay the same bytes
    and no batch falls back to eager."""
    lone = {"items": [{"type": "image", "image": b64(image_bytes(280, 224, seed=5))}], "encoding_format": "base64"}
    env = {"VITSERVE_MAX_WAIT_MS": "0", "VITSERVE_TEST_LEDGER_EVERY": "24"}
    with SubprocessServer("--data-parallel", "2", env=env, launcher="tests.hooks.quick_learner") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        first = c.post("/encode", json=lone)  # in the 128-token graph
        for _ in range(24):
            assert c.post("/encode", json=lone).status_code == 200
        wait_for(lambda: c.get("/info").json()["learned_budgets"]["learned"] == [80], 60, "80 was not learned")
        info = c.get("/info").json()
        assert info["budgets"] == [64, 80, 128, 256, 512, 1024]
        assert [e["learned_budgets"] for e in info["engines"]] == [[80], [80]]
        victim = info["engines"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        # a new process (the front may not have seen the old one go yet), ready, that has learned 80 again
        wait_for(lambda: [(e["pid"] != victim["pid"], e["state"], e["learned_budgets"])
                          for e in c.get("/info").json()["engines"]][0] == (True, "ready", [80]), 120,
                 "engine 0 did not come back and learn 80 again")
        assert c.get("/info").json()["engines"][1]["learned_budgets"] == [80]
        before = c.get("/info").json()["pool"]
        answers = [c.post("/encode", json=lone) for _ in range(4)]
        pool = c.get("/info").json()["pool"]
    def replays_80(stats: dict) -> int:
        return sum(n for key, n in stats["replays"].items() if key.startswith("image/b80/"))

    assert replays_80(pool) - replays_80(before) == 4, [r.text[:200] for r in answers]
    assert "no_graph" not in pool["eager_items"], pool["eager_items"]
    for r in answers:
        assert r.status_code == 200 and embeddings(r)[0].tobytes() == embeddings(first)[0].tobytes()
