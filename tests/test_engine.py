"""The engine on its own (no HTTP): continuous batching, reassembly, cancellation, failures, admission."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from graphs.runner import GraphRunner, plan_for
from models.loader import load_tower
from service.engine.core import (
    Engine,
    EngineFailure,
    ItemError,
    MediaItem,
    NotReady,
    OutputSpec,
    Overloaded,
    RequestRejected,
)
from service.media.image_preprocess import preprocess_image_bytes
from tests.http_helpers import image_bytes, settings

SIZES = [(64, 64), (200, 150), (90, 300), (56, 56), (400, 120), (150, 150)]


@pytest.fixture(scope="module")
def tower():
    return load_tower("tiny-qwen2-vl", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tower3():
    return load_tower("tiny-qwen3-vl", device="cpu", dtype="float32")


def make_engine(tower, **overrides) -> tuple[Engine, GraphRunner]:
    cfg = settings(**overrides)
    plan = plan_for(tower, cfg.max_batch_tokens, cfg.budgets, cfg.max_batch_items, cfg.t_capture)
    runner = GraphRunner(tower, torch.device("cpu"), plan, use_graphs=True)
    runner.capture()
    engine = Engine(cfg, runner=runner)
    engine.start(background=False)
    return engine, runner


def images(n: int, seed: int = 0) -> list[MediaItem]:
    return [MediaItem(i, "image", image_bytes(*SIZES[(i + seed) % len(SIZES)], seed=seed + i)) for i in range(n)]


def reference(runner: GraphRunner, item: MediaItem) -> torch.Tensor:
    visual = preprocess_image_bytes(item.data, runner.tower.processor)
    return runner.encode([visual])[0].embeds


class Recorder:
    """Wraps run_batch: records each batch's items and the thread that ran it; can block or fail."""

    def __init__(self, runner: GraphRunner) -> None:
        self.inner = runner.run_batch
        self.batches: list[list] = []
        self.threads: set[str] = set()
        self.gate: threading.Event | None = None
        self.fail_next = False
        runner.run_batch = self  # type: ignore[method-assign]

    def __call__(self, batch, items):
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            self.gate.wait(30)
        self.batches.append(list(items))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected device failure")
        return self.inner(batch, items)


def test_items_reassemble_in_order_across_batches(tower):
    # Budgets of 64 tokens: the six images need several batches.
    engine, runner = make_engine(tower, max_batch_tokens=64, budgets=[32, 64])
    rec = Recorder(runner)
    items = images(6)

    async def go():
        return await engine.encode(items, OutputSpec())

    try:
        results = asyncio.run(go())
    finally:
        engine.stop()
    assert rec.threads == {"vitserve-engine"}  # only the engine thread touches the runner
    assert len(rec.batches) > 1
    assert [r.index for r in results] == list(range(6))
    for item, res in zip(items, results):
        ref = reference(runner, item)
        assert res.embeds.shape == ref.shape
        torch.testing.assert_close(res.embeds, ref, rtol=1e-4, atol=1e-5)


def test_concurrent_requests_share_batches(tower):
    engine, runner = make_engine(tower, max_wait_ms=50)
    rec = Recorder(runner)

    async def go():
        reqs = [images(2, seed=10 * k) for k in range(5)]
        return reqs, await asyncio.gather(*(engine.encode(r, OutputSpec()) for r in reqs))

    try:
        reqs, outs = asyncio.run(go())
    finally:
        engine.stop()
    assert max(len(b) for b in rec.batches) > 2  # more than one request's items in a batch
    for req, res in zip(reqs, outs):
        for item, r in zip(req, res):
            torch.testing.assert_close(r.embeds, reference(runner, item), rtol=1e-4, atol=1e-5)


def test_cancelled_items_are_skipped(tower):
    engine, runner = make_engine(tower, max_wait_ms=0)
    rec = Recorder(runner)
    rec.gate = threading.Event()

    async def go():
        first = asyncio.ensure_future(engine.encode(images(1), OutputSpec()))
        while not rec.threads:  # the engine holds the first batch at the gate
            await asyncio.sleep(0.01)
        doomed = asyncio.ensure_future(engine.encode(images(3, seed=5), OutputSpec()))
        while engine._queued_items < 3:
            await asyncio.sleep(0.01)
        doomed.cancel()
        await asyncio.sleep(0.05)
        rec.gate.set()
        await first
        with pytest.raises(asyncio.CancelledError):
            await doomed
        await asyncio.sleep(0.2)  # the engine takes and drops the cancelled items

    try:
        asyncio.run(go())
    finally:
        engine.stop()
    assert sum(len(b) for b in rec.batches) == 1
    assert engine.metrics.cancelled._value.get() == 3


def test_failed_batch_fails_its_request_and_the_loop_goes_on(tower):
    engine, runner = make_engine(tower)
    rec = Recorder(runner)
    rec.fail_next = True

    async def go():
        with pytest.raises(EngineFailure) as err:
            await engine.encode(images(2), OutputSpec())
        assert err.value.error_id.startswith("err-")
        return await engine.encode(images(2), OutputSpec())

    try:
        results = asyncio.run(go())
    finally:
        engine.stop()
    assert len(results) == 2 and engine.state == "stopped"


def test_admission_limits(tower):
    engine, runner = make_engine(tower, max_queued_tokens=100, max_concurrent_requests=2, max_wait_ms=0)
    rec = Recorder(runner)
    rec.gate = threading.Event()
    item = [MediaItem(0, "image", image_bytes(200, 150))]  # 35 tokens

    async def go():
        busy = asyncio.ensure_future(engine.encode(item, OutputSpec()))
        while not rec.threads:
            await asyncio.sleep(0.01)
        queued = [asyncio.ensure_future(engine.encode(item, OutputSpec())) for _ in range(2)]
        while engine._queued_items < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(Overloaded):  # 70 queued + 35 > 100
            await engine.encode(item, OutputSpec())
        with pytest.raises(RequestRejected) as err:  # one request alone over the whole queue
            await engine.encode([MediaItem(0, "image", image_bytes(400, 400))], OutputSpec())
        assert err.value.code == "too_many_tokens"
        with engine.request_slot(), engine.request_slot():
            with pytest.raises(Overloaded):
                with engine.request_slot():
                    pass
        rec.gate.set()
        await asyncio.gather(busy, *queued)

    try:
        asyncio.run(go())
    finally:
        engine.stop()
    assert engine.inflight == 0


def test_preprocessing_errors_name_the_item(tower):
    engine, _ = make_engine(tower)
    cfg = engine.processor

    async def expect(items, code, index):
        with pytest.raises(ItemError) as err:
            await engine.encode(items, OutputSpec())
        assert (err.value.code, err.value.index) == (code, index)

    async def go():
        good = images(2)
        await expect([*good, MediaItem(2, "image", b"not an image")], "unsupported_format", 2)
        await expect([MediaItem(0, "image", good[0].data, {"max_pixels": cfg.max_pixels + 1})], "invalid_option", 0)
        await expect([MediaItem(0, "image", good[0].data, {"min_pixels": 10**6, "max_pixels": 10**5})],
                     "invalid_option", 0)
        await expect([MediaItem(0, "image", good[0].data, {"fps": 2.0})], "invalid_option", 0)
        await expect([good[0], MediaItem(1, "video", b"\x00" * 64)], "unsupported_format", 1)

    try:
        asyncio.run(go())
    finally:
        engine.stop()


def test_states_refuse_work(tower):
    cfg = settings()
    engine = Engine(cfg)  # never started

    async def go(e):
        with pytest.raises(NotReady) as err:
            await e.encode(images(1), OutputSpec())
        return err.value.code

    assert asyncio.run(go(engine)) == "starting"
    engine.stop()
    engine, _ = make_engine(tower)
    engine.begin_drain()
    with pytest.raises(NotReady, match="shutting down"):  # new requests are refused...
        engine.check_accepting()

    async def admitted():  # ...but one that already holds a slot still runs to completion
        with engine.request_slot():
            return await engine.encode(images(1), OutputSpec())

    assert len(asyncio.run(admitted())) == 1
    assert asyncio.run(engine.wait_idle(1.0))
    engine.stop()
    assert asyncio.run(go(engine)) == "stopped"


def test_output_layouts_qwen3(tower3):
    engine, runner = make_engine(tower3)
    item = MediaItem(0, "image", image_bytes(320, 256), id="abc")
    spec = OutputSpec(dtype=torch.bfloat16, deepstack=True, joined=True, ec_cache=True)

    async def go():
        return (await engine.encode([item], spec))[0]

    try:
        res = asyncio.run(go())
    finally:
        engine.stop()
    ref = runner.encode([preprocess_image_bytes(item.data, tower3.processor)])[0]
    n, d = ref.embeds.shape
    assert len(res.deepstack) == tower3.num_deepstack == 2
    assert res.embeds.dtype == torch.bfloat16 and res.embeds.device.type == "cpu"
    assert res.joined.shape == (n, d * 3) and res.joined.dtype == torch.bfloat16
    assert torch.equal(res.joined, torch.cat([res.embeds, *res.deepstack], dim=-1))
    assert res.ec_cache.dtype == torch.float32  # the served dtype
    torch.testing.assert_close(res.ec_cache, torch.cat([ref.embeds, *ref.deepstack], -1), rtol=1e-4, atol=1e-5)
    assert res.id == "abc" and res.num_tokens == n and res.queue_s >= 0 and res.preprocess_s > 0


def test_batching_window_holds_for_requests_still_preprocessing(tower):
    """A batch waits (up to the window) for a request whose items are still being preprocessed."""
    engine, runner = make_engine(tower, max_wait_ms=5000)
    rec = Recorder(runner)
    slow_item = images(1, seed=3)
    inner = engine._preprocess

    def preprocess(item, cfg):
        if item.data == slow_item[0].data:
            time.sleep(0.3)  # still preprocessing when the other request is queued
        return inner(item, cfg)

    engine._preprocess = preprocess  # type: ignore[method-assign]

    async def go():
        return await asyncio.gather(engine.encode(images(1), OutputSpec()), engine.encode(slow_item, OutputSpec()))

    try:
        first, _ = asyncio.run(go())
    finally:
        engine.stop()
    assert [len(b) for b in rec.batches] == [2]
    assert first[0].queue_s >= 0.2  # it waited for the slow one


def test_lone_request_does_not_wait_for_the_window(tower):
    """With nothing else being preprocessed, no other item can join in time: the batch goes at once."""
    engine, runner = make_engine(tower, max_wait_ms=5000)
    rec = Recorder(runner)

    async def go():
        first = await engine.encode(images(1), OutputSpec())
        await asyncio.sleep(0.05)  # arrives after the first was queued: the next batch
        second = await engine.encode(images(1, seed=3), OutputSpec())
        return first, second

    try:
        first, second = asyncio.run(go())
    finally:
        engine.stop()
    assert [len(b) for b in rec.batches] == [1, 1]
    assert first[0].queue_s < 2.0 and second[0].queue_s < 2.0  # far below the 5 s window


def test_cuda_without_an_index_is_resolved_to_the_current_device(monkeypatch) -> None:
    """`--device cuda` must reach torch.cuda.set_device with an index (it refuses a bare "cuda")."""
    import torch

    from models.loader import resolve_device
    from service.engine import loading

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("auto") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    calls: list = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    loading.bind_device(torch.device("cuda"))
    loading.bind_device(torch.device("cuda", 1))
    assert calls == [3, torch.device("cuda", 1)]


def test_requests_with_different_outputs_share_a_batch_and_get_their_own(tower3):
    """One batch, two requests: one wants bf16 without DeepStack, the other float32 with it. Each item's
    host tensors are its own rows, in its own dtype (the batch crosses to the host once per output)."""
    engine, runner = make_engine(tower3, max_wait_ms=5000)
    rec = Recorder(runner)
    same_size = [MediaItem(i, "image", image_bytes(*SIZES[0], seed=10 + i)) for i in range(3)]
    a_items, b_items = same_size[:2], [MediaItem(0, "image", same_size[2].data)]

    async def go():
        return await asyncio.gather(
            engine.encode(a_items, OutputSpec(dtype=torch.bfloat16)),
            engine.encode(b_items, OutputSpec(dtype=torch.float32, deepstack=True)),
        )

    try:
        a, b = asyncio.run(go())
    finally:
        engine.stop()
    assert [len(x) for x in rec.batches] == [3]
    for item, res in zip(a_items, a):
        ref = reference(runner, item)
        assert res.embeds.dtype == torch.bfloat16 and res.deepstack == []
        assert torch.allclose(res.embeds.float(), ref, rtol=1e-2, atol=1e-2)
    for item, res in zip(b_items, b):
        visual = preprocess_image_bytes(item.data, runner.tower.processor)
        ref = runner.encode([visual])[0]
        assert res.embeds.dtype == torch.float32 and len(res.deepstack) == len(ref.deepstack) >= 2
        assert torch.allclose(res.embeds, ref.embeds, atol=1e-5)
        for got, want in zip(res.deepstack, ref.deepstack):
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
