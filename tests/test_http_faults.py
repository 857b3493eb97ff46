"""The server's own faults are 5xx, each with an error id in the body that one log line (WARNING or
above) carries too; what the client can fix is 4xx. Faults are injected into a real server on loopback
at the seams where they happen: a worker lost, a device run failing, a bug, a deadline, a drain."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from service.workers.pool import WorkerDied
from tests.http_helpers import ServerThread, b64, image_bytes, settings

BODY = {"items": [{"type": "image", "image": b64(image_bytes(96, 80, seed=5))}], "encoding_format": "float"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(settings()) as srv:
        yield srv


def failing_job(job: str, exc: Exception) -> Callable[[Any], Any]:
    """A `WorkerPool.call` that fails every `job` with `exc` and runs the others."""

    def patch(original: Any) -> Any:
        async def call(owner: Any, fn: str, *args: Any, **kwargs: Any) -> Any:
            if fn.endswith(":" + job):
                raise exc
            return await original(owner, fn, *args, **kwargs)

        return call

    return patch


def device_failure(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected device failure")

    monkeypatch.setattr(server.engine.runner, "run", run)


def bug(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    def encode(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("injected bug")

    monkeypatch.setattr(server.app.state.service.handoff, "encode", encode)


def deadline(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    async def encode(*args: Any, **kwargs: Any) -> Any:
        raise asyncio.TimeoutError()

    monkeypatch.setattr(server.app.state.service.handoff, "encode", encode)


def worker(job: str, reason: str) -> Callable[[ServerThread, pytest.MonkeyPatch], None]:
    def inject(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
        workers = server.engine.workers
        monkeypatch.setattr(workers, "call", failing_job(job, WorkerDied(reason, "injected"))(workers.call))

    return inject


def draining(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.engine, "state", "draining")


# (what fails, status, type, code, the level of the one line that carries the id)
FAULTS = [
    ("media_worker_lost", worker("prepare_media", "channel"), 503, "unavailable", "worker_lost", logging.WARNING),
    ("response_worker_lost", worker("encode_item", "crash"), 503, "unavailable", "worker_lost", logging.WARNING),
    ("device", device_failure, 500, "internal", "engine_failure", logging.ERROR),  # with the traceback
    ("bug", bug, 500, "internal", "internal", logging.ERROR),  # with the traceback
    ("deadline", deadline, 504, "timeout", "timeout", logging.WARNING),
    ("draining", draining, 503, "unavailable", "draining", logging.WARNING),
]


@pytest.mark.parametrize("name,inject,status,kind,code,level", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_server_fault_is_5xx_with_an_error_id_in_one_log_line(server, monkeypatch, caplog, name, inject, status,
                                                                 kind, code, level):
    inject(server, monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="vitserve"), server.client() as c:
        r = c.post("/encode", json=BODY)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == (kind, code)
    assert error["error_id"].startswith("err-")
    assert "injected" not in error["message"] or status == 503  # a bug's internals stay in the log
    lines = [rec for rec in caplog.records if error["error_id"] in rec.getMessage()]
    assert [rec.levelno for rec in lines] == [level], [rec.getMessage() for rec in lines]
    if status == 503:
        assert r.headers["retry-after"].isdigit()
    monkeypatch.undo()
    with server.client() as c:
        assert c.post("/encode", json=BODY).status_code == 200  # and the server serves on


def test_a_bug_in_any_route_is_a_500_with_an_error_id_in_one_log_line(server, monkeypatch, caplog):
    """Routes other than /encode (/info here) answer their own bugs the same way: the API's error shape,
    an id, the traceback logged once under it; nothing of the bug in the body."""
    def info() -> None:
        raise KeyError("injected bug")

    monkeypatch.setattr(server.engine, "info", info)
    with caplog.at_level(logging.DEBUG, logger="vitserve"), server.client() as c:
        r = c.get("/info")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("internal", "internal") and error["error_id"].startswith("err-")
    assert "injected" not in r.text
    lines = [rec for rec in caplog.records if error["error_id"] in rec.getMessage()]
    assert [rec.levelno for rec in lines] == [logging.ERROR] and "KeyError" in (lines[0].exc_text or "")
    monkeypatch.undo()
    with server.client() as c:
        assert c.get("/info").status_code == 200 and c.post("/encode", json=BODY).status_code == 200


def test_a_decoder_that_crashes_on_the_item_is_the_items_422(server, monkeypatch):
    """A worker that died on its item twice ("crash", after the pool's retry): the media's fault, a 4xx."""
    workers = server.engine.workers
    monkeypatch.setattr(workers, "call", failing_job("prepare_media", WorkerDied("crash", "it crashed"))(workers.call))
    with server.client() as c:
        r = c.post("/encode", json=BODY)
    assert r.status_code == 422 and r.json()["error"]["code"] == "decoder_crashed"
    assert "error_id" not in r.json()["error"]


def test_info_shows_a_lost_worker_and_its_replacement(server):
    """/info's worker section counts a worker lost from outside, by cause, and shows its replacement
    coming up; /ready stays 200 (the other worker serves), and full capacity comes back."""
    with server.client() as c:
        before = c.get("/info").json()["workers"]
        assert before["states"]["idle"] == before["workers"] == 2
        victim = server.engine.workers._workers[0].process.pid
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (now := c.get("/info").json()["workers"])["restarts"] == before["restarts"]:
            assert time.monotonic() < deadline, now
            time.sleep(0.02)
        assert now["restarts_by_cause"].get("killed", 0) == before["restarts_by_cause"].get("killed", 0) + 1
        assert now["crashed"] == before["crashed"] + 1
        assert c.get("/ready").status_code == 200
        while (now := c.get("/info").json()["workers"])["states"]["idle"] < 2:
            assert time.monotonic() < deadline, now
            time.sleep(0.02)
        assert victim not in [w.process.pid for w in server.engine.workers._workers]
        assert c.post("/encode", json=BODY).status_code == 200
