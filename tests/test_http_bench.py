"""`vitserve bench --http` on the CPU: a real `vitserve serve` subprocess with tiny-qwen2-vl, two small
concurrency levels, the engine-only reference in this process, and the loopback-only rule."""

from __future__ import annotations

import json
import multiprocessing
import socket
import struct
import time

import pytest

from service.bench import http as http_bench
from service.bench.http_client import DROPPED, BenchError, run_level, steady_rate
from service.bench.http_server import LOOP_STALL_KEY, check_loopback, stage_means
from service.cli import main
from tests.http_helpers import QuietHandler, free_port, loopback_http_server, server_url

LEVEL_FIELDS = {"concurrency", "requests", "ok", "errors", "dropped_connections", "server_dropped_connections",
                "elapsed_s", "images_per_s",
                "p50_ms", "p90_ms", "p99_ms",
                "mean_ms", "max_ms", "stopped_by", "client_cpu_util", "server_ms", "items_per_batch_by_engine",
                "steady_images_per_s", "in_flight_mean", "start_late_s"}
ENGINE_FIELDS = {"device", "dtype", "graphs", "tokens_per_image", "single_ms", "single_preprocess_ms",
                 "single_encode_ms", "single_after_idle_ms", "single_after_idle_preprocess_ms", "batch_images",
                 "batch_ms", "batch_preprocess_ms", "batch_encode_ms", "images_per_s", "encode_only_images_per_s",
                 "single_reps", "batch_reps"}
TARGET_FIELDS = {"reference", "saturation", "engine_replicas", "throughput_ratio", "throughput_ratio_target",
                 "throughput_ratio_met", "latency_concurrency", "latency_p50_ms", "latency_overhead_ms",
                 "latency_overhead_target_ms", "latency_overhead_met", "steady_throughput_ratio",
                 "latency_overhead_after_idle_ms"}


def test_http_bench_on_cpu(tmp_path, capsys):
    out = tmp_path / "run.json"
    # Small budgets and few repetitions: a 448x448 image costs 0.1-0.5 s on this 2-core machine.
    result = http_bench.run(model="tiny-qwen2-vl", concurrency=[4, 1], requests_per_level=6, level_time_s=60,
                            max_batch_tokens=512, out=out, distinct_images=2, warmup_requests=2, single_reps=3,
                            batch_reps=1, log=lambda s: None)
    assert json.loads(out.read_text()) == result
    summary = capsys.readouterr().out
    assert "None" not in summary and "missed" not in summary and "not judged" in summary  # GPU targets
    assert result["targets"]["throughput_ratio_met"] is None
    assert set(result) == {"env", "limits", "server", "workload", "engine", "levels", "targets"}
    assert out.with_suffix(".server.log").is_file()

    server = result["server"]
    assert server["spawned"] and server["model"] == "tiny-qwen2-vl" and server["device"] == "cpu"
    assert server["url"].startswith("http://127.0.0.1:") and server["settings"]["max_batch_tokens"] == 512
    work = result["workload"]
    assert (work["width"], work["height"], work["encoding_format"], work["dtype"]) == (448, 448, "base64", "bfloat16")
    assert work["grid_thw"] == [1, 32, 32] and work["tokens_per_image"] == 256 and work["shape"] == [256, 96]

    engine = result["engine"]
    assert set(engine) == ENGINE_FIELDS
    assert engine["tokens_per_image"] == 256 and engine["batch_images"] == 2  # 512 tokens of 256-token images
    assert engine["images_per_s"] > 0 and engine["single_ms"] > engine["single_encode_ms"] > 0

    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4]
    for level in result["levels"]:
        assert set(level) == LEVEL_FIELDS
        assert level["errors"] == {} and level["ok"] == level["requests"] == 6 and level["stopped_by"] == "requests"
        assert level["dropped_connections"] == 0 and level["server_dropped_connections"] == {}
        assert 0 < level["p50_ms"] <= level["p90_ms"] <= level["p99_ms"] <= level["max_ms"]
        assert level["images_per_s"] > 0
        # the server's own means over the level, from its /metrics
        server_ms = level["server_ms"]
        assert set(server_ms) == {"request", "preprocess", "queue", "gpu_per_batch", "render", "worker_wait",
                                 "items_per_batch", "cpu_cores", "body", "parse", "prepare_wall", "engine_wall",
                                 "device_per_batch", "device_busy", "loop_lag", "loop_lag_over_25ms",
                                 "engine_stage", "engine_launch", "engine_write"}
        # A batch's device time is part of its time in the engine; one engine is busy at most all the level.
        assert 0 < server_ms["device_per_batch"] <= server_ms["gpu_per_batch"]
        # So are its host steps there, one after another (on the CPU the forward is the launch).
        steps = [server_ms[f"engine_{step}"] for step in ("stage", "launch", "write")]
        assert all(s > 0 for s in steps) and sum(steps) <= server_ms["gpu_per_batch"] + 0.002  # ms, rounded
        assert 0 < server_ms["device_busy"] <= 1.0
        assert 0 <= server_ms["loop_lag"] < server_ms["request"] + 100  # sampled every 0.1 s, late by some ms
        assert 0 <= server_ms["loop_lag_over_25ms"] <= 1
        # The phases follow each other inside the request (one image per request: nothing overlaps).
        phases = [server_ms[k] for k in ("body", "parse", "prepare_wall", "engine_wall", "render")]
        assert all(p > 0 for p in phases) and sum(phases) <= server_ms["request"] * 1.001 + 0.01
        assert server_ms["prepare_wall"] >= server_ms["preprocess"] and server_ms["engine_wall"] >= server_ms["queue"]
        assert server_ms["cpu_cores"] > 0 and 0 <= server_ms["worker_wait"] < server_ms["request"]
        assert 0 < server_ms["preprocess"] < server_ms["request"] <= level["max_ms"]
        assert 1 <= server_ms["items_per_batch"] <= 2

    targets = result["targets"]
    assert set(targets) == TARGET_FIELDS
    best = max(result["levels"], key=lambda lv: lv["images_per_s"])
    assert targets["saturation"] == {"concurrency": best["concurrency"], "images_per_s": best["images_per_s"]}
    assert targets["throughput_ratio"] == pytest.approx(best["images_per_s"] / engine["images_per_s"], abs=1e-3)
    steady = best["steady_images_per_s"]
    assert targets["steady_throughput_ratio"] == (None if steady is None else
                                                  pytest.approx(steady / engine["images_per_s"], abs=1e-3))
    assert targets["latency_p50_ms"] == result["levels"][0]["p50_ms"]
    assert targets["latency_overhead_ms"] == pytest.approx(result["levels"][0]["p50_ms"] - engine["single_ms"],
                                                           abs=1e-3)
    assert engine["single_after_idle_ms"] > engine["single_after_idle_preprocess_ms"] > 0
    assert targets["latency_overhead_after_idle_ms"] == pytest.approx(
        result["levels"][0]["p50_ms"] - engine["single_after_idle_ms"], abs=1e-3)


class FakeEncode(QuietHandler):
    """/encode that answers 500 for bodies saying "bad", takes 20 ms for bodies saying "slow", closes the
    connection without an answer for "drop" and resets it for "reset"."""

    protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if b"slow" in body:
            time.sleep(0.02)
        if b"drop" in body or b"reset" in body:
            if b"reset" in body:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        self.reply(*((500, b"{}") if b"bad" in body else (200, b'{"data": []}')))


@pytest.fixture(scope="module")
def fake_url():
    with loopback_http_server(FakeEncode) as httpd:
        yield server_url(httpd)


@pytest.mark.parametrize("client", ["http.client", "httpx"])
def test_run_level_bounds_and_errors(fake_url, client):
    level = run_level(fake_url, [b"good", b"bad", b"good"], 3, 30, 60, client=client)
    assert (level["requests"], level["ok"], level["errors"], level["stopped_by"]) == (30, 20, {"500": 10}, "requests")
    assert level["steady_images_per_s"] is None  # stopped by its count: no time window to count in
    level = run_level(fake_url, [b"slow"], 2, 10_000, 0.3, client=client)
    # 2 clients, 20 ms per answer, 0.3 s: at most 30 requests (fewer on a loaded machine), then it stops.
    assert level["stopped_by"] == "time" and level["errors"] == {} and 0 < level["ok"] <= 30
    assert 0 < level["steady_images_per_s"] <= 2 / 0.02
    assert 0 < level["in_flight_mean"] <= 2 and 0 <= level["start_late_s"] < 1
    assert level["elapsed_s"] < 2 and level["p50_ms"] >= 20
    gone = run_level(f"http://127.0.0.1:{free_port()}", [b"x"], 1, 2, 5, client=client)
    assert gone["ok"] == 0 and sum(gone["errors"].values()) == 2  # connection failures are counted, not raised


@pytest.mark.parametrize("client", ["http.client", "httpx"])
def test_a_dropped_connection_is_an_error_counted_apart(fake_url, client):
    """A connection closed or reset without an answer (httpx ReadError, RemoteProtocolError; http.client
    RemoteDisconnected, ConnectionResetError) fails its request and is counted as dropped; the client
    reconnects for the next one."""
    level = run_level(fake_url, [b"good", b"drop", b"good", b"reset"], 1, 12, 60, client=client)
    assert level["ok"] == 6 and sum(level["errors"].values()) == 6, level["errors"]
    assert level["dropped_connections"] == 6, level["errors"]
    assert set(level["errors"]) <= DROPPED
    clean = run_level(fake_url, [b"good", b"bad"], 1, 4, 60, client=client)
    assert clean["dropped_connections"] == 0 and clean["errors"] == {"500": 2}


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://192.168.0.1", "http://[2001:db8::1]:8000",
                                 "ftp://127.0.0.1:8000", "127.0.0.1:8000", "http://no-such-host.invalid:8000"])
def test_refuses_non_loopback_urls(url, tmp_path, capsys):
    assert main(["bench", "--http", "--url", url, "--out", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # refused before anything ran


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.9.9.9", "http://[::1]:8000",
                                 "http://localhost:8000"])
def test_loopback_urls_pass(url):
    host, port = check_loopback(url)
    assert host and port > 0


def test_plain_bench_stays_gpu_only(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert main(["bench", "--out", "unused"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_url_mode_needs_a_vitserve_info(fake_url, tmp_path):
    # A loopback server that is not vitserve (no GET /info): refused before any load or model loading.
    with pytest.raises(BenchError, match="/info answered 501"):
        http_bench.run(url=fake_url, concurrency=[1], out=tmp_path, log=lambda s: None)
    assert list(tmp_path.iterdir()) == []


def test_the_steady_rate_counts_only_answers_inside_its_window():
    ends = [0.5, 1.0, 1.5, 2.0, 2.5, 3.9, 4.0, 4.2]
    assert steady_rate(ends, 1.0, 4.0) == pytest.approx(5 / 3, abs=1e-3)  # 1.0 .. 3.9: start in, stop out
    assert steady_rate(ends, 4.0, 4.0) is None


def test_a_level_spread_over_client_processes_counts_every_request():
    with loopback_http_server(FakeEncode) as httpd:
        level = run_level(server_url(httpd), [b"{}"], concurrency=4, max_requests=20, time_limit_s=30,
                                     processes=2)
    assert level["requests"] == level["ok"] == 20 and level["errors"] == {} and level["stopped_by"] == "requests"


def test_client_processes_start_together_however_slowly_they_spawn(monkeypatch):
    # Each spawned client process imports the main module (the CLI's imports torch): on a loaded host that
    # took seconds. The level must start once every process is ready, not at a time fixed before.
    spawn = multiprocessing.context.SpawnProcess
    original = spawn.start

    def slow_start(self: multiprocessing.process.BaseProcess) -> None:
        original(self)
        time.sleep(1.5)

    monkeypatch.setattr(spawn, "start", slow_start)
    with loopback_http_server(FakeEncode) as httpd:
        level = run_level(server_url(httpd), [b"slow"], concurrency=4, max_requests=10**6,
                                     time_limit_s=1.0, processes=2)
    assert level["errors"] == {} and level["start_late_s"] < 0.5
    assert level["in_flight_mean"] >= 3  # 4 clients, each with a request out nearly all the time


def test_the_summary_says_when_the_saturation_level_stopped_by_its_count(capsys):
    level = {"concurrency": 256, "requests": 512, "images_per_s": 128.8, "steady_images_per_s": None, "p50_ms": 842.8,
             "p90_ms": 1065.1, "p99_ms": 1256.3, "errors": {}, "stopped_by": "requests", "elapsed_s": 3.98}
    engine = {"images_per_s": 235.7, "batch_images": 64, "single_ms": 6.17}
    result = {"levels": [level], "engine": engine, "targets": http_bench.targets([level], engine)}
    http_bench.print_summary(result)
    assert "stopped after 512 requests (4.0 s)" in capsys.readouterr().out
    http_bench.print_summary({**result, "levels": [{**level, "stopped_by": "time"}]})
    assert "stopped after" not in capsys.readouterr().out


def test_the_share_of_loop_lag_samples_over_25_ms_comes_from_the_histograms_buckets():
    """Two fronts' samples are summed: 30 new samples of which 24 were at most 25 ms late."""
    before = {"loop_lag": (0.5, 100.0), LOOP_STALL_KEY: (90.0, 100.0)}
    after = {"loop_lag": (1.5, 130.0), LOOP_STALL_KEY: (114.0, 130.0)}
    means = stage_means(before, after, wall_s=3.0)
    assert means["loop_lag_over_25ms"] == 0.2
    assert means["loop_lag"] == round(1.0 / 30 * 1e3, 3)


def test_the_cache_bench_times_hits_against_misses(tmp_path):
    """`vitserve bench --cache` on the CPU: one image missed, then hit; the server's own times."""
    from service.bench import cache

    out = tmp_path / "cache.json"
    result = cache.run(model="tiny-qwen2-vl", images=1, serve_flags=["--device", "cpu"], out=out, log=lambda s: None)
    assert json.loads(out.read_text()) == result
    assert result["images"] == 1 and result["encoding_format"] == "base64"
    assert 0 < result["hit"]["server"]["median_ms"] and 0 < result["miss"]["server"]["median_ms"]
    assert result["speedup_median"] > 0


def test_the_cache_and_http_benches_run_one_at_a_time(capsys):
    assert main(["bench", "--http", "--cache"]) == 2
    assert "one at a time" in capsys.readouterr().err


def test_sidecar_variants_on_cpu(tmp_path, capsys):
    """--format vllm_ref --cache misses,hits: both variants against one server and one engine reference;
    misses send a new image each time, hits the cached ones, vllm_ref also times the fetch (about 50 s)."""
    result = http_bench.run(model="tiny-qwen2-vl", concurrency=[1], requests_per_level=2, level_time_s=60,
                            max_batch_tokens=512, out=tmp_path, distinct_images=1, warmup_requests=1, single_reps=2,
                            batch_reps=1, formats=["vllm_ref"], caches=["misses", "hits"],
                            sequential_requests=2, log=lambda s: None)
    variants = result["variants"]
    assert [(v["format"], v["cache"]) for v in variants] == [("vllm_ref", "misses"), ("vllm_ref", "hits")]
    assert result["workload"]["encoding_format"] == "vllm_ref" and "levels" not in variants[0]
    for k, v in enumerate(variants):
        assert v["sequential"]["server"]["p50_ms"] > 0
        assert v["fetch"]["shape"] == [256, 96] and v["fetch"]["load"]["p50_ms"] > 0
        assert (result if k == 0 else v)["workload"]["uuid"].startswith("vit-")
    assert variants[1]["levels"][0]["ok"] == 2 and variants[1]["targets"]["latency_p50_ms"] is not None
    summary = capsys.readouterr().out
    assert "vllm_ref" in summary and "fetch p50" in summary
