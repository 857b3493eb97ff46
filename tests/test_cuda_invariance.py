"""GPU only: every family serves in bf16, fp16 and fp32 through graphs and eager, within its own error of
float32, and an item's bytes are the same alone and in any batch (tests/cuda_dtype_check.py, one fresh
process per dtype); a head dim that no packed kernel takes natively serves and matches transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from models.presets import PRESETS

pytestmark = pytest.mark.cuda
ROOT = Path(__file__).resolve().parents[1]
FULL = ["random:qwen2-vl-7b", "random:qwen2.5-vl-7b", "random:qwen3-vl-8b", "random:glm-4.1v-9b",
        "random:qwen3-vl-30b-a3b", "random:qwen3.5-27b", "random:qwen2.5-omni-7b", "random:qwen3-omni-30b-a3b",
        "random:exaone-4.5-33b"]
TINY = [n for n in PRESETS if n.startswith("tiny-")]
# In fp16 and fp32 the full-size towers are the four every family is built from (the others differ from
# them in wiring, which their tiny presets check in every dtype).
PRESETS_BY_DTYPE = {"bfloat16": FULL + TINY, "float16": FULL[:4] + TINY, "float32": FULL[:4] + TINY,
                    "bfloat16+fp8": FULL[:4] + TINY}  # --quantization fp8 (graphs/precision.py)
# On random weights the load gate refuses GLM-4.1V's FP8 (its gated MLP alone falls below the bar;
# docs/performance.md, "FP8"): it must be refused with its figure, never served below the bar.
FP8_REFUSED = {"random:glm-4.1v-9b"}


def child_env() -> dict[str, str]:
    """A fresh interpreter that imports this checkout first, then what this one imports."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.parametrize("dtype", list(PRESETS_BY_DTYPE))
def test_every_family_serves_each_dtype_batch_invariantly(dtype: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.cuda_dtype_check", dtype, *PRESETS_BY_DTYPE[dtype]],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=900)
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for r in reports:
        print(json.dumps(r))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(reports) == len(PRESETS_BY_DTYPE[dtype])
    refused = [r for r in reports if dtype.endswith("+fp8") and r["preset"] in FP8_REFUSED]
    assert all("QuantizationRefused" in r.get("exception", "") and "below the bar" in r["exception"]
               for r in refused), refused
    assert all(r["ok"] for r in reports if r not in refused), [r for r in reports if not r["ok"] and r not in refused]


def test_a_head_dim_off_a_multiple_of_8_serves_and_matches_transformers(tmp_path: Path) -> None:
    """Head dim 36 (a distilled Qwen2.5-VL-style tower): varlen_attn takes it zero-padded, graphs included."""
    from graphs.runner import GraphRunner, plan_for
    from models import VisualInput, load_tower
    from models.presets import TINY_QWEN2_5, TINY_QWEN2_PRE, Preset
    from tests.checkpoints import reference_features, write_checkpoint

    PRESETS["tiny-head-dim-36"] = Preset("qwen2_5_vl", {**TINY_QWEN2_5, "hidden_size": 72, "num_heads": 2},
                                         TINY_QWEN2_PRE)
    try:
        model = write_checkpoint("tiny-head-dim-36", tmp_path)
    finally:
        del PRESETS["tiny-head-dim-36"]
    tower = load_tower(str(tmp_path), device="cuda", dtype="bfloat16")
    assert tower.head_dim == 36 and tower.backend in ("varlen", "sdpa")
    runner = GraphRunner(tower, torch.device("cuda"), plan_for(tower, max_batch_tokens=512))
    runner.capture()
    assert not runner.pool.failed, runner.pool.failed
    rng = np.random.default_rng(0)
    grids = [(1, 16, 12), (1, 8, 8)]
    items = [VisualInput("image", rng.integers(0, 256, (t * h * w, tower.processor.patch_dim), np.uint8), (t, h, w))
             for t, h, w in grids]
    got = torch.cat([o.embeds for o in runner.encode(items)]).float().cpu()
    pixels = torch.from_numpy(tower.processor.normalize(np.concatenate([i.pixels for i in items])))
    ref, _ = reference_features(model.float(), pixels, grids)
    err = ((got - ref.float()).norm() / ref.float().norm()).item()
    assert err < 2e-2, err


def test_vitserve_encode_serves_float32_on_cuda(tmp_path: Path) -> None:
    """The symptom that started it: every fp32 capture failed and `vitserve encode` exited 1."""
    out = tmp_path / "out.safetensors"
    cmd = [sys.executable, "-m", "service.cli", "encode", "--model", "random:qwen2.5-vl-7b", "--device", "cuda",
           "--dtype", "float32", "--max-batch-tokens", "1024", "--output", str(out), "--stats",
           str(ROOT / "service/assets/sample.jpg")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=child_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["graph_items"] == 1 and not stats["capture_failures"], stats
