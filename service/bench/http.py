"""`vitserve bench --http`: a bounded HTTP load benchmark of `vitserve serve` on loopback, against the
engine alone measured in this process on the same images.

The server is either started here (`vitserve serve` as a subprocess on 127.0.0.1) or an already running
one named by `--url`, which must resolve to a loopback address: this tool generates load, and it only
aims it at the machine it runs on. Each concurrency level sends one 448x448 JPEG per request
(`encoding_format: "base64"`, `dtype: "bfloat16"`), from C client threads on keep-alive connections,
until its request count or its time limit is reached. The engine-only reference loads the same model
with the server's settings (read from `/info`) into a `GraphRunner` and times preprocessing plus
`runner.encode`: a full batch for throughput, one image for latency (back to back, and each after a
`IDLE_GAP_S` pause, as a lone request's processes run).

Targets: throughput at saturation >= 0.95x the engine's; p50 at concurrency 1 at most 2 ms above the
engine's single-image latency.

This module runs the whole benchmark and judges it; the load comes from `http_client`, the server under
test and its /metrics from `http_server`, the engine-only figures from `engine_reference`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from service.bench.engine_reference import IDLE_GAP_S, engine_reference
from service.bench.http_client import (
    IMAGE_SIDE,
    BenchError,
    Poster,
    bench_images,
    client_name,
    run_level,
)
from service.bench.http_server import (
    ServerProcess,
    check_loopback,
    drops_between,
    engine_counts,
    get_json,
    items_per_batch,
    server_drops,
    server_stage_totals,
    stage_means,
)
from service.bench.http_sidecar import bodies_for, check_variant, fetch_times, server_times

DEFAULT_CONCURRENCY = [1, 2, 4, 8, 16, 32, 64, 128, 256]
DEFAULT_REQUESTS_PER_LEVEL = 1024
DEFAULT_LEVEL_TIME_S = 30.0
GPU_MODEL, CPU_MODEL = "random:qwen2.5-vl-7b", "tiny-qwen2-vl"
THROUGHPUT_TARGET = 0.95  # HTTP images/s at saturation over engine-only images/s, at least
LATENCY_TARGET_MS = 2.0  # p50 at concurrency 1 minus engine-only single-image latency, at most


def targets(levels: list[dict[str, Any]], engine: dict[str, Any], replicas: int = 1,
            judged: bool = True) -> dict[str, Any]:
    """The two target ratios. With `replicas` engines in the server (`--data-parallel`), the throughput
    reference is that many times the one engine measured here (linear scaling). The targets are set for a
    GPU server: with `judged` False (a CPU server, whose run checks the plumbing) the `*_met` fields are None."""
    best = max(levels, key=lambda lv: lv["images_per_s"])
    reference = engine["images_per_s"] * replicas
    ratio = best["images_per_s"] / reference if reference else None
    steady = best.get("steady_images_per_s")
    steady_ratio = steady / reference if reference and steady is not None else None
    lowest = min(levels, key=lambda lv: lv["concurrency"])
    overhead = lowest["p50_ms"] - engine["single_ms"] if lowest["p50_ms"] is not None else None
    after_idle = engine.get("single_after_idle_ms")
    overhead_idle = lowest["p50_ms"] - after_idle if lowest["p50_ms"] is not None and after_idle else None
    return {
        "saturation": {"concurrency": best["concurrency"], "images_per_s": best["images_per_s"]},
        "engine_replicas": replicas,
        "reference": "the engine alone" if replicas == 1 else
                     f"the engine alone on one GPU, times {replicas} (linear scaling over --data-parallel {replicas})",
        "throughput_ratio": round(ratio, 3) if ratio is not None else None,
        "throughput_ratio_target": THROUGHPUT_TARGET,
        "throughput_ratio_met": (ratio is not None and ratio >= THROUGHPUT_TARGET) if judged else None,
        "steady_throughput_ratio": round(steady_ratio, 3) if steady_ratio is not None else None,
        "latency_concurrency": lowest["concurrency"],
        "latency_p50_ms": lowest["p50_ms"],
        "latency_overhead_ms": round(overhead, 3) if overhead is not None else None,
        "latency_overhead_target_ms": LATENCY_TARGET_MS,
        "latency_overhead_met": (overhead is not None and overhead <= LATENCY_TARGET_MS) if judged else None,
        "latency_overhead_after_idle_ms": round(overhead_idle, 3) if overhead_idle is not None else None,
    }


def environment() -> dict[str, Any]:
    import torch

    env = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "torch": torch.__version__,
           "machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        env["cpu"] = platform.processor()
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def run(*, model: str | None = None, url: str | None = None, concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
        requests_per_level: int = DEFAULT_REQUESTS_PER_LEVEL, level_time_s: float = DEFAULT_LEVEL_TIME_S,
        max_batch_tokens: int = 16384, serve_flags: Sequence[str] = (), out: Path | None = None,
        distinct_images: int = 4, warmup_requests: int = 8, single_reps: int = 20, batch_reps: int = 5,
        ready_timeout_s: float = 900, client: str = "http.client", client_processes: int = 1,
        formats: Sequence[str] = ("base64",), caches: Sequence[str] = ("misses",), sequential_requests: int = 50,
        log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole benchmark; returns (and writes to `out`, when given) the result document.

    Each (format, cache) pair (`http_sidecar`) is a variant measured against the one engine reference. The
    default, base64 and misses, gives the document its usual shape; any other choice adds `variants`, each
    with its levels and targets, the server's own time of sequential requests, and for vllm_ref the
    connector's fetch of one output (the top-level fields are then the first variant's)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    levels_wanted = sorted(set(concurrency))
    if not levels_wanted or levels_wanted[0] < 1 or requests_per_level < 1 or level_time_s <= 0:
        raise BenchError("concurrency levels, --requests-per-level and the level time must be positive")
    Poster("http://127.0.0.1", None, 1, client).close()  # an unknown or missing client fails here, not in 256 threads
    api_key = None
    if url is not None:
        check_loopback(url)
        url = url.rstrip("/")
        api_key = os.environ.get("VITSERVE_API_KEY") or None
    images = bench_images(distinct_images)
    variants_wanted = [(f, c) for f in formats for c in caches]
    sidecar = variants_wanted != [("base64", "misses")]
    for fmt, cache in variants_wanted:
        bodies_for(images, fmt, cache)  # a bad choice fails here, before a server starts
    json_path = output_path(out)

    def measure(base_url: str, spawned: list[str] | None) -> dict[str, Any]:
        status, info = get_json(base_url + "/info", api_key)
        if status != 200 or not isinstance(info, dict):
            raise BenchError(f"GET {base_url}/info answered {status or 'nothing'} (set VITSERVE_API_KEY?)")
        s = info.get("settings", {})
        if model and spawned is None and s.get("model") != model:
            raise BenchError(f"--model {model} but the server at {base_url} serves {s.get('model')}")
        server = {"url": base_url, "spawned": spawned is not None, "command": spawned, "model": s.get("model"),
                  "family": info.get("family"), "device": info.get("device"), "dtype": info.get("dtype"),
                  "settings": {k: s.get(k) for k in ("max_batch_tokens", "budgets", "budget_steps", "max_batch_items",
                                                     "max_wait_ms", "preprocess_workers", "eager", "t_capture",
                                                     "data_parallel")},
                  # one per front (each front's /info shows its own share of the settings), or behind one front
                  "engines": int((info.get("front") or {}).get("of") or s.get("data_parallel") or 1)}
        # With several engines (--data-parallel) the reference is one engine on the first of their devices,
        # counted as many times (linear scaling): `targets` says so.
        first_device = str(info["device"]).split(",")[0]
        log(f"server: {server['model']} on {server['device']} ({server['dtype']}); engine-only reference on "
            f"{first_device} ...")
        engine = engine_reference(
            images, model=str(s["model"]), device=first_device, dtype=str(info["dtype"]),
            max_batch_tokens=int(s["max_batch_tokens"]), budgets=s.get("budgets"),
            max_batch_items=s.get("max_batch_items"), t_capture=int(s.get("t_capture") or 8),
            budget_steps=int(s.get("budget_steps") or 1),
            eager=bool(s.get("eager")), workers=int(s.get("preprocess_workers") or 2), single_reps=single_reps,
            batch_reps=batch_reps)
        log(f"engine: {engine['images_per_s']:.1f} images/s ({engine['batch_images']} per batch), "
            f"{engine['single_ms']:.2f} ms for one image")
        variants = []
        for fmt, cache in variants_wanted:
            bodies = bodies_for(images, fmt, cache)
            log(f"variant: encoding_format {fmt}, cache {cache}")
            variants.append(measure_variant(base_url, bodies, fmt, cache, engine, str(info["device"]), server))
        first = variants[0]
        body = {"server": server, "workload": first["workload"], "engine": engine, "levels": first["levels"]}
        if sidecar:
            body["variants"] = variants
        return body

    def measure_variant(base_url: str, bodies: Any, fmt: str, cache: str, engine: dict[str, Any], device: str,
                        server: dict[str, Any]) -> dict[str, Any]:
        workload = {"distinct_images": len(images), "width": IMAGE_SIDE, "height": IMAGE_SIDE, "format": "JPEG",
                    "jpeg_bytes": [len(i) for i in images], "encoding_format": fmt, "cache": cache,
                    "dtype": "bfloat16", **check_variant(base_url, bodies[0], api_key, fmt, client)}
        for i in range(warmup_requests):  # one at a time, cycling through the images
            check_variant(base_url, bodies[i % len(bodies)], api_key, fmt, client)
        levels = []
        for c in levels_wanted:
            before = server_stage_totals(base_url, api_key)
            engines_before = engine_counts(base_url, api_key)
            drops_before = server_drops(base_url, api_key)
            level = run_level(base_url, bodies, c, requests_per_level, level_time_s, api_key, client=client,
                              processes=min(client_processes, c))
            level["server_ms"] = stage_means(before, server_stage_totals(base_url, api_key), level["elapsed_s"])
            level["items_per_batch_by_engine"] = items_per_batch(engines_before, engine_counts(base_url, api_key))
            # The server's side of the level's dropped connections, by reason (its log has a line for each).
            level["server_dropped_connections"] = drops_between(drops_before, server_drops(base_url, api_key))
            levels.append(level)
            steady = f" ({level['steady_images_per_s']} steady)" if level["steady_images_per_s"] is not None else ""
            log(f"c={c:4d}: {level['images_per_s']:9.1f} images/s{steady}  "
                f"p50 {_ms(level['p50_ms'])} ms  p90 {_ms(level['p90_ms'])} "
                f"ms  p99 {_ms(level['p99_ms'])} ms  errors {sum(level['errors'].values())} "
                f"(dropped connections {level['dropped_connections']}, server: {level['server_dropped_connections']}; "
                f"{level['stopped_by']}); "
                f"in flight {level['in_flight_mean']} (clients late {level['start_late_s']} s); "
                f"server means {level['server_ms']}")
        out = {"format": fmt, "cache": cache, "workload": workload, "levels": levels,
               "targets": targets(levels, engine, server["engines"], judged=device.startswith("cuda"))}
        if sidecar:
            out["sequential"] = server_times(base_url, bodies, sequential_requests, api_key)
            out["sequential"].pop("entry")
            log(f"sequential: server p50 {out['sequential']['server']['p50_ms']} ms, client p50 "
                f"{out['sequential']['client']['p50_ms']} ms")
            if fmt == "vllm_ref":
                out["fetch"] = fetch_times(base_url, workload["uuid"], sequential_requests, api_key,
                                           device.split(",")[0])
                log(f"connector fetch: p50 {out['fetch']['load']['p50_ms']} ms (server "
                    f"{out['fetch']['server']['p50_ms']} ms)")
        return out

    limits = {"concurrency": levels_wanted, "requests_per_level": requests_per_level, "level_time_s": level_time_s,
              "client_processes": client_processes,
              "warmup_requests": warmup_requests, "engine_single_reps": single_reps, "engine_batch_reps": batch_reps}
    if url is None:
        name = model or default_model()
        # The encoder-output cache off unless a variant needs it (vllm_ref answers from it, hits read it): the
        # engine's path alone.
        needs_cache = any(f == "vllm_ref" or c == "hits" for f, c in variants_wanted)
        flags = ["--max-batch-tokens", str(max_batch_tokens), *([] if needs_cache else ["--cache-bytes", "0"]),
                 *serve_flags]
        if json_path is not None:
            log_path = json_path.with_name(json_path.stem + ".server.log")
        else:
            fd, tmp = tempfile.mkstemp(prefix="vitserve-http-bench-", suffix=".server.log")
            os.close(fd)
            log_path = Path(tmp)
        with ServerProcess(name, flags, log_path, ready_timeout_s) as srv:
            log(f"started {shlex.join(srv.cmd)} (log: {log_path})")
            body = measure(srv.url, srv.cmd)
    else:
        body = measure(url, None)
    result = {"env": {**environment(), "client": client_name(client)}, "limits": limits, **body,
              "targets": targets(body["levels"], body["engine"], body["server"]["engines"],
                                 judged=str(body["server"]["device"]).startswith("cuda"))}
    if "variants" in result:  # the first variant's document is the top level's: no copy of it
        result["variants"][0] = {k: v for k, v in result["variants"][0].items()
                                 if k not in ("workload", "levels", "targets")}
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
    print_summary(result)
    if "variants" in result:
        print_variants(result)
    return result


def default_model() -> str:
    import torch

    return GPU_MODEL if torch.cuda.is_available() else CPU_MODEL


def output_path(out: Path | None) -> Path | None:
    """`--out x.json` is the file; any other `--out` is a folder holding http_bench.json. A spawned
    server's log goes next to it (`<stem>.server.log`), or to a temporary file without `--out`."""
    if out is None:
        return None
    path = out if out.suffix == ".json" else out / "http_bench.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _ms(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def _verdict(met: bool | None) -> str:
    return "" if met is None else f": {'met' if met else 'missed'}"


def print_summary(result: dict[str, Any]) -> None:
    """The levels as a table, then the ratios against the engine alone; a figure that was not measured
    (no success in a level, a level stopped by its count) is left out, not printed as None."""
    e, t = result["engine"], result["targets"]
    print(f"{'concurrency':>11} {'images/s':>10} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'errors':>7} "
          f"{'dropped':>7}")
    for lv in result["levels"]:
        print(f"{lv['concurrency']:>11} {lv['images_per_s']:>10.1f} {_ms(lv['p50_ms']):>9} "
              f"{_ms(lv['p90_ms']):>9} {_ms(lv['p99_ms']):>9} {sum(lv['errors'].values()):>7} "
              f"{lv.get('dropped_connections', 0):>7}")
    print(f"engine only: {e['images_per_s']:.1f} images/s (batch of {e['batch_images']}), {e['single_ms']:.2f} ms "
          "for one image (preprocessing included)")
    judged = t["throughput_ratio_met"] is not None
    if not judged:
        print("targets: not judged, this server runs on the CPU (they are set for a GPU server; a CPU run checks "
              "that the path works)")
    if t["throughput_ratio"] is not None:
        steady = t["steady_throughput_ratio"]
        print(f"throughput at saturation / engine: {t['throughput_ratio']} (target >= {THROUGHPUT_TARGET}"
              f"{_verdict(t['throughput_ratio_met'])})"
              + (f"; after the level's first quarter: {steady}" if steady is not None else ""))
    best = next(lv for lv in result["levels"] if lv["concurrency"] == t["saturation"]["concurrency"])
    if best["stopped_by"] == "requests":
        print(f"note: the c={best['concurrency']} level stopped after {best['requests']} requests "
              f"({best['elapsed_s']:.1f} s), start included: for a throughput at saturation, give the levels "
              "time (--level-time-s) and a --requests-per-level they do not reach")
    if t["latency_overhead_ms"] is not None:
        print(f"p50 at concurrency {t['latency_concurrency']} - engine single image: {t['latency_overhead_ms']} ms "
              f"(target <= {LATENCY_TARGET_MS} ms{_verdict(t['latency_overhead_met'])})")
    if t.get("latency_overhead_after_idle_ms") is not None:
        print(f"  against the engine timed after {IDLE_GAP_S * 1e3:.0f} ms idle ({e['single_after_idle_ms']:.2f} ms): "
              f"{t['latency_overhead_after_idle_ms']} ms")


def _choices(value: str | None, default: str) -> list[str]:
    return [v.strip() for v in (value or default).split(",") if v.strip()]


def print_variants(result: dict[str, Any]) -> None:
    """Per variant (--format x --cache): p50 at the lowest concurrency against the engine alone, the server's
    own time of sequential requests, and for vllm_ref the connector's fetch of one output."""
    e = result["engine"]
    print(f"{'format':>9} {'cache':>7} {'p50 ms':>8} {'- engine':>9} {'server p50':>11} {'fetch p50':>10}")
    for k, v in enumerate(result["variants"]):
        levels = result["levels"] if k == 0 else v["levels"]
        lowest = min(levels, key=lambda lv: lv["concurrency"])
        p50 = lowest["p50_ms"]
        over = f"{p50 - e['single_ms']:+.2f}" if p50 is not None else "-"
        fetch = v.get("fetch", {}).get("load", {}).get("p50_ms")
        print(f"{v['format']:>9} {v['cache']:>7} {_ms(p50):>8} {over:>9} "
              f"{_ms(v['sequential']['server']['p50_ms']):>11} {_ms(fetch):>10}")


def run_from_args(args: argparse.Namespace) -> int:
    """`vitserve bench --http ...`: 0 when every request succeeded, 1 with errors, 2 when it cannot run."""
    try:
        levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else DEFAULT_CONCURRENCY
        result = run(model=args.model, url=args.url, concurrency=levels,
                     requests_per_level=args.requests_per_level or DEFAULT_REQUESTS_PER_LEVEL,
                     level_time_s=args.level_time_s or DEFAULT_LEVEL_TIME_S, max_batch_tokens=args.max_batch_tokens,
                     serve_flags=shlex.split(args.serve_flags or ""), out=args.out,
                     client_processes=getattr(args, "client_processes", None) or 1,
                     formats=_choices(getattr(args, "format", None), "base64"),
                     caches=_choices(getattr(args, "cache", None), "misses"))
    except (BenchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1 if any(lv["errors"] for lv in result["levels"]) else 0
