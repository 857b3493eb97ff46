"""SGLang's encoder API on a real server (service/http/sglang.py): its /encode body beside vitserve's own,
/scheduler_receive_url, the pushes, the errors in SGLang's shape, and a load of SGLang parts mixed with
/encode traffic. The receivers here are plain ZMQ PULL sockets that read frame 0 with the stand-ins of
tests/test_sglang_wire.py; tests/test_sglang_handoff.py has SGLang's own code receive."""

from __future__ import annotations

import base64
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import zmq

from tests.http_helpers import ServerThread, image_bytes, settings, shm_entries
from tests.test_sglang_wire import Modality, read

TIMEOUT_S = 1.5  # --sglang-timeout-s here
IMAGES = [image_bytes(64 + 8 * k, 48, seed=40 + k) for k in range(6)]


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def part(req_id: str, items: list[Any], port: int | None = None, **extra: Any) -> dict[str, Any]:
    """SGLang's /encode body for one part (its tokenizer side's fields)."""
    return {"encoder_idx": 0, "encoder_url": "http://vitserve", "mm_items": items, "num_parts": 1, "part_idx": 0,
            "req_id": req_id, "modality": "IMAGE", "prefill_host": "127.0.0.1", "embedding_port": port,
            "time_stats_json": None, **extra}


class Receiver:
    """One PULL socket, as a scheduler rank (or a tokenizer) binds it; what arrives, by req_id."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.got: dict[str, list[tuple[dict[str, Any], bytes | None]]] = {}
        self.lock = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.stopped = False
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stopped:
            if not poller.poll(50):
                continue
            frames = self.sock.recv_multipart()
            state, _ = read(frames[0])
            with self.lock:
                self.got.setdefault(state["req_id"], []).append((state, frames[1] if len(frames) > 1 else None))
                self.lock.notify_all()

    def wait(self, req_id: str, timeout: float = 30) -> tuple[dict[str, Any], bytes | None]:
        with self.lock:
            assert self.lock.wait_for(lambda: req_id in self.got, timeout), f"{req_id} never arrived"
            return self.got[req_id][0]

    def register(self, base: str, req_id: str, count: int = 1) -> httpx.Response:
        return httpx.post(base + "/scheduler_receive_url", timeout=30, json={
            "req_id": req_id, "receive_count": count, "receive_url": f"127.0.0.1:{self.port}", "modality": "IMAGE"})

    def close(self) -> None:
        self.stopped = True
        self.thread.join(5)
        self.sock.close(linger=0)


@pytest.fixture(scope="module")
def srv():
    with ServerThread(settings(cache_bytes=32 << 20, sglang_timeout_s=TIMEOUT_S, allow_url=True,
                               allowed_hosts=["media.example.com"])) as s:
        yield s


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def reference(c: httpx.Client, data: bytes) -> np.ndarray:
    r = c.post("/encode", json={"items": [{"type": "image", "image": base64.b64encode(data).decode()}]})
    return np.array(r.json()["data"][0]["embedding"], dtype=np.float32)


def test_the_tokenizer_backend_gets_the_rows_of_encode(srv, zctx):
    rx = Receiver(zctx)
    with srv.client() as c:
        r = c.post("/encode", json=part("t_local_part_0", [url(IMAGES[0]), {"url": url(IMAGES[1])}], rx.port))
        assert (r.status_code, r.json()) == (200, None)
        state, rows = rx.wait("t_local_part_0")
        want = np.concatenate([reference(c, IMAGES[0]), reference(c, IMAGES[1])])
        assert state["modality"] is Modality.IMAGE and state["shape"] == list(want.shape)
        assert np.array_equal(np.frombuffer(rows, np.float32).reshape(want.shape), want)
        assert state["grid_dim"].shape == (2, 3)
        info = c.get("/info").json()["sglang"]
        assert info["route"] == "on" and info["follows"] == "SGLang 0.5.23" and info["family_served"]
        assert info["push_sockets"] == 0  # one request's receiver: its socket closed after the push
    rx.close()


def test_a_large_part_is_parsed_off_the_event_loop(srv, zctx):
    """A body of megabytes (parsed on a parse thread) with SGLang's fields in its first bytes, as SGLang
    writes them."""
    big = image_bytes(640, 480, seed=9)
    rx = Receiver(zctx)
    with srv.client() as c:
        r = c.post("/encode", json=part("big_local_part_0", [url(big)], rx.port))
        assert (r.status_code, r.json()) == (200, None)
        state, rows = rx.wait("big_local_part_0")
        want = reference(c, big)
        assert len(url(big)) > 1 << 20 and np.array_equal(np.frombuffer(rows, np.float32).reshape(want.shape), want)
    rx.close()


def test_registrations_before_and_after_the_encode(srv, zctx):
    ranks = [Receiver(zctx), Receiver(zctx)]
    with ThreadPoolExecutor(3) as pool:
        early = pool.submit(ranks[0].register, srv.url, "s_local_part_0", 2)
        time.sleep(0.2)
        encode = pool.submit(httpx.post, srv.url + "/encode", json=part("s_local_part_0", [url(IMAGES[2])]),
                             timeout=30)
        time.sleep(0.5)  # the encode is done and waits for the second rank
        assert not encode.done()
        late = pool.submit(ranks[1].register, srv.url, "s_local_part_0", 2)
        assert early.result().status_code == late.result().status_code == 200
        assert (encode.result().status_code, encode.result().json()) == (200, None)
    a, b = (rank.wait("s_local_part_0") for rank in ranks)
    assert a[1] == b[1] and a[0]["shape"] == b[0]["shape"]
    for rank in ranks:
        rank.close()


def error(r: httpx.Response, status: int, req_id: str | None) -> str:
    body = r.json()
    assert r.status_code == status and body["status"] == "error" and body["req_id"] == req_id, (r.status_code, body)
    return body["message"]


@pytest.mark.parametrize("body, status, words", [
    ({"mm_items": [], "modality": "IMAGE", "num_parts": 1, "part_idx": 0}, 400, "missing or invalid req_id"),
    (part("b", []), 400, "missing or empty mm_items"),
    (part("b", ["x"], modality="AUDIO"), 400, "vitserve encodes images and videos"),
    (part("b", ["x"], modality="POINTS"), 400, "unsupported modality"),
    (part("b", ["x"], part_idx=1), 400, "part_idx must be in [0, 1)"),
    (part("b", ["x"], num_parts=0), 400, "num_parts must be a positive integer"),
    (part("b", ["x"], embedding_port="x"), 400, "embedding_port"),
    (part("b", [{"detail": "auto"}]), 422, "object with one under 'url'"),
    (part("b", ["http://elsewhere.example.com/a.png"]), 422, "not in --allowed-hosts"),
    (part("b", ["file:///etc/passwd"]), 422, "never read"),
    (part("b", [{"url": url(IMAGES[0]), "content_hash": "sha256:" + "0" * 64}]), 422, "content_hash"),
    (part("b", [url(IMAGES[0])] * 65), 422, "at most 64"),
])
def test_bad_parts_are_answered_in_sglangs_shape(srv, body, status, words):
    if "req_id" in body:  # a failed part's id stays taken while its error waits for receivers
        body = {**body, "req_id": f"bad{time.monotonic_ns()}"}
    r = httpx.post(srv.url + "/encode", json=body, timeout=30)
    assert words in error(r, status, body.get("req_id"))


def test_vitserves_own_body_is_untouched(srv):
    r = httpx.post(srv.url + "/encode", json={"items": [{"type": "image", "image": url(IMAGES[0])}],
                                               "encoding_format": "base64"}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["shape"]
    r = httpx.post(srv.url + "/encode", json={"items": [], "mm_items": []}, timeout=30)
    assert r.status_code == 422 and "error" in r.json()  # vitserve's shape: not SGLang's body


def settle(srv: ServerThread) -> None:
    """Until no part is in flight (the errors of earlier failed parts wait for receivers in the background)."""
    deadline = time.monotonic() + 10
    while httpx.get(srv.url + "/info").json()["sglang"]["parts_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_part_whose_ranks_never_register_is_dropped(srv):
    settle(srv)
    before = push_counts(srv)
    started = time.monotonic()
    r = httpx.post(srv.url + "/encode", json=part("n_local_part_0", [url(IMAGES[3])]), timeout=30)
    assert time.monotonic() - started >= TIMEOUT_S
    assert f"timed out after {TIMEOUT_S:g}s" in error(r, 504, "n_local_part_0")
    assert push_counts(srv)["dropped"] == before["dropped"] + 1


def test_registrations_that_cannot_be_taken(srv, zctx):
    rx = Receiver(zctx)
    r = rx.register(srv.url, "never_started", 1)  # no /encode for it within the timeout
    assert "Timed out waiting for encoder request to start" in error(r, 504, "never_started")
    with ThreadPoolExecutor(2) as pool:
        encode = pool.submit(httpx.post, srv.url + "/encode", json=part("c_local_part_0", [url(IMAGES[4])]),
                             timeout=30)
        assert rx.register(srv.url, "c_local_part_0", 2).status_code == 200
        assert "Inconsistent receive_count" in error(rx.register(srv.url, "c_local_part_0", 3), 400, "c_local_part_0")
        assert encode.result().status_code == 504  # the second of its two ranks never came
    r = httpx.post(srv.url + "/scheduler_receive_url", json={"req_id": "x", "receive_count": 1, "receive_url": "x"})
    assert "host:port" in error(r, 400, "x")
    rx.close()


def test_mooncake_is_refused_and_fails_its_part(srv):
    with ThreadPoolExecutor(1) as pool:
        encode = pool.submit(httpx.post, srv.url + "/encode", json=part("m_local_part_0", [url(IMAGES[5])]),
                             timeout=30)
        time.sleep(0.3)
        r = httpx.post(srv.url + "/scheduler_receive_meta_data", json={"req_id": "m_local_part_0", "part_idx": 0})
        assert "mooncake" in error(r, 501, "m_local_part_0")
        assert "mooncake" in error(encode.result(), 501, "m_local_part_0")
    assert "mooncake" in error(httpx.post(srv.url + "/send", json={"req_id": "y"}), 501, "y")


def test_a_broken_image_reaches_its_receiver_as_an_error(srv, zctx):
    rx = Receiver(zctx)
    r = httpx.post(srv.url + "/encode", json=part("e_local_part_0", ["data:image/png;base64,aGVsbG8="], rx.port),
                   timeout=30)
    message = error(r, 422, "e_local_part_0")
    state, rows = rx.wait("e_local_part_0")
    assert rows is None and (state["error_msg"], state["error_code"]) == (message, 422)
    rx.close()


def push_counts(srv: ServerThread) -> dict[str, float]:
    out = {}
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith("vitserve_sglang_pushes_total"):
            out[line.split('result="')[1].split('"')[0]] = float(line.split()[-1])
    return out


PARTS = 2


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_load_every_part_once_nothing_left_behind(zctx):
    """64 SGLang requests of two parts each (two ranks register for every part) beside 32 /encode calls,
    all at once, the same few images again and again: every part reaches both ranks exactly once, identical
    items are encoded once, and afterwards no socket, segment or part is left."""
    cfg = settings(cache_bytes=32 << 20, sglang_timeout_s=30, max_concurrent_requests=512)
    ranks = [Receiver(zctx), Receiver(zctx)]
    with ServerThread(cfg) as s:
        def sglang_request(k: int) -> list[int]:
            with ThreadPoolExecutor(6) as pool:
                futures = []
                for p in range(PARTS):
                    req_id = f"load{k}_local_part_{p}"
                    body = part(req_id, [url(IMAGES[(k + p) % 3])], num_parts=PARTS, part_idx=p)
                    futures.append(pool.submit(httpx.post, s.url + "/encode", json=body, timeout=60))
                    futures += [pool.submit(rank.register, s.url, req_id, 2) for rank in ranks]
                return [f.result().status_code for f in futures]

        def plain(k: int) -> int:
            body = {"items": [{"type": "image", "image": url(IMAGES[k % 3])}], "encoding_format": "base64"}
            return httpx.post(s.url + "/encode", json=body, timeout=60).status_code

        sglang_request(0)  # warm: the push sockets and the context exist from here on
        fds = open_fds()
        with ThreadPoolExecutor(32) as pool:
            loads = [pool.submit(sglang_request, k) for k in range(1, 65)]
            plains = [pool.submit(plain, k) for k in range(32)]
            assert all(code == 200 for f in loads for code in f.result())
            assert all(f.result() == 200 for f in plains)
        for rank in ranks:
            with rank.lock:
                assert rank.lock.wait_for(lambda r=rank: len(r.got) == 65 * PARTS, 30)
                assert Counter(len(v) for v in rank.got.values()) == {1: 65 * PARTS}  # each part once, to each rank
        info = httpx.get(s.url + "/info").json()
        assert info["sglang"]["pushes"] == {"ok": 2 * 65 * PARTS, "failed": 0, "dropped": 0}
        assert info["sglang"]["push_sockets"] == 2 and info["sglang"]["parts_in_flight"] == 0
        assert info["cache"]["misses"] == 3  # three distinct images: the engine ran each once
        counts = push_counts(s)
        assert counts == {"ok": 2 * 65 * PARTS, "failed": 0, "dropped": 0}
        assert open_fds() <= fds + 4  # no socket per part: nothing grew with the load
    assert shm_entries(s.engine.names.prefix, pools=False) == []
    for rank in ranks:
        rank.close()


@pytest.mark.cuda
def test_a_gpu_server_pushes_bfloat16_rows_with_deepstack(zctx):
    """On the GPU the served dtype is bfloat16: the part says so, and its rows are /encode's bf16 base64 output
    (the main embedding and the DeepStack levels side by side, as SGLang's Qwen3-VL splits them)."""
    import torch

    rx = Receiver(zctx)
    cfg = settings(model="tiny-qwen3-vl", device="cuda", dtype="bfloat16", cache_bytes=32 << 20)
    with ServerThread(cfg) as s, s.client() as c:
        r = c.post("/encode", json=part("g_local_part_0", [url(IMAGES[0]), url(IMAGES[1])], rx.port))
        assert (r.status_code, r.json()) == (200, None)
        state, rows = rx.wait("g_local_part_0")
        assert state["dtype"] is torch.bfloat16
        body = {"items": [{"type": "image", "image": base64.b64encode(d).decode()} for d in IMAGES[:2]],
                "encoding_format": "base64", "dtype": "bfloat16", "include_deepstack": True}
        want = []
        for entry in c.post("/encode", json=body).json()["data"]:
            levels = [entry["embedding"], *entry["deepstack"]]
            want.append(torch.cat([torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.bfloat16)
                                   .reshape(entry["shape"][0], -1) for v in levels], dim=1))
        got = torch.frombuffer(bytearray(rows), dtype=torch.bfloat16).reshape(state["shape"])
        assert torch.equal(got, torch.cat(want))
    rx.close()

