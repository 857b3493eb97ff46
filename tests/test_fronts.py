"""`--fronts`: one HTTP front process per engine on one port, here two CPU engines over real HTTP.

Each front imports torch and loads its engine (seconds on two cores), so one server serves the traffic
tests and is then stopped with SIGTERM; a second one has a front killed under it."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.preflight import EXIT_FAILED
from service.settings import ServeSettings, SettingsError
from tests.http_helpers import SubprocessServer, b64, image_bytes

# The cache on (each front keeps its share): vllm_ref answers from it, and each front's engine still encodes
# the traffic test's image once.
FLAGS = ("--data-parallel", "2", "--fronts", "2", "--preprocess-workers", "2", "--cache-bytes", str(64 << 20))
BODY = {"items": [{"type": "image", "image": b64(image_bytes(96, 64, seed=3))}], "encoding_format": "base64"}


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


@pytest.fixture(scope="module")
def server():
    with SubprocessServer(*FLAGS) as srv:
        yield srv


def test_two_fronts_share_the_port_and_answer_alike(server):
    def post(_: int) -> httpx.Response:
        with httpx.Client(timeout=60) as c:  # a connection each: the kernel spreads connections, not requests
            return c.post(server.url + "/encode", json=BODY)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(post, range(32)))
    assert [r.status_code for r in responses] == [200] * 32
    assert len({r.json()["data"][0]["embedding"] for r in responses}) == 1  # both engines, one answer
    served = {labels["front"]: value for labels, value in
              samples(httpx.get(server.url + "/metrics").text, "vitserve_requests_total") if labels["status"] == "200"}
    assert set(served) == {"0", "1"} and all(v > 0 for v in served.values()), served
    assert sum(served.values()) == 32


def test_metrics_cover_every_front_and_scope_front_one(server):
    merged = httpx.get(server.url + "/metrics")
    assert merged.status_code == 200 and "x-vitserve-fronts-missing" not in merged.headers
    ready = samples(merged.text, "vitserve_ready")
    assert sorted(labels["front"] for labels, _ in ready) == ["0", "1"] and all(v == 1 for _, v in ready)
    buckets = samples(merged.text, "vitserve_request_duration_seconds_bucket")
    assert {labels["front"] for labels, _ in buckets} == {"0", "1"} and all("le" in labels for labels, _ in buckets)
    own = httpx.get(server.url + "/metrics", params={"scope": "front"}).text
    assert [labels for labels, _ in samples(own, "vitserve_ready")] == [{}]
    info = httpx.get(server.url + "/info").json()
    assert info["front"]["of"] == 2 and info["front"]["index"] in (0, 1)
    assert info["settings"]["preprocess_workers"] == 1  # each front has its share


def test_an_output_answered_by_one_front_is_served_and_checked_by_any(server):
    """vllm_ref without a folder: each front holds its own outputs; a fetch or a check that reaches the
    other front is answered through its sibling."""
    ids = []
    for k in range(6):
        with httpx.Client(timeout=60) as c:  # a connection each: either front may take it
            body = {"items": [{"type": "image", "image": b64(image_bytes(80, 64, seed=40 + k))}],
                    "encoding_format": "vllm_ref"}
            ids.append(c.post(server.url + "/encode", json=body).json()["data"][0]["content_part"]["uuid"])
    statuses = []
    for item_id in ids:
        for _ in range(3):
            with httpx.Client(timeout=60) as c:
                r = c.get(f"{server.url}/v1/encoder_cache/{item_id}")
                statuses.append(r.status_code)
                assert r.headers["content-type"] == "application/vnd.safetensors"
    assert statuses == [200] * 18
    for _ in range(4):
        with httpx.Client(timeout=60) as c:
            r = c.post(server.url + "/v1/encoder_cache/check", json={"ids": [*ids, "vit-" + "0" * 64]})
            assert r.json()["present"] == [True] * 6 + [False]
    fetched = samples(httpx.get(server.url + "/metrics").text, "vitserve_encoder_cache_fetches_total")
    assert sum(v for labels, v in fetched if labels["result"] == "hit") == 18  # counted once, by the front asked
    assert sum(v for labels, v in fetched if labels["result"] == "miss") == 0


def test_sglang_parts_and_registrations_meet_whichever_front_they_reach(server):
    """SGLang's /encode of a part and its ranks' registrations arrive on connections of their own: the front
    the part's req_id belongs to takes them all (service/http/sglang.py), whichever front they reached. These
    ids belong two to each front, and twelve connections all reaching their part's front is a 1 in 4096 chance."""
    import zmq

    from tests.test_http_sglang import Receiver, part, url

    ctx = zmq.Context()
    ranks = [Receiver(ctx), Receiver(ctx)]
    try:
        with ThreadPoolExecutor(12) as pool:
            futures = []
            for k in range(4):
                req_id = f"fronts{k}_local_part_0"
                body = part(req_id, [url(image_bytes(72, 56, seed=60 + k))])
                futures.append(pool.submit(httpx.post, server.url + "/encode", json=body, timeout=60))
                futures += [pool.submit(rank.register, server.url, req_id, 2) for rank in ranks]
            assert [f.result().status_code for f in futures] == [200] * 12
        for rank in ranks:
            for k in range(4):
                state, rows = rank.wait(f"fronts{k}_local_part_0")
                assert rows is not None and state["shape"][0] > 0
    finally:
        for rank in ranks:
            rank.close()
        ctx.destroy(linger=0)


def test_sigterm_drains_every_front_and_exits_zero(server):
    server.terminate()
    code, out = server.wait(60)
    assert code == 0, out[-2000:]
    assert out.count("draining") >= 2 and "front-0" in out and "front-1" in out


def test_a_front_that_dies_stops_the_server():
    with SubprocessServer(*FLAGS) as srv:
        fronts: dict[int, int] = {}
        deadline = time.monotonic() + 30
        while len(fronts) < 2 and time.monotonic() < deadline:
            with httpx.Client() as c:
                front = c.get(srv.url + "/info").json()["front"]
            fronts[front["index"]] = front["pid"]
        assert len(fronts) == 2
        os.kill(fronts[1], signal.SIGKILL)
        code, out = srv.wait(60)
    assert code == EXIT_FAILED
    assert "front vitserve-front-1 exited with code -9: stopping the others" in out


def test_front_settings():
    assert ServeSettings(device="cpu", data_parallel=2).front_count() == 1  # auto: several fronts for GPUs only
    s = ServeSettings(device="cpu", data_parallel=2, fronts=2, preprocess_workers=5, max_connections=100,
                      max_concurrent_requests=9, cache_bytes=2**30)
    assert s.front_count() == 2
    one = s.for_front(1, 2)
    assert (one.data_parallel, one.fronts, one.device) == (1, 1, "cpu")
    assert (one.preprocess_workers, one.max_connections, one.max_concurrent_requests, one.cache_bytes) == \
        (3, 50, 5, 2**29)
    with pytest.raises(ValueError, match="fronts are 1 or one per engine"):
        ServeSettings(device="cpu", data_parallel=2, fronts=3)


def test_the_default_worker_count_grows_with_the_engines(monkeypatch):
    """Each engine's images need their own decoding: 16 workers per engine at most, and two cores per engine
    (its front and its engine process) kept out of the count."""
    monkeypatch.setattr("service.settings.os.cpu_count", lambda: 32)
    assert ServeSettings(device="cpu").worker_processes() == 16
    two = ServeSettings(device="cpu", data_parallel=2, fronts=2)
    assert two.worker_processes() == 28
    assert two.for_front(0, 2).worker_processes() == 14
    one_front = ServeSettings(device="cpu", data_parallel=2, fronts=1)
    assert one_front.worker_processes() == one_front.public_dict()["preprocess_workers"] == 28
    assert ServeSettings(device="cpu", data_parallel=2, preprocess_workers=6).worker_processes() == 6  # as given
    monkeypatch.setattr("service.settings.os.cpu_count", lambda: 4)
    assert ServeSettings(device="cpu", data_parallel=2).worker_processes() == 2  # never below two
    with pytest.raises(SettingsError, match="--fronts"):
        ServeSettings.from_sources({"fronts": "0"})


def test_both_ctrl_c_reach_every_front_once():
    """Fronts have their own process group: a terminal's Ctrl-C reaches the supervisor only, which passes
    each one on, so the first drains every front and the second ends the drains (a lone server's way)."""
    with SubprocessServer(*FLAGS, batch_delay_ms=1500) as srv:  # each batch waits 1.5 s in its engine
        with ThreadPoolExecutor(2) as pool:
            pending = [pool.submit(httpx.post, srv.url + "/encode", json=BODY, timeout=60) for _ in range(2)]
            time.sleep(0.7)  # the requests are in their fronts' engines
            for _ in range(2):
                srv.proc.send_signal(signal.SIGINT)
                time.sleep(0.3)
            code, out = srv.wait(30)
            for f in pending:
                try:
                    f.result()
                except httpx.HTTPError:
                    pass  # cut off by the second signal
    assert out.count("passing it on to the fronts (they drain)") == 1, out[-3000:]
    assert out.count("passing it on to the fronts (they stop)") == 1, out[-3000:]
    for front in ("front-0", "front-1"):
        assert f"{front} vitserve.server: signal SIGINT: draining" in out
