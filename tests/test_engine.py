"""The engine on its own (no HTTP): worker processes preparing media, the batcher, the in-process backend;
reassembly, cancellation, failures, admission, states and the shared memory it leaves behind (none)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from graphs.runner import GraphRunner, plan_for
from models.loader import load_tower
from service.engine.batcher import MAX_INFLIGHT, Throughput
from service.engine.core import Engine
from service.engine.executor import BatchExecutor
from service.engine.types import EngineFailure, ItemError, ItemResult, MediaItem, NotReady, Overloaded, RequestRejected
from service.media.image_preprocess import preprocess_image_bytes
from service.workers.jobs import load_rows
from tests.http_helpers import image_bytes, settings, shm_entries
from tests.videos import make_video

SIZES = [(64, 64), (200, 150), (90, 300), (56, 56), (400, 120), (150, 150)]


@pytest.fixture(scope="module")
def tower():
    return load_tower("tiny-qwen2-vl", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tower3():
    return load_tower("tiny-qwen3-vl", device="cpu", dtype="float32")


def make_runner(tower, **overrides) -> GraphRunner:
    cfg = settings(**overrides)
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower, cfg.max_batch_tokens, cfg.budgets,
                                                             cfg.max_batch_items, cfg.t_capture))
    runner.capture()
    return runner


def run(tower, body, runner: GraphRunner | None = None, **overrides):
    """`body(engine, runner)` on a started engine, in one event loop; the engine stops afterwards and has
    left no shared-memory segment behind."""
    runner = runner or make_runner(tower, **overrides)
    engine = Engine(settings(**overrides), runner=runner)

    async def main():
        engine.start()
        while not engine.ready:
            assert engine.state == "starting", engine.load_error
            await asyncio.sleep(0.01)
        try:
            return await body(engine, runner)
        finally:
            engine.stop()

    result = asyncio.run(main())
    assert shm_entries(engine.names.prefix) == []  # segments and the pool of retired files
    return result


def images(n: int, seed: int = 0) -> list[MediaItem]:
    return [MediaItem(i, "image", image_bytes(*SIZES[(i + seed) % len(SIZES)], seed=seed + i)) for i in range(n)]


def levels(engine: Engine, res: ItemResult) -> list[torch.Tensor]:
    """The result's main embedding and DeepStack levels, read back from its segment."""
    rows = load_rows(res.output)
    hidden = engine.model.out_hidden_size
    return [rows[:, j:j + hidden] for j in range(0, rows.shape[1], hidden)]


def reference(runner: GraphRunner, item: MediaItem):
    return runner.encode([preprocess_image_bytes(item.data, runner.tower.processor)])[0]


class Recorder:
    """Wraps the runner's `run`: records each batch's item count and the thread that ran it; can block or fail."""

    def __init__(self, runner: GraphRunner) -> None:
        self.inner = runner.run
        self.batches: list[int] = []
        self.threads: set[str] = set()
        self.gate: threading.Event | None = None
        self.fail_next = False
        runner.run = self  # type: ignore[method-assign]

    def __call__(self, batch, items, staged=None):
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            self.gate.wait(30)
        self.batches.append(len(items))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected device failure")
        return self.inner(batch, items, staged)


def test_items_reassemble_in_order_across_batches(tower):
    runner = make_runner(tower, max_batch_tokens=64, budgets=[32, 64])  # the six images need several batches
    rec = Recorder(runner)
    items = images(6)

    async def body(engine, runner):
        results = await engine.encode(items)
        try:
            return [(r.index, levels(engine, r)[0].clone()) for r in results]
        finally:
            engine.release(results)

    out = run(tower, body, runner, max_batch_tokens=64, budgets=[32, 64])
    assert rec.threads == {"vitserve-engine-0"}  # only the engine's dispatch thread touches the runner
    assert len(rec.batches) > 1
    assert [i for i, _ in out] == list(range(6))
    for item, (_, embeds) in zip(items, out):
        torch.testing.assert_close(embeds, reference(runner, item).embeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("inline_bytes", [0, 1 << 30])
def test_media_reach_the_workers_inline_or_through_a_segment_alike(tower, monkeypatch, inline_bytes):
    from service.engine import core

    monkeypatch.setattr(core, "INLINE_MEDIA_BYTES", inline_bytes)  # 0: every item through a segment
    runner = make_runner(tower)
    items = images(3)

    async def body(engine, runner):
        results = await engine.encode(items)
        try:
            return [levels(engine, r)[0].clone() for r in results]
        finally:
            engine.release(results)

    for item, embeds in zip(items, run(tower, body, runner)):  # and no segment left behind
        torch.testing.assert_close(embeds, reference(runner, item).embeds, rtol=1e-4, atol=1e-5)


def test_concurrent_requests_share_batches(tower):
    runner = make_runner(tower)
    rec = Recorder(runner)
    reqs = [images(2, seed=10 * k) for k in range(5)]

    async def body(engine, runner):
        outs = await asyncio.gather(*(engine.encode(r) for r in reqs))
        try:
            return [[levels(engine, r)[0].clone() for r in res] for res in outs]
        finally:
            for res in outs:
                engine.release(res)

    outs = run(tower, body, runner, max_wait_ms=50)
    assert max(rec.batches) > 2  # more than one request's items in a batch
    for req, res in zip(reqs, outs):
        for item, embeds in zip(req, res):
            torch.testing.assert_close(embeds, reference(runner, item).embeds, rtol=1e-4, atol=1e-5)


def test_a_cancelled_request_never_reaches_the_device(tower):
    runner = make_runner(tower, max_wait_ms=0, max_batch_items=1)
    rec = Recorder(runner)
    rec.gate = threading.Event()

    async def body(engine, runner):
        busy = [asyncio.ensure_future(engine.encode(images(1, seed=k))) for k in range(MAX_INFLIGHT)]
        while len(engine.batcher._inflight) < MAX_INFLIGHT:  # the engine's slots taken, the first held at the gate
            await asyncio.sleep(0.01)
        doomed = asyncio.ensure_future(engine.encode(images(3, seed=5)))
        while len(engine.batcher.queue) < 3:
            await asyncio.sleep(0.01)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        rec.gate.set()
        for res in await asyncio.gather(*busy):
            engine.release(res)
        return engine.metrics.cancelled._value.get()

    assert run(tower, body, runner, max_wait_ms=0, max_batch_items=1) == 3
    assert rec.batches == [1] * MAX_INFLIGHT


def test_a_batch_writing_its_outputs_leaves_its_device_slot_to_the_next(tower, monkeypatch):
    # A batch whose rows are on the host no longer holds one of the engine's device slots: while its
    # outputs are written, as many more batches as there are slots are staged and run.
    runner = make_runner(tower, max_wait_ms=0, max_batch_items=1)
    rec = Recorder(runner)
    writing, gate = threading.Event(), threading.Event()
    finish = BatchExecutor.finish

    def held_finish(self, running):
        if not writing.is_set():
            writing.set()
            gate.wait(30)
        return finish(self, running)

    monkeypatch.setattr(BatchExecutor, "finish", held_finish)

    async def body(engine, runner):
        requests = [asyncio.ensure_future(engine.encode(images(1, seed=k))) for k in range(MAX_INFLIGHT + 1)]
        for _ in range(1000):
            if len(rec.batches) == MAX_INFLIGHT + 1:
                break
            await asyncio.sleep(0.01)
        ran_while_writing = len(rec.batches)
        gate.set()
        for res in await asyncio.gather(*requests):
            engine.release(res)
        registry = engine.metrics.registry
        return (ran_while_writing, registry.get_sample_value("vitserve_device_duration_seconds_count"),
                registry.get_sample_value("vitserve_device_duration_seconds_sum"))

    ran_while_writing, device_batches, device_s = run(tower, body, runner, max_wait_ms=0, max_batch_items=1)
    assert ran_while_writing == MAX_INFLIGHT + 1
    assert device_batches == MAX_INFLIGHT + 1 and device_s > 0  # each batch's compute time, measured in the engine


def test_failed_batch_fails_its_request_and_the_engine_goes_on(tower):
    runner = make_runner(tower)
    rec = Recorder(runner)
    rec.fail_next = True

    async def body(engine, runner):
        with pytest.raises(EngineFailure) as err:
            await engine.encode(images(2))
        assert err.value.error_id.startswith("err-")
        results = await engine.encode(images(2))
        engine.release(results)
        return len(results)

    assert run(tower, body, runner) == 2


def test_admission_counts_estimated_tokens_before_decoding(tower):
    runner = make_runner(tower, max_queued_tokens=100, max_wait_ms=0, max_batch_items=1)
    rec = Recorder(runner)
    rec.gate = threading.Event()
    item = [MediaItem(0, "image", image_bytes(200, 150))]  # 35 tokens

    async def body(engine, runner):
        busy = [asyncio.ensure_future(engine.encode(item)) for _ in range(MAX_INFLIGHT)]
        while len(engine.batcher._inflight) < MAX_INFLIGHT:
            await asyncio.sleep(0.01)
        queued = [asyncio.ensure_future(engine.encode(item)) for _ in range(2)]
        while engine.admission.reserved < 70:
            await asyncio.sleep(0.01)
        with pytest.raises(Overloaded):  # 70 queued + 35 > 100
            await engine.encode(item)
        with pytest.raises(RequestRejected) as err:  # one request alone over the whole queue
            await engine.encode([MediaItem(0, "image", image_bytes(400, 400))])
        assert err.value.code == "too_many_tokens"
        with engine.request_slot(), engine.request_slot():
            assert engine.inflight == 2
        rec.gate.set()
        for res in await asyncio.gather(*busy, *queued):
            engine.release(res)
        return engine.workers.counters["jobs"], engine.admission.reserved

    jobs, reserved = run(tower, body, runner, max_queued_tokens=100, max_wait_ms=0, max_batch_items=1)
    assert reserved == 0 and jobs == MAX_INFLIGHT + 2 + 2  # one per request, the two refused ones included


def test_an_engine_back_from_a_restart_is_measured_from_its_return():
    """Batches queued while the engine was down (at 2 s; back at 10 s) cost it only their time since its
    return: 1000 tokens every 0.5 s is 2000 tokens/s, not the 141 it would be charged with its downtime."""
    rate = Throughput(since=10.0)
    for k in range(Throughput.MIN_BATCHES):
        assert rate.rate is None
        rate.add(1000, ready=2.0, done=10.5 + 0.5 * k)
    assert rate.rate == pytest.approx(2000)


def test_preprocessing_errors_name_the_item(tower):
    async def body(engine, runner):
        cfg = engine.processor

        async def expect(items, code, index):
            with pytest.raises(ItemError) as err:
                await engine.encode(items)
            assert (err.value.code, err.value.index) == (code, index)

        good = images(2)
        await expect([*good, MediaItem(2, "image", b"not an image")], "unsupported_format", 2)
        await expect([MediaItem(0, "image", good[0].data, {"max_pixels": cfg.max_pixels + 1})], "invalid_option", 0)
        await expect([MediaItem(0, "image", good[0].data, {"min_pixels": 10**6, "max_pixels": 10**5})],
                     "invalid_option", 0)
        await expect([MediaItem(0, "image", good[0].data, {"fps": 2.0})], "invalid_option", 0)
        await expect([good[0], MediaItem(1, "video", b"\x00" * 64)], "unsupported_format", 1)
        # One bound sent past the processor's other one: taken as transformers takes it, not refused.
        below_min = cfg.min_pixels - 136
        (small,) = await engine.encode([MediaItem(0, "image", good[0].data, {"max_pixels": below_min})])
        want = preprocess_image_bytes(good[0].data, cfg, max_pixels=below_min).grid_thw
        assert small.grid_thw == want and want[1] * want[2] * cfg.patch_size**2 <= below_min
        clip = make_video(8, width=64, height=48)
        (video,) = await engine.encode([MediaItem(0, "video", clip, {"max_pixels": cfg.video.min_pixels // 4})])
        assert video.modality == "video"
        engine.release([small, video])

    run(tower, body)


def test_an_item_prepared_as_its_sibling_fails_leaves_no_pixels_or_tokens(tower):
    """The item fails and, in the same turn of the loop, its sibling's media finish preparing. The request
    fails before that sibling is queued; the sibling's pixels and admitted tokens must not stay behind
    (`run` checks that no segment is left)."""
    async def body(engine, runner):
        real = engine._prepare
        prepared, failing = asyncio.Event(), asyncio.Event()

        async def prepare(request, item, tally):
            if item.index == 1:
                await prepared.wait()
                failing.set()  # wakes the sibling, which then finishes behind this failure
                raise ItemError(1, "refused", "unsupported_format")
            work = await real(request, item, tally)
            prepared.set()
            await failing.wait()
            return work

        engine._prepare = prepare
        with pytest.raises(ItemError):
            await engine.encode(images(2))
        await asyncio.sleep(0.05)
        return engine.admission.reserved

    assert run(tower, body) == 0


def test_states_refuse_work(tower):
    engine = Engine(settings())  # never started

    async def refused(e):
        with pytest.raises(NotReady) as err:
            await e.encode(images(1))
        return err.value.code

    assert asyncio.run(refused(engine)) == "starting"

    async def body(engine, runner):
        engine.begin_drain()
        with pytest.raises(NotReady, match="shutting down"):  # new requests are refused...
            engine.check_accepting()
        with engine.request_slot():  # ...but one that already holds a slot still runs to completion
            results = await engine.encode(images(1))
        engine.release(results)
        assert await engine.wait_idle(1.0)
        return engine

    engine = run(tower, body)
    assert asyncio.run(refused(engine)) == "stopped"


def test_results_carry_every_deepstack_level_in_the_served_dtype(tower3):
    item = MediaItem(0, "image", image_bytes(320, 256), id="abc")

    async def body(engine, runner):
        res = (await engine.encode([item]))[0]
        try:
            return res, [t.clone() for t in levels(engine, res)]
        finally:
            engine.release([res])

    res, got = run(tower3, body)
    runner = make_runner(tower3)
    ref = reference(runner, item)
    assert res.output.dtype == "float32" and res.output.width == 3 * ref.embeds.shape[1]
    assert len(got) == 1 + tower3.num_deepstack == 3
    for a, b in zip(got, [ref.embeds, *ref.deepstack]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert res.id == "abc" and res.num_tokens == ref.embeds.shape[0] and res.queue_s >= 0 and res.preprocess_s > 0


def test_lone_request_does_not_wait_for_the_window(tower):
    """With nothing else being prepared, no other item can join in time: the batch goes at once."""
    runner = make_runner(tower, max_wait_ms=5000)
    rec = Recorder(runner)

    async def body(engine, runner):
        out = []
        for seed in (0, 3):
            res = await engine.encode(images(1, seed=seed))
            out.append(res[0].queue_s)
            engine.release(res)
        return out

    waits = run(tower, body, runner, max_wait_ms=5000)
    assert rec.batches == [1, 1] and max(waits) < 2.0  # far below the 5 s window


def test_the_window_holds_a_batch_for_items_still_being_prepared(tower):
    runner = make_runner(tower, max_wait_ms=5000)
    rec = Recorder(runner)
    slow = images(1, seed=6)  # the same size as images(1): they can share a batch

    async def body(engine, runner):
        prepare = engine._prepare
        first_prepared = asyncio.Event()

        async def slowly(request, item, tally):
            if item.data == slow[0].data:  # still preparing 0.3 s after the other request's item is ready
                await first_prepared.wait()
                await asyncio.sleep(0.3)
                return await prepare(request, item, tally)
            try:
                return await prepare(request, item, tally)
            finally:
                first_prepared.set()

        engine._prepare = slowly
        res = await asyncio.gather(engine.encode(images(1)), engine.encode(slow))
        for r in res:
            engine.release(r)
        return res[0][0].queue_s

    waited = run(tower, body, runner, max_wait_ms=5000)
    assert rec.batches == [2] and waited >= 0.25  # the first waited for the slow one to join it


def test_cuda_without_an_index_is_resolved_to_the_current_device(monkeypatch) -> None:
    """`--device cuda` must reach torch.cuda.set_device with an index (it refuses a bare "cuda")."""
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


def test_workers_that_cannot_fork_fail_the_start_with_the_reason(tower, monkeypatch):
    """The workers fork while the model loads; a fork server that cannot fork fails the start (the server
    exits saying why) instead of a ready server whose media work never runs."""
    from service.workers import pool as pool_module

    def no_fork_server(context):
        raise OSError("the fork server's socket is gone")

    monkeypatch.setattr(pool_module, "wait_for_fork_server", no_fork_server)
    engine = Engine(settings(), runner=make_runner(tower))

    async def main():
        engine.start()
        try:
            while engine.state == "starting":
                await asyncio.sleep(0.01)
        finally:
            engine.stop()

    asyncio.run(main())
    assert engine.state == "failed"
    assert engine.load_error == ("RuntimeError: the worker processes failed to start: OSError: the fork server's "
                                 "socket is gone")
