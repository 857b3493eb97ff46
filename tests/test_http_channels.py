"""The channels between the server's processes carry a message of any size whole, over a real server
(uvicorn on uvloop, as `vitserve serve` runs): the front's ends of its pipes are non-blocking there, so a
message larger than the socket buffer (about 208 KiB) is written and read in parts."""

from __future__ import annotations

import httpx

from tests.http_helpers import SubprocessServer, b64, image_bytes


def test_an_image_larger_than_the_pipe_buffer_is_served_and_costs_no_worker():
    # 275x275 noise is a PNG of about 227 KB: it travelled inside the job's message and half of it was
    # written before EAGAIN, leaving the worker holding half a message for good.
    images = [image_bytes(275, 275, seed=s) for s in range(4)]
    assert all(200_000 < len(i) < 256 * 1024 for i in images)
    with SubprocessServer("--preprocess-workers", "2", "--request-timeout-s", "20") as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        for data in images:  # twice as many as there are workers
            r = c.post("/encode", json={"items": [{"type": "image", "image": b64(data)}],
                                        "encoding_format": "base64"})
            assert r.status_code == 200, r.text
        assert c.get("/ready").status_code == 200
        workers = c.get("/info").json()["workers"]
        assert workers["workers"] == 2 and workers["busy"] == 0
