"""Benchmark: a 30 s 1280x720 H.264 clip -> Qwen-VL video patches, ours vs qwen-vl-utils.

Run from the repository root:

    python -m tools.bench_video [--runs 3] [--qvu-path DIR ...] [--json out.json]

Use it after a change to video decoding, sampling or patchifying (service/media/video*.py).

The clip is synthesised with PyAV/libx264 (a panning photo-like scene, 30 fps, B-frames, x264's
default keyframe interval) and cached in the temp dir. Measured, each as the median of --runs:

* ours: `preprocess_video_bytes` at the default sampling (2 fps -> 60 frames), bytes in, uint8
  patches out, for Qwen2-VL and Qwen3-VL; and its parts (packet index, decode of the sampled
  frames, resize + patchify).
* naive PyAV: decode every frame in order and convert the sampled ones to RGB (what a reader that
  neither jumps nor skips does), for the default and a sparse (8 frames) sampling.
* qwen-vl-utils `fetch_video` (file path in, resized float frames out, no patchify) in a
  subprocess, with every reader that imports: --qvu-path adds folders (pip --target installs of
  qwen-vl-utils, decord, torchcodec) to its sys.path. qwen-vl-utils imports torchvision at module
  load; when torchvision cannot be imported here, a stand-in module is generated whose `resize`
  runs the same torch op torchvision's tensor path runs (F.interpolate bicubic, antialias, clamp,
  round to uint8); its video reader is not provided, so the torchvision reader is reported as such.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import av
import numpy as np
import PIL
import transformers

from models.config import ProcessorConfig
from models.presets import QWEN3_PRE, QWEN3_VIDEO_PRE
from service.media.video import VideoReader
from service.media.video_preprocess import preprocess_video_bytes
from service.media.video_sampling import VideoOptions, plan_sampling

WIDTH, HEIGHT, FPS, SECONDS = 1280, 720, 30, 30
CONFIGS = {
    "qwen2_vl": ProcessorConfig(),
    # Qwen3-VL-8B's released preprocessor configs (image and video), as the preset carries them.
    "qwen3_vl": ProcessorConfig.from_dicts("qwen3_vl", QWEN3_PRE, QWEN3_VIDEO_PRE),
}


def make_clip(path: Path, gop: int | None = None) -> None:
    """A panning camera over a photo-like scene with a moving object and sensor noise (a few Mbit/s,
    like a phone clip). gop: keyframe interval; None = x264's default (250 frames, plus scene cuts)."""
    rng = np.random.default_rng(0)
    big_h, big_w = HEIGHT + 240, WIDTH + 960
    yy, xx = np.mgrid[0:big_h, 0:big_w].astype(np.float32)
    scene = np.stack(
        [
            110 + 90 * np.sin(xx / 97.0) * np.cos(yy / 131.0),
            120 + 80 * np.sin((xx + yy) / 173.0),
            100 + 100 * np.cos(xx / 59.0 - yy / 211.0),
        ],
        -1,
    )
    for _ in range(120):  # blobs of texture
        y, x = int(rng.integers(0, big_h - 80)), int(rng.integers(0, big_w - 80))
        h, w = int(rng.integers(20, 80)), int(rng.integers(20, 80))
        scene[y : y + h, x : x + w] = rng.integers(0, 256, 3) + rng.normal(0, 12, (h, w, 3))
    scene = np.clip(scene + rng.normal(0, 3, scene.shape), 0, 255).astype(np.int16)
    noise = rng.normal(0, 4, (8, HEIGHT, WIDTH, 1)).astype(np.int16)  # cycled, fresh per frame
    options = {"preset": "veryfast", "crf": "23"} | ({"g": str(gop)} if gop else {})
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=FPS, options=options)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for i in range(FPS * SECONDS):
            x0, y0 = (i * 1) % (big_w - WIDTH), int(120 + 100 * np.sin(i / 90))
            frame = scene[y0 : y0 + HEIGHT, x0 : x0 + WIDTH] + noise[i % len(noise)]
            bx = (i * 7) % (WIDTH - 160)
            frame[300:420, bx : bx + 160] = (230, 40, 40)
            frame = np.clip(frame, 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def timed(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def naive_pyav(data: bytes, positions: set[int]) -> list[np.ndarray]:
    """Decode everything in order; convert only the wanted frames."""
    out = []
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for i, frame in enumerate(container.decode(stream)):
            if i in positions:
                out.append(frame.to_ndarray(format="rgb24"))
            if i >= max(positions):
                break
    return out


def bench_ours(data: bytes, runs: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    with VideoReader(data) as reader:
        info = reader.info
    res["clip"] = {"frames": info.num_frames, "fps": info.fps, "duration_s": info.duration}
    res["index_s"], _ = timed(lambda: VideoReader(data).close(), runs)
    for name, cfg in CONFIGS.items():
        res[f"{name}_preprocess_s"], vi = timed(lambda cfg=cfg: preprocess_video_bytes(data, cfg), runs)
        res[f"{name}_grid_thw"] = list(vi.grid_thw)
        res[f"{name}_tokens"] = vi.num_tokens(cfg.merge_size)
        res[f"{name}_resized"] = list(vi.meta["resized"])
    for label, nframes in (("default", None), ("sparse8", 8)):
        plan = plan_sampling(CONFIGS["qwen2_vl"], info.num_frames, info.fps, VideoOptions(nframes=nframes))

        def decode_only(plan=plan) -> dict[str, int]:
            with VideoReader(data) as reader:
                positions = reader.positions_at(reader.index_times(plan.indices))
                reader.read(positions, lambda position, rgb: None)
                return dict(reader.stats)

        res[f"decode_{label}_s"], stats = timed(decode_only, runs)
        res[f"decode_{label}_stats"] = stats
        wanted = set(plan.indices.tolist())
        res[f"naive_pyav_{label}_s"], _ = timed(lambda wanted=wanted: naive_pyav(data, wanted), runs)
    return res


def bench_sparse_short_gop(data: bytes, runs: int) -> dict[str, Any]:
    """8 frames from a clip with a keyframe every second: jumping skips most of the clip."""
    with VideoReader(data) as reader:
        info = reader.info
    plan = plan_sampling(CONFIGS["qwen2_vl"], info.num_frames, info.fps, VideoOptions(nframes=8))

    def decode_only() -> dict[str, int]:
        with VideoReader(data) as reader:
            reader.read(reader.positions_at(reader.index_times(plan.indices)), lambda position, rgb: None)
            return dict(reader.stats)

    res: dict[str, Any] = {}
    res["decode_sparse8_s"], res["decode_sparse8_stats"] = timed(decode_only, runs)
    wanted = set(plan.indices.tolist())
    res["naive_pyav_sparse8_s"], _ = timed(lambda: naive_pyav(data, wanted), runs)
    return res


TV_STANDIN = '''
"""Stand-in for torchvision (its C extension does not load beside this CPU-only torch): just what
qwen-vl-utils touches. resize() is torchvision's tensor path: float, interpolate, clamp, round."""
import enum, types
import torch
__version__ = "0.28.0+standin"
class InterpolationMode(enum.Enum):
    NEAREST = "nearest"; BILINEAR = "bilinear"; BICUBIC = "bicubic"
def _resize(img, size, interpolation=InterpolationMode.BILINEAR, antialias=True):
    dtype = img.dtype
    x = img.float() if dtype == torch.uint8 else img
    x = torch.nn.functional.interpolate(x, size=list(size), mode=interpolation.value,
                                        align_corners=False, antialias=antialias)
    if dtype == torch.uint8:
        x = x.clamp(0, 255).round().to(torch.uint8)
    return x
transforms = types.ModuleType("torchvision.transforms")
transforms.InterpolationMode = InterpolationMode
transforms.functional = types.SimpleNamespace(resize=_resize)
def _read_video(*a, **k):
    raise RuntimeError("torchvision stand-in: no video reader")
io = types.SimpleNamespace(read_video=_read_video)
import sys
sys.modules["torchvision.transforms"] = transforms
sys.modules["torchvision.io"] = io
'''

QVU_RUNNER = """
import json, os, sys, statistics, time
sys.path[:0] = {paths!r}
import torch
result = {{}}
try:
    import torchvision  # noqa
    result["torchvision"] = torchvision.__version__
    import qwen_vl_utils.vision_process as vp
except Exception as exc:
    print(json.dumps({{"error": f"import failed: {{type(exc).__name__}}: {{exc}}"}})); sys.exit(0)
backend = os.environ.get("FORCE_QWENVL_VIDEO_READER")
try:
    for _ in range({warmup}):
        vp.fetch_video({{"video": {clip!r}}}, image_patch_size={patch})
    times = []
    for _ in range({runs}):
        t0 = time.perf_counter()
        ele = {{"video": {clip!r}}}
        video, fps = vp.fetch_video(ele, image_patch_size={patch}, return_video_sample_fps=True)
        times.append(time.perf_counter() - t0)
    result.update(seconds=statistics.median(times), shape=list(video.shape), sample_fps=fps, backend=backend)
    torch.save(video.round().to(torch.uint8), {dump!r})
except Exception as exc:
    result["error"] = f"{{type(exc).__name__}}: {{str(exc)[:300]}}"
print(json.dumps(result))
"""


def bench_qvu(
    clip: Path,
    extra_paths: list[str],
    runs: int,
    workdir: Path,
    backends: tuple[str, ...] = ("torchcodec", "decord", "torchvision"),
    warmup: int = 1,
) -> dict[str, Any]:
    """qwen-vl-utils fetch_video with each reader, in subprocesses (their imports stay out of ours)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torchvision"], capture_output=True, text=True, env=_env(extra_paths)
    )
    paths = list(extra_paths)
    out: dict[str, Any] = {}
    if probe.returncode != 0:
        out["torchvision_import_error"] = probe.stderr.strip().splitlines()[-1][:300]
        standin = workdir / "standin"
        (standin / "torchvision").mkdir(parents=True, exist_ok=True)
        (standin / "torchvision" / "__init__.py").write_text(TV_STANDIN)
        paths.insert(0, str(standin))
    for backend in backends:
        dump = workdir / f"qvu_{backend}.pt"
        code = QVU_RUNNER.format(
            paths=paths, runs=runs, warmup=warmup, clip=str(clip), patch=14, dump=str(dump)
        )
        env = _env(paths) | {"FORCE_QWENVL_VIDEO_READER": backend}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        out[backend] = json.loads(lines[-1]) if lines else {"error": (proc.stderr or "no output")[-300:]}
        if "seconds" in out[backend]:
            out[backend]["dump"] = str(dump)
    return out


def head_to_head(
    data: bytes, clip: Path, extra_paths: list[str], rounds: int, workdir: Path
) -> dict[str, Any]:
    """Ours (Qwen2-VL) and qwen-vl-utils' default reader, alternated so background load hits both."""
    ours, theirs = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        preprocess_video_bytes(data, CONFIGS["qwen2_vl"])
        ours.append(time.perf_counter() - t0)
        q = bench_qvu(clip, extra_paths, 1, workdir, backends=("torchcodec",))["torchcodec"]
        if "seconds" not in q:
            return {"error": q.get("error")}
        theirs.append(q["seconds"])
    return {
        "ours_s": ours,
        "qvu_torchcodec_s": theirs,
        "ratio_of_medians": statistics.median(theirs) / statistics.median(ours),
    }


def _env(paths: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).strip(os.pathsep)
    return env


def compare_frames(data: bytes, dump: str) -> dict[str, float]:
    """Our resized uint8 frames (PIL bicubic) against qwen-vl-utils' (torch bicubic + antialias)."""
    import torch

    theirs = torch.load(dump).numpy().transpose(0, 2, 3, 1)  # [T, H, W, C]
    vi = preprocess_video_bytes(data, CONFIGS["qwen2_vl"])
    gt, gh, gw = vi.grid_thw
    p, m = 14, 2
    ours = vi.pixels.reshape(gt, gh // m, gw // m, m, m, 3, 2, p, p).transpose(0, 6, 1, 3, 7, 2, 4, 8, 5)
    ours = ours.reshape(gt * 2, gh * p, gw * p, 3)
    if ours.shape != theirs.shape:
        return {"shape_ours": list(ours.shape), "shape_theirs": list(theirs.shape)}
    diff = np.abs(ours.astype(np.int16) - theirs.astype(np.int16))
    return {"max_abs": int(diff.max()), "mean_abs": float(diff.mean()), "frac_gt_2": float((diff > 2).mean())}


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--qvu-path", action="append", default=[], help="sys.path entry for the qvu run")
    default_clip = Path(tempfile.gettempdir()) / "vitserve_bench_720p30.mp4"
    parser.add_argument("--clip", type=Path, default=default_clip)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    if not args.clip.exists():
        t0 = time.perf_counter()
        make_clip(args.clip)
        print(f"made {args.clip} in {time.perf_counter() - t0:.1f} s")
    data = args.clip.read_bytes()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {
            "av": av.__version__,
            "ffmpeg_libavcodec": av.library_versions["libavcodec"],
            "numpy": np.__version__,
            "pillow": PIL.__version__,
            "transformers": transformers.__version__,
        },
        "clip_bytes": len(data),
        "runs": args.runs,
    }
    results["ours"] = bench_ours(data, args.runs)
    gop_clip = args.clip.with_name(args.clip.stem + "_gop30" + args.clip.suffix)
    if not gop_clip.exists():
        make_clip(gop_clip, gop=FPS)
    results["ours_gop30"] = bench_sparse_short_gop(gop_clip.read_bytes(), args.runs)
    with tempfile.TemporaryDirectory() as tmp:
        results["qwen_vl_utils"] = bench_qvu(args.clip, args.qvu_path, args.runs, Path(tmp))
        for backend in ("torchcodec", "decord"):
            dump = results["qwen_vl_utils"].get(backend, {}).pop("dump", None)
            if dump:
                results["qwen_vl_utils"][backend]["vs_ours"] = compare_frames(data, dump)
        results["head_to_head"] = head_to_head(data, args.clip, args.qvu_path, args.runs, Path(tmp))
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    _summary(results)


def _summary(r: dict[str, Any]) -> None:
    o, g = r["ours"], r["ours_gop30"]
    print(
        textwrap.dedent(f"""
        clip: {o["clip"]["frames"]} frames, {o["clip"]["duration_s"]:.1f} s, {r["clip_bytes"] / 1e6:.1f} MB
        ours  qwen2_vl preprocess (60 frames -> patches): {o["qwen2_vl_preprocess_s"] * 1000:7.0f} ms
        ours  qwen3_vl preprocess:                        {o["qwen3_vl_preprocess_s"] * 1000:7.0f} ms
        ours  packet index only:                          {o["index_s"] * 1000:7.0f} ms
        ours  decode 60 sampled frames to RGB:            {o["decode_default_s"] * 1000:7.0f} ms
              {o["decode_default_stats"]}
        naive decode-all, RGB of the 60:                  {o["naive_pyav_default_s"] * 1000:7.0f} ms
        ours  decode 8 sampled frames:                    {o["decode_sparse8_s"] * 1000:7.0f} ms
              {o["decode_sparse8_stats"]}
        naive decode-all, RGB of the 8:                   {o["naive_pyav_sparse8_s"] * 1000:7.0f} ms
        1 s GOP clip: ours decode 8 frames:               {g["decode_sparse8_s"] * 1000:7.0f} ms
              {g["decode_sparse8_stats"]}
        1 s GOP clip: naive decode-all, RGB of the 8:     {g["naive_pyav_sparse8_s"] * 1000:7.0f} ms""")
    )
    for backend, q in r["qwen_vl_utils"].items():
        if isinstance(q, dict):
            took = f"{q['seconds'] * 1000:7.0f} ms  shape {q['shape']}" if "seconds" in q else q.get("error")
            print(f"qwen-vl-utils fetch_video [{backend:10}]:        {took}  {q.get('vs_ours', '')}")
    h = r.get("head_to_head", {})
    if "ours_s" in h:
        print(
            f"alternated, ours vs qwen-vl-utils (torchcodec): {h['ours_s']} vs {h['qvu_torchcodec_s']} s, "
            f"ratio of medians {h['ratio_of_medians']:.2f}"
        )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
