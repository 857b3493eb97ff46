"""Many concurrent clients on loopback: no cross-talk, real batching, no 5xx under overload.

Bounded in count and time: a few hundred tiny-model items, well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import asyncio
import base64
import random
import re
import time

import httpx
import pytest
import torch

from graphs.runner import GraphRunner, plan_for
from models.loader import load_tower
from service.media.image_preprocess import preprocess_image_bytes
from tests.http_helpers import ServerThread, b64, image_bytes, settings, slow_engine

# The connection ended without a response: the server dropped or reset it.
DROPPED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
CLIENTS = 40
REQUESTS_PER_CLIENT = 3
SIZES = [(56, 56), (120, 90), (200, 150), (90, 300), (256, 256), (400, 120), (480, 360), (64, 640)]


@pytest.fixture(scope="module")
def catalogue():
    """Distinct images and each one's embedding encoded alone, locally."""
    cfg = settings()
    tower = load_tower(cfg.model, device="cpu", dtype="float32")
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower, cfg.max_batch_tokens))
    runner.capture()
    images = []
    for i in range(16):
        data = image_bytes(*SIZES[i % len(SIZES)], seed=100 + i, fmt="JPEG" if i % 2 else "PNG")
        want = runner.encode([preprocess_image_bytes(data, tower.processor)])[0].embeds
        images.append((b64(data), want))
    return images


def histogram(text: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)}


async def client_session(url: str, catalogue, rng: random.Random, failures: list) -> int:
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for r in range(REQUESTS_PER_CLIENT):
            picks = [rng.randrange(len(catalogue)) for _ in range(rng.randint(1, 3))]
            tag = f"c{rng.random():.8f}-{r}"
            body = {"items": [{"type": "image", "image": catalogue[p][0], "id": f"{tag}-{k}"}
                              for k, p in enumerate(picks)], "encoding_format": "base64"}
            try:
                resp = await client.post("/encode", json=body)
            except DROPPED as exc:  # a failure of the server's, counted apart; the next request reconnects
                failures.append(("dropped", type(exc).__name__))
                continue
            if resp.status_code != 200:
                failures.append((resp.status_code, resp.text[:200]))
                continue
            for k, (p, entry) in enumerate(zip(picks, resp.json()["data"])):
                got = torch.frombuffer(bytearray(base64.b64decode(entry["embedding"])),
                                       dtype=torch.float32).reshape(entry["shape"])
                want = catalogue[p][1]
                if entry["id"] != f"{tag}-{k}" or got.shape != want.shape or not torch.allclose(got, want, 1e-4, 1e-5):
                    failures.append(("mismatch", tag, k))
            done += 1
    return done


def test_concurrent_clients_get_their_own_answers(catalogue):
    cfg = settings(max_wait_ms=5, preprocess_workers=4)
    with ServerThread(cfg) as srv:
        async def main():
            failures: list = []
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(client_session(srv.url, catalogue, random.Random(i), failures)
                                            for i in range(CLIENTS)))
            return failures, sum(counts), time.perf_counter() - t0

        failures, done, seconds = asyncio.run(main())
        text = httpx.get(srv.url + "/metrics").text
    dropped = [f for f in failures if f[0] == "dropped"]
    assert not dropped, f"{len(dropped)} dropped connection(s): {dropped[:5]}"
    assert not failures, failures[:5]
    assert done == CLIENTS * REQUESTS_PER_CLIENT
    assert seconds < 90
    items = histogram(text, "vitserve_batch_items")
    assert items["+Inf"] > items["1.0"], "no batch held more than one item"
    assert re.search(r"^vitserve_graph_hits_total (\S+)$", text, re.M).group(1) != "0.0"


def test_overload_burst_gets_429_never_5xx_and_recovers(catalogue, monkeypatch):
    slow_engine(monkeypatch, 0.05)
    cfg = settings(max_queued_tokens=600, max_concurrent_requests=16)
    with ServerThread(cfg) as srv:
        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                bodies = [{"items": [{"type": "image", "image": catalogue[i % len(catalogue)][0]}]} for i in range(120)]
                return await asyncio.gather(*(client.post("/encode", json=b) for b in bodies), return_exceptions=True)

        answers = asyncio.run(burst())
        dropped = [type(a).__name__ for a in answers if isinstance(a, DROPPED)]
        assert not dropped, f"{len(dropped)} dropped connection(s): {dropped}"
        assert not [a for a in answers if isinstance(a, BaseException)], answers
        responses = [a for a in answers if isinstance(a, httpx.Response)]
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 429}, set(statuses)
        assert statuses.count(429) > 0 and statuses.count(200) > 0
        assert all(r.headers.get("retry-after") for r in responses if r.status_code == 429)
        again = httpx.post(srv.url + "/encode", json={"items": [{"type": "image", "image": catalogue[0][0]}]},
                           timeout=60)
        assert again.status_code == 200
        text = httpx.get(srv.url + "/metrics").text
        assert re.search(r"^vitserve_queue_items 0.0$", text, re.M)
        assert re.search(r"^vitserve_queue_tokens 0.0$", text, re.M)
