"""GPU only: `--gpu-memory`. A real server sizes its graph pool to a tight budget and, serving mixed traffic
(images of several sizes and a video, with and without DeepStack), never holds more device memory than
the budget: by the allocator's own peak plus the memory outside it, and by NVML where it reports the
engine process."""

from __future__ import annotations

import base64
import gc
import io
import logging
from concurrent.futures import ThreadPoolExecutor

import av
import httpx
import numpy as np
import pytest

from service.preflight import EXIT_FAILED
from tests.http_helpers import ServerThread, SubprocessServer, b64, image_bytes, settings

pytestmark = pytest.mark.cuda
BUDGET_GIB = 4
MODEL = "random:qwen2.5-vl-7b"


def video_bytes(frames: int = 16, side: int = 336) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=4)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        rng = np.random.default_rng(0)
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


def nvml_used(pid: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory:
                    return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001 - no per-process accounting in this container
        return None
    return None


def test_a_server_under_a_memory_budget_stays_within_it():
    limit = BUDGET_GIB * 2**30
    cfg = settings(model=MODEL, device="cuda", dtype="bfloat16", gpu_memory=f"{BUDGET_GIB}GiB", max_wait_ms=5,
                   max_batch_tokens=16384, preprocess_workers=4)
    video = b64(video_bytes())
    bodies = []
    for k in range(24):
        side = [224, 448, 672, 1008][k % 4]
        items = [{"type": "image", "image": b64(image_bytes(side, side * 3 // 4, seed=k, fmt="JPEG"))}]
        if k % 6 == 0:
            items.append({"type": "video", "video": video})
        bodies.append({"items": items, "encoding_format": "base64", "dtype": "bfloat16",
                       "include_deepstack": bool(k % 2)})
    with ServerThread(cfg) as srv, srv.client(timeout=300) as c:
        info = c.get("/info").json()
        assert max(info["budgets"]) < 16384  # the budget shrank the pool
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda b: httpx.post(srv.url + "/encode", json=b, timeout=300), bodies))
        assert [r.status_code for r in responses] == [200] * len(bodies), [r.text[:200] for r in responses]
        for r in responses:
            for entry in r.json()["data"]:
                assert len(base64.b64decode(entry["embedding"])) == entry["shape"][0] * entry["shape"][1] * 2
        memory = c.get("/info").json()["memory"]
        engine_pid = srv.engine.backends[0].pid
        used = nvml_used(engine_pid)
        metrics = c.get("/metrics").text
    print("memory:", {k: (round(v / 2**30, 3) if isinstance(v, int) else v) for k, v in memory.items()},
          "NVML:", used and round(used / 2**30, 3))
    assert memory["limit"] == limit
    assert memory["peak_reserved"] + memory["outside_allocator"] <= limit
    if used is not None:
        assert used <= limit
    assert 'vitserve_gpu_memory_bytes{gpu="0",kind="graph_pool"}' in metrics


def test_a_budget_below_the_weights_refuses_to_start_and_says_what_it_needs():
    cmd = SubprocessServer("--device", "cuda", "--dtype", "bfloat16", "--max-batch-tokens", "16384",
                           "--gpu-memory", "1GiB", model=MODEL)
    code, out = cmd.run_to_exit(timeout=300)
    assert code == EXIT_FAILED, out[-3000:]
    assert "--gpu-memory 1GiB (1.00 GiB) is too small" in out and "GiB in all" in out, out[-3000:]


def test_an_underestimated_budget_backs_off_to_budgets_whose_graphs_fit(monkeypatch, caplog):
    """The probe made to say a tenth of the truth: the sizing picks budgets whose captures run out of the
    capped memory, and the engine captures again with the budgets below them, within the budget."""
    import torch

    from service.engine import memory
    from service.engine.loading import build_runner

    caplog.set_level(logging.INFO, logger="vitserve.engine")
    # What earlier tests in this process left to the collector would count as the weights' share.
    gc.collect()
    torch.cuda.empty_cache()
    measured = memory.capture_bytes_per_token
    monkeypatch.setattr(memory, "capture_bytes_per_token", lambda tower, device: measured(tower, device) / 10)
    limit = BUDGET_GIB * 2**30
    cfg = settings(model=MODEL, device="cuda", dtype="bfloat16", gpu_memory=f"{BUDGET_GIB}GiB", max_batch_tokens=16384)
    try:
        runner = build_runner(cfg)
        failed = {str(k): why for k, why in runner.pool.failed.items()}
        report = memory.report(runner, cfg.gpu_memory)
        print("backed off to", runner.plan.budgets, "memory:", report)
        assert not failed, failed
        assert runner.plan.max_budget < 16384
        assert runner.stats.captured == len(runner.plan.keys(runner.modalities))
        assert report["peak_reserved"] + report["outside_allocator"] <= limit
        pixels = np.random.default_rng(0).integers(0, 256, (1024, runner.tower.processor.patch_dim), np.uint8)
        from models.config import VisualInput

        [out] = runner.encode([VisualInput("image", pixels, (1, 32, 32))])
        assert out.embeds.shape[0] == 256 and torch.isfinite(out.embeds.float()).all()
    finally:
        print("\n".join(r.getMessage() for r in caplog.records if "memory" in r.getMessage()))
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
