"""Readiness is earned by encoding (graphs/self_check.py): a path that fails its start-up encode is dropped
and reported, and a server none of whose paths can encode an item kind exits 1 instead of becoming ready."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from graphs.packing import Batch
from graphs.runner import EagerUnavailable, GraphRunner, plan_for
from graphs.self_check import OK, SelfCheckError, self_check
from models import VisualInput, load_tower
from tests.http_helpers import SubprocessServer
from tests.videos import make_video

CPU = torch.device("cpu")


@pytest.fixture
def runner() -> GraphRunner:
    tower = load_tower("tiny-qwen2-vl", device="cpu", dtype="float32")
    r = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=256))
    r.capture()
    return r


def item(tower, grid, modality="image", seed=0) -> VisualInput:
    t, h, w = grid
    rows = np.random.default_rng(seed).integers(0, 256, (t * h * w, tower.processor.patch_dim), np.uint8)
    return VisualInput(modality, rows, grid)


def test_every_path_passes_on_a_sound_runner(runner: GraphRunner) -> None:
    keys = len(runner.pool.graphs)
    results = self_check(runner)
    assert results == {"eager/image": OK, "graphs/image": OK, "eager/video": OK, "graphs/video": OK}
    assert len(runner.pool.graphs) == keys and not runner.pool.failed
    assert runner.stats.as_dict()["self_check"] == results
    assert runner.stats.as_dict()["graph_items"] == 0  # the checks are not traffic


def test_a_failing_graph_path_is_dropped_and_its_items_run_eagerly(runner: GraphRunner, monkeypatch) -> None:
    replay = runner.pool.replay

    def broken(key, pixels, grids):
        if key.modality == "video":
            raise RuntimeError("injected replay failure")
        return replay(key, pixels, grids)

    monkeypatch.setattr(runner.pool, "replay", broken)
    results = self_check(runner)
    assert results["graphs/video"].endswith("RuntimeError: injected replay failure")
    assert results["graphs/image"] == OK and results["eager/video"] == OK
    assert not any(k.modality == "video" for k in runner.pool.graphs)
    assert all(why.startswith("self-check:") for k, why in runner.pool.failed.items() if k.modality == "video")
    video = item(runner.tower, (2, 4, 4), "video")
    batch = runner.pack_items([video])[0]
    assert batch.reason == "capture_failed"
    assert runner.encode([video])[0].embeds.shape[0] == 8


def test_a_failing_eager_path_fails_only_the_batches_that_need_it(runner: GraphRunner, monkeypatch) -> None:
    eager = runner.eager
    monkeypatch.setattr(runner, "eager", lambda pixels, grids, modality="image": (
        (_ for _ in ()).throw(RuntimeError("injected eager failure")) if modality == "image"
        else eager(pixels, grids, modality)))
    results = self_check(runner)
    assert results["eager/image"].endswith("injected eager failure") and results["graphs/image"] == OK
    small = item(runner.tower, (1, 4, 4))
    assert runner.encode([small])[0].embeds.shape[0] == 4  # a graph holds it
    with pytest.raises(EagerUnavailable, match="failed its self-check: RuntimeError: injected eager failure"):
        runner.run_batch(Batch(None, [0], reason="over_budget"), [small])


def test_no_path_for_an_item_kind_is_an_error(runner: GraphRunner, monkeypatch) -> None:
    monkeypatch.setattr(runner.pool, "replay", lambda *a: (_ for _ in ()).throw(RuntimeError("replay broke")))
    monkeypatch.setattr(runner, "eager", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("eager broke")))
    with pytest.raises(SelfCheckError, match="no path can encode images or videos: .*eager broke.*replay broke"):
        self_check(runner)


def test_a_server_with_no_working_path_exits_1_with_the_reason() -> None:
    server = SubprocessServer(env={"VITSERVE_TEST_BROKEN": "graphs/image,eager/image"},
                              launcher="tests.hooks.broken_paths")
    code, out = server.run_to_exit(timeout=120)
    assert code == 1, out[-3000:]
    assert "no path can encode images" in out and "injected replay failure" in out and "injected eager failure" in out


def test_a_server_drops_a_failing_path_reports_it_and_serves_its_items_eagerly() -> None:
    with SubprocessServer(env={"VITSERVE_TEST_BROKEN": "graphs/video"}, launcher="tests.hooks.broken_paths") as srv:
        info = httpx.get(srv.url + "/info", timeout=10).json()
        assert info["self_check"]["graphs/image"] == "ok" and info["self_check"]["eager/video"] == "ok"
        assert "injected replay failure" in info["self_check"]["graphs/video"]
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'vitserve_self_check_failed{path="graphs/video"} 1.0' in metrics
        assert 'vitserve_self_check_failed{path="graphs/image"} 0.0' in metrics
        clip = base64.b64encode(make_video(8, width=112, height=112)).decode()
        buf = io.BytesIO()
        Image.new("RGB", (96, 64), (40, 90, 200)).save(buf, "PNG")
        photo = base64.b64encode(buf.getvalue()).decode()
        r = httpx.post(srv.url + "/encode", json={"items": [{"type": "video", "video": clip},
                                                            {"type": "image", "image": photo}]}, timeout=60)
        assert r.status_code == 200, r.text
        assert [d["index"] for d in r.json()["data"]] == [0, 1]
