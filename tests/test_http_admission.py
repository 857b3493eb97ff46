"""Auth, admission (429), timeouts (504), internal failures (500), disconnects, readiness and /info."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from service.engine import backends
from service.engine.batcher import MAX_INFLIGHT
from tests.http_helpers import ServerThread, SubprocessServer, b64, image_bytes, settings, slow_engine

IMAGE = image_bytes(200, 150, seed=3)  # 35 tokens with tiny-qwen2-vl
BODY = {"items": [{"type": "image", "image": b64(IMAGE)}]}


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    text = client.get("/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


def post_in_background(url: str, pool: ThreadPoolExecutor, body=BODY, headers=None):
    return pool.submit(lambda: httpx.post(url + "/encode", json=body, headers=headers, timeout=60))


def test_api_key():
    with ServerThread(settings(api_key="s3cret")) as srv, srv.client() as c:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic s3cret"},
                        {"Authorization": "s3cret"}):
            r = c.post("/encode", json=BODY, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["type"] == "unauthorized"
        assert c.post("/encode", json=BODY, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.post("/encode", json=BODY, headers={"Authorization": "bearer s3cret"}).status_code == 200
        for path in ("/health", "/ready", "/metrics"):
            assert c.get(path).status_code == 200
        assert c.get("/info").status_code == 401
        info = c.get("/info", headers={"Authorization": "Bearer s3cret"}).json()
        assert "s3cret" not in str(info) and info["settings"]["api_key_set"] is True


def test_429_when_the_queue_is_full(monkeypatch):
    # Long enough that, on a loaded 2-core box, no batch finishes while the queue is being filled and read
    # (with 1 s one did, and the queue never reached 70 tokens).
    slow_engine(monkeypatch, 2.5)
    cfg = settings(max_queued_tokens=100, max_wait_ms=0, max_batch_items=1)
    with ServerThread(cfg) as srv, srv.client() as c, ThreadPoolExecutor(6) as pool:
        busy = [post_in_background(srv.url, pool) for _ in range(MAX_INFLIGHT)]  # the engine's slots all taken
        wait_for(lambda: metric(c, "vitserve_requests_in_flight") == MAX_INFLIGHT)
        wait_for(lambda: metric(c, "vitserve_items_total", '{modality="image"}') == 0
                 and metric(c, "vitserve_queue_tokens") == 0)  # all on the engine, none run yet
        queued = [post_in_background(srv.url, pool) for _ in range(2)]  # 70 tokens queued
        wait_for(lambda: metric(c, "vitserve_queue_tokens") == 70)
        r = c.post("/encode", json=BODY)  # 70 + 35 > 100
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "overloaded"
        big = c.post("/encode", json={"items": [{"type": "image", "image": b64(image_bytes(400, 400))}]})
        assert big.status_code == 422 and big.json()["error"]["code"] == "too_many_tokens"
        assert [f.result().status_code for f in [*busy, *queued]] == [200] * (MAX_INFLIGHT + 2)
        assert c.post("/encode", json=BODY).status_code == 200


def test_429_over_concurrent_requests(monkeypatch):
    slow_engine(monkeypatch, 0.8)
    cfg = settings(max_concurrent_requests=2, max_wait_ms=0)
    with ServerThread(cfg) as srv, srv.client() as c, ThreadPoolExecutor(2) as pool:
        running = [post_in_background(srv.url, pool) for _ in range(2)]
        wait_for(lambda: metric(c, "vitserve_requests_in_flight") == 2)
        r = c.post("/encode", json=BODY)
        assert r.status_code == 429 and "retry-after" in r.headers
        assert [f.result().status_code for f in running] == [200, 200]


def test_429_at_once_for_work_that_cannot_finish_by_its_deadline():
    """A burst several times what the engine can do within the request timeout: the requests that fit
    get 200, the rest 429 with Retry-After at once (not 504 after the timeout), judged by the rate
    measured over the engine's batches. The server runs in a process of its own: in this one, the
    clients' threads would hold its event loop's interpreter."""
    delay, timeout, burst = 0.5, 6.0, 24  # about 12 batches of one item fit in the timeout
    flags = ("--request-timeout-s", str(timeout), "--max-batch-items", "1")
    with SubprocessServer(*flags, env={"VITSERVE_MAX_WAIT_MS": "0"}, batch_delay_ms=delay * 1000) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        for _ in range(3):  # the rate is measured over a few batches first; until then nothing is refused
            assert c.post("/encode", json=BODY).status_code == 200
        assert 0 < metric(c, "vitserve_engine_rate_tokens_per_second") <= 35 / delay

        def post(_: int) -> tuple[httpx.Response, float]:
            """The response, and the seconds the server spent on it (its own measure: on a loaded machine,
            a client thread's clock also counts its waits for a core)."""
            r = httpx.post(srv.url + "/encode", json=BODY, timeout=60)
            return r, float(r.headers["server-timing"].split("dur=")[1]) / 1000

        with ThreadPoolExecutor(burst) as pool:
            results = list(pool.map(post, range(burst)))
        statuses = [r.status_code for r, _ in results]
        assert set(statuses) == {200, 429}, str(sorted((r.status_code, round(e, 2)) for r, e in results))
        assert statuses.count(200) >= 3, statuses  # what can finish is served
        for r, elapsed in results:
            if r.status_code == 429:
                error = r.json()["error"]
                assert (error["type"], error["code"]) == ("overloaded", "deadline_unreachable"), error
                assert int(r.headers["retry-after"]) >= 1
                assert elapsed < timeout / 2, str(sorted((r.status_code, round(e, 2)) for r, e in results))
        assert c.post("/encode", json=BODY).status_code == 200  # once the burst is through


def test_504_and_the_timed_out_items_are_dropped(monkeypatch):
    slow_engine(monkeypatch, 1.5)
    cfg = settings(request_timeout_s=0.5, max_wait_ms=0, max_batch_items=1)
    with ServerThread(cfg) as srv, srv.client() as c, ThreadPoolExecutor(MAX_INFLIGHT + 1) as pool:
        running = [post_in_background(srv.url, pool) for _ in range(MAX_INFLIGHT)]  # the engine's slots all taken
        wait_for(lambda: metric(c, "vitserve_requests_in_flight") == MAX_INFLIGHT)
        third = post_in_background(srv.url, pool)  # queued behind the slow batches
        for f in (*running, third):
            r = f.result()
            assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        # The third request's item is dropped from the queue instead of run for nobody.
        wait_for(lambda: metric(c, "vitserve_cancelled_items_total") >= 1)
        assert c.get("/health").status_code == 200


def test_500_is_logged_with_an_id_and_the_server_recovers(caplog):
    with ServerThread(settings()) as srv, srv.client() as c:
        runner = srv.engine.runner
        original = runner.run
        calls = []

        def failing(batch, items, staged=None):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected device failure")
            return original(batch, items, staged)

        runner.run = failing
        with caplog.at_level(logging.ERROR, logger="vitserve"):
            r = c.post("/encode", json=BODY)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "internal" and err["error_id"].startswith("err-")
        assert "injected" not in err["message"]  # no internals leak to the client
        logged = [rec for rec in caplog.records if err["error_id"] in rec.getMessage()]
        assert logged and logged[0].exc_info is not None  # the traceback is in the log
        assert c.post("/encode", json=BODY).status_code == 200


def test_a_client_that_disconnects_has_its_queued_work_dropped(monkeypatch):
    slow_engine(monkeypatch, 1.0)
    cfg = settings(max_wait_ms=0, max_batch_items=1)
    with ServerThread(cfg) as srv, srv.client() as c, ThreadPoolExecutor(MAX_INFLIGHT) as pool:
        busy = [post_in_background(srv.url, pool) for _ in range(MAX_INFLIGHT)]  # the engine's slots all taken
        wait_for(lambda: metric(c, "vitserve_requests_in_flight") == MAX_INFLIGHT
                 and metric(c, "vitserve_queue_items") == 0)
        doomed = [{"type": "image", "image": b64(image_bytes(100, 80, seed=9))}] * 3
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(srv.url + "/encode", json={"items": doomed}, timeout=0.4)
        assert [f.result().status_code for f in busy] == [200] * MAX_INFLIGHT
        wait_for(lambda: metric(c, "vitserve_cancelled_items_total") == 3)
        wait_for(lambda: metric(c, "vitserve_requests_total", '{status="499"}') == 1)
        assert metric(c, "vitserve_items_total", '{modality="image"}') == MAX_INFLIGHT  # only the busy ones ran


def test_a_client_gone_mid_upload_is_a_499_logged_at_info(caplog):
    """Half a body, then the socket closes: not a server error, no traceback."""
    with ServerThread(settings()) as srv, srv.client() as c:
        with caplog.at_level(logging.INFO, logger="vitserve"):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
                s.sendall(b"POST /encode HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 200000\r\n\r\n" + b'{"items": [' + b" " * 100000)
                wait_for(lambda: metric(c, "vitserve_requests_in_flight") == 1)
            wait_for(lambda: metric(c, "vitserve_requests_total", '{status="499"}') == 1)
        assert metric(c, "vitserve_requests_total", '{status="500"}') == 0
        gone = [r for r in caplog.records if "client went away while sending its body" in r.getMessage()]
        assert gone and gone[0].levelno == logging.INFO and gone[0].exc_info is None
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert c.post("/encode", json=BODY).status_code == 200


def test_ready_is_503_while_starting(monkeypatch):
    release = threading.Event()
    build = backends.build_runner

    def slow_build(settings):
        release.wait(30)
        return build(settings)

    monkeypatch.setattr(backends, "build_runner", slow_build)
    with ServerThread(settings(), wait_ready=False) as srv, srv.client() as c:
        r = c.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "starting"
        assert c.get("/health").json() == {"status": "ok", "state": "starting"}
        r = c.post("/encode", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
        release.set()
        wait_for(lambda: c.get("/ready").status_code == 200)
        assert c.post("/encode", json=BODY).status_code == 200


def test_info():
    cfg = settings(model="tiny-qwen3-vl", served_model_name="qwen3-tiny", budgets=[256, 1024], t_capture=4)
    with ServerThread(cfg) as srv, srv.client() as c:
        info = c.get("/info").json()
        assert metric(c, "vitserve_graphs_captured") == 0
    assert info["model"] == "qwen3-tiny" and info["family"] == "qwen3_vl"
    assert info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["budgets"] == [256, 1024] and info["t_capture"] == 4
    # The keys run as fixed-shape eager forwards: the CPU has no CUDA graph, and /info says so.
    assert info["captured"] == [] and info["pool"]["captured_graphs"] == 0
    assert info["graphs"]["mode"] == "cpu_fixed_shape" and info["graphs"]["captured"] == 0
    assert info["graphs"]["keys"] > 0 and "CUDA device" in info["graphs"]["reason"]
    assert info["num_deepstack"] == 2 and info["out_hidden_size"] == 80
    assert info["limits"]["max_items_per_request"] == 64 and info["limits"]["max_payload_bytes"] == 64 * 2**20
    assert info["version"] and info["state"] == "ready"
