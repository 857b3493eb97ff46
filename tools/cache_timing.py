"""Server-side time of an encoder-output cache hit against a miss, for 448x448 JPEGs.

Starts `vitserve serve` on a loopback port, sends N distinct JPEGs once (misses: decode, preprocess, tower)
and then again (hits), and reads each answer's `server-timing` header: the time the server spent from
the request's arrival to its response, so the client's own encoding and the network stay out of it.

    python tools/cache_timing.py --model tiny-qwen2.5-vl --device cpu --images 8 --out timing.json

Use it after a change to the encoder-output cache or its lookup (a hit must stay far below a miss).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def jpeg(seed: int, size: int = 448) -> bytes:
    """A photo-like JPEG: smooth gradients plus noise, so its size and decode cost are a photo's."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([np.sin(6 * x + seed), np.cos(5 * y - seed), np.sin(4 * (x + y))], -1) * 80 + 128
    img = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[float, int, float]:
    """(server ms, hits, client ms) of one /encode call."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + "/encode", data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()
        timing = resp.headers["server-timing"]
        hits = int(resp.headers["x-vitserve-cache-hits"])
    client_ms = (time.perf_counter() - t0) * 1000
    return float(timing.split("dur=")[1]), hits, client_ms


def summary(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values), 3), "min_ms": round(min(values), 3),
            "max_ms": round(max(values), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-qwen2.5-vl")
    p.add_argument("--device", default="cpu")
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--format", default="base64", choices=["float", "base64", "vllm", "vllm_ref"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--model", args.model, "--device", args.device, "--port", str(port), "--cache-bytes", str(1 << 30),
             "--log-level", "warning"]
    storage = None
    if args.format == "vllm_ref":
        storage = Path(os.environ.get("TMPDIR", "/tmp")) / f"vitserve-cache-timing-{port}"
        flags += ["--ec-shared-storage", str(storage)]
    server = subprocess.Popen([sys.executable, "-m", "service.http.server", *flags], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not get ready")
            time.sleep(0.5)
        images = [jpeg(seed) for seed in range(args.images)]

        def body(data: bytes) -> dict:
            return {"items": [{"type": "image", "image": base64.b64encode(data).decode()}],
                    "encoding_format": args.format, "dtype": args.dtype}

        post(url, body(jpeg(10_000)))  # warm-up: first-call costs stay out of both columns
        misses = [post(url, body(data)) for data in images]
        hits = [post(url, body(data)) for data in images]
        assert all(h == 0 for _, h, _ in misses) and all(h == 1 for _, h, _ in hits)
    finally:
        server.terminate()
        server.wait(60)
        if storage is not None:
            shutil.rmtree(storage, ignore_errors=True)
    result = {
        "model": args.model, "device": args.device, "images": args.images, "image": "448x448 JPEG",
        "jpeg_bytes": round(statistics.mean(len(i) for i in images)), "encoding_format": args.format,
        "dtype": args.dtype, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "miss": {"server": summary([m[0] for m in misses]), "client": summary([m[2] for m in misses])},
        "hit": {"server": summary([h[0] for h in hits]), "client": summary([h[2] for h in hits])},
    }
    result["speedup_median"] = round(result["miss"]["server"]["median_ms"] / result["hit"]["server"]["median_ms"], 1)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
