"""Where device memory goes while a tower loads and captures under `--gpu-memory` (GPU only).

    python tools/memory_probe.py random:qwen2.5-vl-7b 4GiB OUT_DIR

Records the allocator's history, logs allocated/reserved before every capture, and on the first
capture failure (or at the end) writes the live blocks grouped by the innermost frame in this
project's code, largest first."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from graphs.pool import GraphPool
from service.engine.loading import build_runner
from service.settings import ServeSettings

MIB = 2**20


def by_site(snapshot: dict) -> list[tuple[str, int]]:
    sites: Counter = Counter()
    for seg in snapshot["segments"]:
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = block.get("frames") or []
            ours = [f for f in frames if any(p in f["filename"] for p in ("/models/", "/graphs/", "/service/"))]
            where = f"{ours[0]['filename'].split('/')[-1]}:{ours[0]['line']} {ours[0]['name']}" if ours else "?"
            sites[(where, seg.get("segment_pool_id", (0, 0)) != (0, 0))] += block["size"]
    return [(f"{w}{' [graph pool]' if pooled else ''}", n) for (w, pooled), n in sites.most_common(25)]


def main() -> None:
    import logging

    logging.basicConfig(level=logging.INFO)
    model, budget, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=400000)
    log: list[dict] = []
    original = GraphPool._capture_one
    dumped = {"done": False}

    def traced(self, key, cap):
        torch.cuda.synchronize()
        row = dict(key=str(key), patches=cap.patches, allocated_mib=torch.cuda.memory_allocated() / MIB,
                   reserved_mib=torch.cuda.memory_reserved() / MIB, t=time.perf_counter())
        try:
            return original(self, key, cap)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            if not dumped["done"]:
                dumped["done"] = True
                (out / "memory_at_failure.json").write_text(json.dumps(by_site(torch.cuda.memory._snapshot()),
                                                                      indent=1))
            raise
        finally:
            row["after_allocated_mib"] = torch.cuda.memory_allocated() / MIB
            row["after_reserved_mib"] = torch.cuda.memory_reserved() / MIB
            log.append(row)

    GraphPool._capture_one = traced  # type: ignore[method-assign]
    settings = ServeSettings(model=model, device="cuda", dtype="bfloat16",
                             gpu_memory=None if budget == "none" else budget)
    try:
        runner = build_runner(settings)
        print("built:", runner.stats.as_dict()["captured_graphs"], "graphs, pool MiB",
              runner.stats.pool_bytes / MIB, flush=True)
    except Exception as exc:  # noqa: BLE001 - the probe reports whatever happened
        print("build failed:", exc, flush=True)
    (out / "memory_end.json").write_text(json.dumps(by_site(torch.cuda.memory._snapshot()), indent=1))
    (out / "memory_captures.jsonl").write_text("\n".join(json.dumps(r) for r in log))
    print("max allocated MiB", torch.cuda.max_memory_allocated() / MIB, "max reserved MiB",
          torch.cuda.max_memory_reserved() / MIB, flush=True)
    for r in log[:6] + log[-2:]:
        print(r, flush=True)


if __name__ == "__main__":
    main()
