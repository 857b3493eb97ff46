"""`vitserve bench --cache`: the server-side time of an encoder-output cache hit against a miss.

Starts `vitserve serve` on a loopback port (`ServerProcess`), sends N distinct photo-like 448x448 JPEGs once
(misses: decoding, preprocessing, the tower) and then each again (hits), one request at a time, and reads each
answer's `server-timing` header: the server's own time from the request's arrival to its response, so the
client's encoding and the network stay out of it. One warm-up request first. With `--encoding-format
vllm_ref` the server also gets an `--ec-shared-storage` folder (a file written on a miss, checked on a hit).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from service.bench.http_client import BenchError
from service.bench.http_server import ServerProcess

DEFAULT_IMAGES = 8
FORMATS = ("float", "base64", "vllm", "vllm_ref")


def photo_jpeg(seed: int, size: int = 448) -> bytes:
    """A photo-like JPEG: smooth gradients plus noise, so its size and decoding cost are a photo's."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([np.sin(6 * x + seed), np.cos(5 * y - seed), np.sin(4 * (x + y))], -1) * 80 + 128
    img = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def post(port: int, body: bytes) -> tuple[float, int, float]:
    """(server ms, cache hits, client ms) of one /encode call."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/encode", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        client_ms = (time.perf_counter() - t0) * 1e3
    finally:
        conn.close()
    if resp.status != 200:
        raise BenchError(f"/encode answered {resp.status}: {data[:300]!r}")
    server_ms = float(str(resp.getheader("server-timing", "")).split("dur=")[1])
    return server_ms, int(resp.getheader("x-vitserve-cache-hits", "0")), client_ms


def summary(values: Sequence[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values), 3), "min_ms": round(min(values), 3),
            "max_ms": round(max(values), 3)}


def run(*, model: str, images: int = DEFAULT_IMAGES, encoding_format: str = "base64", dtype: str = "bfloat16",
        serve_flags: Sequence[str] = (), out: Path | None = None, ready_timeout_s: float = 900,
        log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole benchmark; returns (and writes to `out`, when given) the result document."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if images < 1 or encoding_format not in FORMATS:
        raise BenchError(f"--cache-images must be positive and --encoding-format one of {', '.join(FORMATS)}")
    json_path = None if out is None else (out if out.suffix == ".json" else out / "cache_bench.json")
    with tempfile.TemporaryDirectory(prefix="vitserve-cache-bench-") as tmp:
        flags = ["--cache-bytes", str(1 << 30), "--log-level", "warning", *serve_flags]
        if encoding_format == "vllm_ref":
            flags += ["--ec-shared-storage", str(Path(tmp) / "ec")]
        with ServerProcess(model, flags, Path(tmp) / "server.log", ready_timeout_s) as srv:
            log(f"server: {shlex.join(srv.cmd)}")
            port = srv.port
            jpegs = [photo_jpeg(seed) for seed in range(images)]

            def body(data: bytes) -> bytes:
                return json.dumps({"items": [{"type": "image", "image": base64.b64encode(data).decode()}],
                                   "encoding_format": encoding_format, "dtype": dtype}).encode()

            post(port, body(photo_jpeg(10_000)))  # first-call costs stay out of both columns
            misses = [post(port, body(data)) for data in jpegs]
            hits = [post(port, body(data)) for data in jpegs]
    if any(h != 0 for _, h, _ in misses) or any(h != 1 for _, h, _ in hits):
        raise BenchError("the cache did not answer as expected: was --cache-bytes 0 passed in --serve-flags?")
    result = {
        "model": model, "images": images, "image": "448x448 JPEG",
        "jpeg_bytes": round(statistics.mean(len(i) for i in jpegs)), "encoding_format": encoding_format,
        "dtype": dtype, "serve_flags": list(serve_flags), "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "miss": {"server": summary([m[0] for m in misses]), "client": summary([m[2] for m in misses])},
        "hit": {"server": summary([h[0] for h in hits]), "client": summary([h[2] for h in hits])},
    }
    result["speedup_median"] = round(result["miss"]["server"]["median_ms"] / result["hit"]["server"]["median_ms"],
                                     1)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    miss, hit = result["miss"]["server"], result["hit"]["server"]
    print(f"{images} images, {encoding_format}: miss {miss['median_ms']} ms ({miss['min_ms']}-{miss['max_ms']}), "
          f"hit {hit['median_ms']} ms ({hit['min_ms']}-{hit['max_ms']}) of server time: "
          f"{result['speedup_median']}x")
    return result


def run_from_args(args: argparse.Namespace) -> int:
    """`vitserve bench --cache ...`: 0 when it ran, 2 when it cannot run."""
    from service.bench.http import default_model

    try:
        run(model=args.model or default_model(), images=args.cache_images, encoding_format=args.encoding_format,
            serve_flags=shlex.split(args.serve_flags or ""), out=args.out)
    except (BenchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
