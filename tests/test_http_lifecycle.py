"""The real server process: settings from flags and VITSERVE_* variables, and the drain on SIGTERM."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.http_helpers import SubprocessServer, b64, image_bytes

BODY = {"items": [{"type": "image", "image": b64(image_bytes(200, 150, seed=5))},
                  {"type": "image", "image": b64(image_bytes(90, 120, seed=6))}]}
IN_FLIGHT = 6


def in_flight(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("vitserve_requests_in_flight "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("group", [False, True], ids=["server", "every-process"])
def test_sigterm_drains_without_losing_accepted_requests(group: bool):
    """SIGTERM to the server drains it. So does SIGTERM to each of its processes (engine processes with
    --data-parallel 2, media workers): they leave it to the server to stop them once drained, where an
    engine that died at once failed the accepted requests and was restarted in the middle of the drain."""
    env = {"VITSERVE_MAX_WAIT_MS": "0",
           "VITSERVE_SERVED_MODEL_NAME": "from-env", "VITSERVE_MAX_ITEMS_PER_REQUEST": "7"}
    engines = ["--data-parallel", "2"] if group else []
    # No --model: the embedded default preset, announced in the log.
    with SubprocessServer("--max-items-per-request", "5", "--max-batch-items", "2", *engines, env=env, model=None,
                          batch_delay_ms=1500 if group else 400) as srv, \
            ThreadPoolExecutor(IN_FLIGHT) as pool:
        info = httpx.get(srv.url + "/info", timeout=5).json()
        assert info["model"] == "from-env" and info["model_source"] == "tiny-qwen2-vl"  # name from the environment
        assert info["limits"]["max_items_per_request"] == 5  # the flag wins over VITSERVE_MAX_ITEMS_PER_REQUEST
        futures = [pool.submit(httpx.post, srv.url + "/encode", json=BODY, timeout=60) for _ in range(IN_FLIGHT)]
        deadline = time.monotonic() + 20
        while in_flight(srv.url) < IN_FLIGHT:
            assert time.monotonic() < deadline, "requests never got in flight"
            time.sleep(0.02)
        srv.terminate(group)
        # Draining: not ready, new work refused, while the accepted requests still run.
        deadline = time.monotonic() + 5
        while (ready := httpx.get(srv.url + "/ready", timeout=5)).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert ready.json()["error"]["code"] == "draining"
        refused = httpx.post(srv.url + "/encode", json=BODY, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        results = [f.result() for f in futures]
        assert [r.status_code for r in results] == [200] * IN_FLIGHT
        assert all(len(r.json()["data"]) == 2 for r in results)
        code, log = srv.wait(timeout=60)
    assert code == 0, log
    assert "draining" in log
    assert "no --model given: serving the embedded tiny-qwen2-vl preset" in log
    assert re.search(r"loaded tiny-qwen2-vl \(qwen2_vl\) on cpu, attention: sdpa, in ", log), log  # the backend in use


def test_bad_settings_exit_2_before_loading():
    code, log = SubprocessServer(env={"VITSERVE_VIDEO_CHUNKING": "auto"}).run_to_exit(timeout=60)
    assert code == 2 and "--video-chunking takes on or off" in log and "loaded" not in log, log


def test_an_attention_backend_that_cannot_serve_exits_2_before_binding():
    code, log = SubprocessServer("--attention", "varlen").run_to_exit(timeout=60)
    assert code == 2 and "--attention varlen: attention backend 'varlen' needs a CUDA device" in log, log
    assert "loaded" not in log and "Uvicorn running" not in log, log
