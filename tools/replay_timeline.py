"""Where one `GraphRunner.encode` of a small workload spends its time on the device: the wait before its
first GPU operation (the host packing and launching), every kernel in order with the idle gap before it,
and the tail after the last one, from one profiled call (torch.profiler, CUDA and CPU clocks aligned).
Kernels are grouped by name (products, attention, norms, rotary, the rest) with counts, busy and gap time;
the floor's graph is profiled the same way (a row with kernels "floor"), and each single-batch workload's
graph is also timed replaying alone (`replay_ms`: graph_ms less the host's packing, staging and copies).

    python3 tools/replay_timeline.py OUT.jsonl [MODEL] [WORKLOAD ...]   # random:qwen3-vl-8b 1x448 32x224
    --no-batch-invariant: the products as torch picks them; --ladders=exact,powers_of_two,steps_4: the budget
    ladders to capture (exact: the default ladder plus a budget of exactly the workload's tokens; only: that budget
    alone, the quickest to capture);
    --unfused=a,b: also graphs captured with those fused kernels (models/kernels.py KERNELS) off, their torch
    paths instead (what the fusion saves); --rounds=N (5): timings alternate between every graph set and the floor

Run it on the GPU when a tower's kernels or the replay path change; read it beside tools/padding_probe.py.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphs.budgets import auto_budgets  # noqa: E402
from graphs.runner import GraphRunner, plan_for  # noqa: E402
from models import kernels, load_tower  # noqa: E402
from service.bench.towers import cuda_time, floor_graph, random_items, tower_dims, workloads  # noqa: E402

GROUPS = (  # first match names a kernel's group
    ("attention", ("sdpa", "flash", "fmha", "attn")),
    ("attention setup", ("qkv_tma_setup", "_ragged_metadata", "Memset")),
    ("products", ("nvjet", "gemm", "cutlass", "sm90_xmma", "cublas", "_scaled_mm")),
    ("norms", ("norm",)),
    ("rotary", ("rotary",)),
    ("copies", ("Memcpy",)),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k.lower() in low for k in keys):
            return group
    return "other"


def timeline(prof: profile) -> dict:
    """The device's operations of the profiled call in start order, each with the idle gap before it."""
    events = list(prof.events())
    host = [e for e in events if e.name == "encode" and e.device_type == DeviceType.CPU]
    # The device's own work only: record_function's range also shows on the GPU timeline, as an annotation
    # spanning every kernel, which would count them all twice and hide the gaps.
    gpu = sorted((e for e in events if e.device_type == DeviceType.CUDA and e.name != "encode"
                  and not getattr(e, "is_user_annotation", False)), key=lambda e: e.time_range.start)
    start = host[0].time_range.start
    ops, previous_end = [], start
    for e in gpu:
        ops.append({"name": e.name[:90], "group": group_of(e.name), "start_us": round(e.time_range.start - start, 2),
                    "busy_us": round(e.time_range.end - e.time_range.start, 2),
                    "gap_us": round(max(0.0, e.time_range.start - previous_end), 2)})
        previous_end = max(previous_end, e.time_range.end)
    groups: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "busy_us": 0.0, "gap_us": 0.0})
    for op in ops[1:]:
        g = groups[op["group"]]
        g["count"] += 1
        g["busy_us"] = round(g["busy_us"] + op["busy_us"], 2)
        g["gap_us"] = round(g["gap_us"] + op["gap_us"], 2)
    first_kernel = next((op["start_us"] for op in ops if op["group"] != "copies"), None)
    return {"host_call_us": round(host[0].time_range.end - start, 2),
            # the replay on the device, from its first kernel (past the inputs' copies) to the end
            "replay_us": None if first_kernel is None else round(previous_end - start - first_kernel, 2),
            "first_op_us": ops[0]["start_us"] if ops else None,
            "device_end_us": round(previous_end - start, 2), "ops": len(ops),
            "busy_us": round(sum(op["busy_us"] for op in ops), 2),
            "gaps_after_first_us": round(sum(op["gap_us"] for op in ops[1:]), 2),
            "groups": dict(groups), "order": ops}


def profiled(fn) -> dict:
    """`timeline` of one profiled call of fn."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("encode"):
            fn()
        torch.cuda.synchronize()
    return timeline(prof)


LADDERS = {"exact": lambda tokens: sorted(set(auto_budgets(16384)) | {tokens}),
           "only": lambda tokens: [tokens],
           "powers_of_two": lambda tokens: auto_budgets(16384),
           "steps_4": lambda tokens: auto_budgets(16384, steps_per_octave=4)}


def main(out_path: str, name: str = "random:qwen3-vl-8b", *names: str, invariant: bool = True,
         ladders: tuple[str, ...] = ("exact",), unfused: frozenset[str] = frozenset(), rounds: int = 5) -> None:
    """Every (kernel set, budget ladder) captured side by side and timed in alternation with the floor, `rounds`
    times (each a median of ten calls), so that a difference between them is not the machine's drift."""
    tower = load_tower(name, device="cuda", dtype="bfloat16", batch_invariant=invariant)
    fused = set(kernels._enabled)
    kernel_sets = {"fused": fused, **({"unfused": fused - unfused} if unfused else {})}
    dims = tower_dims(tower)
    with open(out_path, "a") as out, torch.inference_mode():
        for wname in names or ("1x448", "32x224"):
            grids = workloads(tower.processor.patch_size)[wname]
            items = random_items(tower, grids)
            tokens = sum(tower.geometry.units(g) for g in grids)
            runners = {}
            for kset, enabled in kernel_sets.items():
                kernels.set_enabled(enabled)  # read while capturing: the graphs keep what they captured
                for ladder in ladders:
                    runner = GraphRunner(tower, torch.device("cuda"), plan_for(tower, budgets=LADDERS[ladder](tokens)),
                                         modalities=("image",))
                    runner.capture()
                    runners[kset, ladder] = runner
            kernels.set_enabled(fused)
            floor_fn = floor_graph(dims, grids, tower)
            times: dict = {key: [] for key in runners}
            floors = []
            for _ in range(rounds):
                floors.append(cuda_time(floor_fn))
                for key, runner in runners.items():
                    times[key].append(cuda_time(lambda r=runner, batch=items: r.encode(batch)))
            floor = statistics.median(floors)
            floor_row = {"model": name, "workload": wname, "tokens": tokens, "kernels": "floor",
                         "floor_ms": round(floor, 3), **profiled(floor_fn)}
            print(json.dumps({k: v for k, v in floor_row.items() if k != "order"}), flush=True)
            out.write(json.dumps(floor_row) + "\n")
            for (kset, ladder), runner in runners.items():
                ms = statistics.median(times[kset, ladder])
                batches = runner.pack_items(items)
                # the graph's replay alone, without the host's packing, staging and output copies
                replay_ms = round(cuda_time(runner.pool.graphs[batches[0].key].graph.replay), 3) \
                    if len(batches) == 1 and batches[0].key in runner.pool.graphs else None
                row = {"model": name, "workload": wname, "tokens": tokens, "batch_invariant": invariant,
                       "kernels": kset, "unfused": sorted(unfused) if kset == "unfused" else [], "ladder": ladder,
                       "batches": [str(b.key) for b in batches], "graph_ms": round(ms, 3), "replay_ms": replay_ms,
                       "rounds_ms": [round(t, 3) for t in times[kset, ladder]], "floor_ms": round(floor, 3),
                       "floor_rounds_ms": [round(t, 3) for t in floors], "over_floor": round(ms / floor, 3),
                       **profiled(lambda r=runner, batch=items: r.encode(batch))}
                print(json.dumps({k: v for k, v in row.items() if k != "order"}), flush=True)
                out.write(json.dumps(row) + "\n")
            for runner in runners.values():
                runner.pool.graphs.clear()
            del runners
            torch.cuda.empty_cache()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    main(*args, invariant="--no-batch-invariant" not in sys.argv,
         ladders=tuple(opts.get("ladders", "exact").split(",")),
         unfused=frozenset(opts.get("unfused", "").split(",")) - {""}, rounds=int(opts.get("rounds", 5)))
