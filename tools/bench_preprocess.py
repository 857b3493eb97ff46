"""Benchmark: JPEG bytes -> patches, ours (uint8) vs transformers' Qwen2VLImageProcessorPil (float32).

Run from the repository root:  python3 -m tools.bench_preprocess [--runs 60]

Use it after a change to image decoding or preprocessing (service/media/images.py, image_preprocess.py).

Both sides start from the same encoded JPEG bytes and include decoding. Runs of the two are
interleaved so background load hits both alike; we report the median and the minimum in ms.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import numpy as np
import PIL
import transformers
from PIL import Image, ImageDraw
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from models.config import ProcessorConfig
from models.presets import QWEN3_PRE, QWEN3_VIDEO_PRE
from service.media.image_preprocess import preprocess_image, preprocess_image_bytes
from service.media.images import decode_image

CONFIGS = {
    "qwen2_vl": ProcessorConfig(),
    # Qwen3-VL-8B's released preprocessor configs (image and video), as the preset carries them.
    "qwen3_vl": ProcessorConfig.from_dicts("qwen3_vl", QWEN3_PRE, QWEN3_VIDEO_PRE),
}


def synthetic_jpeg(width: int, height: int, seed: int = 0, quality: int = 90) -> bytes:
    """Photo-like content (gradients, shapes, mild noise) so the JPEG size and decode cost are realistic."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    yy /= height
    xx /= width
    base = np.stack([40 + 180 * yy, 90 + 120 * xx, 200 - 120 * yy * xx], -1)
    base += rng.normal(0, 6, base.shape).astype(np.float32)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(40):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(10, width // 3)), y0 + int(rng.integers(10, height // 3))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=color)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=quality)
    return out.getvalue()


def reference_processor(cfg: ProcessorConfig) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size,
        merge_size=cfg.merge_size,
        image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
    )


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def bench(runs: int, warmup: int = 3) -> list[dict[str, object]]:
    rows = []
    images = {"448x448": synthetic_jpeg(448, 448), "1920x1080": synthetic_jpeg(1920, 1080)}
    for family, cfg in CONFIGS.items():
        ref = reference_processor(cfg)
        for name, data in images.items():
            decoded = decode_image(data)
            cases: dict[str, Callable[[], object]] = {
                "ours": lambda d=data, c=cfg: preprocess_image_bytes(d, c),
                "ours_decode": lambda d=data: decode_image(d),
                "ours_preprocess": lambda im=decoded, c=cfg: preprocess_image(im, c),
                "reference": lambda d=data, r=ref: r(Image.open(io.BytesIO(d))),
            }
            times: dict[str, list[float]] = {k: [] for k in cases}
            for i in range(warmup + runs):
                for key, fn in cases.items():  # interleaved: drift in background load hits all alike
                    ms = timed(fn)
                    if i >= warmup:
                        times[key].append(ms)
            vi = preprocess_image_bytes(data, cfg)
            row: dict[str, object] = {
                "family": family,
                "image": name,
                "jpeg_kb": round(len(data) / 1024, 1),
                "resized": "x".join(str(s) for s in vi.meta["resized"][::-1]),
                "patches": vi.pixels.shape[0],
            }
            for key, values in times.items():
                row[f"{key}_median"] = statistics.median(values)
                row[f"{key}_min"] = min(values)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the reference warns about deprecated kwargs
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"cpu: {cpu}, {os.cpu_count()} logical cores, load avg {os.getloadavg()[0]:.2f}")
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, pillow {PIL.__version__}, "
        f"transformers {transformers.__version__}"
    )
    print(f"runs: {args.runs} per case (+3 warmup), times in ms as median (min)\n")
    columns = ["family", "image", "jpeg KB", "resized", "patches", "ours", "ours: decode"]
    columns += ["ours: preprocess", "reference", "speed-up"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in bench(args.runs):

        def cell(key: str, r: dict[str, object] = r) -> str:
            return f"{r[f'{key}_median']:.2f} ({r[f'{key}_min']:.2f})"

        speedup = float(r["reference_median"]) / float(r["ours_median"])  # type: ignore[arg-type]
        print(
            f"| {r['family']} | {r['image']} | {r['jpeg_kb']} | {r['resized']} | {r['patches']} | "
            f"{cell('ours')} | {cell('ours_decode')} | {cell('ours_preprocess')} | {cell('reference')} | "
            f"{speedup:.1f}x |"
        )


if __name__ == "__main__":
    main()
