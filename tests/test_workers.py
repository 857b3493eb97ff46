"""The worker pool that runs media work: results and errors come back, a cancelled or abandoned job's process
is killed within a second and replaced, a job over the memory bound is killed, a crash costs one worker,
and owners take turns."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from service.media.errors import MediaError
from service.shm import PREFIX as SEGMENT_PREFIX
from service.shm import SHM_DIR, unlink
from service.workers.pool import JobFailed, Owner, WorkerDied, WorkerPool
from service.workers.processes import resident_bytes

JOBS = "tests.hooks.jobs"


def run(size: int, scenario: Callable[[WorkerPool], Awaitable[Any]], **kwargs: Any) -> Any:
    """`scenario` on a pool of `size` workers, on uvloop as the server runs (it makes the pool's
    descriptors non-blocking, which the default loop does not)."""
    import uvloop

    async def main() -> Any:
        pool = WorkerPool(size, **kwargs)
        pool.start()
        try:
            return await scenario(pool)
        finally:
            pool.stop()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie no longer runs
    except FileNotFoundError:
        return False


async def until(condition: Callable[[], bool], timeout: float) -> float:
    """Seconds until `condition` held; fails after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def busy_pid(pool: WorkerPool) -> int:
    (worker,) = [w for w in pool._workers if w.job is not None]
    return worker.process.pid


def test_results_errors_and_questions() -> None:
    async def scenario(pool: WorkerPool) -> None:
        owner = Owner("r")
        assert await pool.call(owner, f"{JOBS}:echo", {"a": [1, 2]}) == {"a": [1, 2]}
        with pytest.raises(MediaError) as bad:  # the input's fault: handed back as it is
            await pool.call(owner, f"{JOBS}:bad_input")
        assert bad.value.code == "corrupt_image"
        with pytest.raises(JobFailed) as failed:  # a bug: the traceback comes along for the log
            await pool.call(owner, f"{JOBS}:bug")
        assert "ZeroDivisionError" in str(failed.value) and "Traceback" in failed.value.details
        assert await pool.call(owner, f"{JOBS}:ask", 20, on_ask=lambda q: q + 1) == 21

        def refuse(question: Any) -> Any:
            raise OverflowError(f"over the queue limit: {question}")

        with pytest.raises(OverflowError):  # the caller's refusal ends the job
            await pool.call(owner, f"{JOBS}:ask", 5, on_ask=refuse)
        assert await pool.call(owner, f"{JOBS}:echo", "still serving") == "still serving"
        assert pool.stats()["restarts"] == 0

    run(2, scenario)


def test_cancelling_an_owner_kills_its_running_job_within_a_second() -> None:
    async def scenario(pool: WorkerPool) -> None:
        doomed, other = Owner("doomed"), Owner("other")
        task = asyncio.ensure_future(pool.call(doomed, f"{JOBS}:spin", 60))
        queued = asyncio.ensure_future(pool.call(doomed, f"{JOBS}:spin", 60))
        await until(lambda: pool.stats()["busy"] == 2, 10)
        pids = [w.process.pid for w in pool._workers]
        pool.cancel(doomed)
        for t in (task, queued):
            with pytest.raises(asyncio.CancelledError):
                await t
        assert await until(lambda: not any(alive(p) for p in pids), 1.0) < 1.0
        await until(lambda: pool.stats()["workers"] == 2, 5)
        assert pool.stats()["killed_cancelled"] == 2
        assert await pool.call(other, f"{JOBS}:echo", 1) == 1  # the replacements serve
        with pytest.raises(asyncio.CancelledError):  # a cancelled owner starts nothing new
            await pool.call(doomed, f"{JOBS}:echo", 1)

    run(2, scenario)


def test_a_caller_that_gives_up_abandons_the_job_and_its_process() -> None:
    async def scenario(pool: WorkerPool) -> None:
        owner = Owner("r")
        call = pool.call(owner, f"{JOBS}:spin", 60)
        task = asyncio.ensure_future(call)
        await until(lambda: pool.stats()["busy"] == 1, 10)
        pid = busy_pid(pool)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(task, 0.2)
        assert await until(lambda: not alive(pid), 1.0) < 1.0
        assert pool.stats()["killed_cancelled"] == 1
        assert await pool.call(owner, f"{JOBS}:echo", 2) == 2

    run(1, scenario)


@pytest.mark.parametrize("kill_lands", [True, False])
def test_an_abandoned_job_leaves_no_segment_whenever_its_kill_lands(kill_lands: bool) -> None:
    """The front unlinks a cancelled item's segment at once, but its worker may still write it before the
    kill lands, or even answer: the pool unlinks the job's `leaves` once the worker answered or exited."""
    name = f"{SEGMENT_PREFIX}{os.getpid()}_test_leaves_{kill_lands}"

    async def scenario(pool: WorkerPool) -> None:
        if not kill_lands:  # the kill is late: the worker finishes and answers for a job nobody awaits
            pool._kill = lambda worker, reason: setattr(worker, "kill_reason", reason)  # type: ignore[method-assign]
        task = asyncio.ensure_future(pool.call(Owner("r"), f"{JOBS}:write_segment", name, 0.3, leaves=(name,)))
        await until(lambda: pool.stats()["busy"] == 1, 10)
        worker = next(w for w in pool._workers if w.job is not None)
        task.cancel()
        if kill_lands:
            await asyncio.sleep(0.5)  # the segment would have been written by now
            assert not (SHM_DIR / name).exists()
        else:
            await until(lambda: worker.job is None, 5)  # its answer came in
            assert not (SHM_DIR / name).exists()
            worker.process.kill()

    try:
        run(1, scenario)
    finally:
        unlink(name)


def test_a_response_to_encode_goes_before_media_to_prepare_and_waits_are_reported() -> None:
    """Finishing a request frees its memory and its slot: a queued priority-0 job runs before priority-1
    jobs queued earlier by other owners; every dispatch reports how long the job waited."""
    waits: list[tuple[str, float]] = []
    order: list[str] = []

    async def scenario(pool: WorkerPool) -> None:
        pool.on_wait = lambda fn, seconds: waits.append((fn, seconds))

        async def job(owner: str, value: str, priority: int, seconds: float = 0.0) -> None:
            order.append(await pool.call(Owner(owner), f"{JOBS}:nap", seconds, value, priority=priority))

        first = asyncio.ensure_future(job("a", "busy", 1, 0.3))  # holds the only worker
        await until(lambda: pool.stats()["busy"] == 1, 10)
        later = [asyncio.ensure_future(job("b", "media b", 1)), asyncio.ensure_future(job("c", "media c", 1))]
        await asyncio.sleep(0.05)
        later.append(asyncio.ensure_future(job("d", "response d", 0)))
        await asyncio.gather(first, *later)

    run(1, scenario)
    assert order == ["busy", "response d", "media b", "media c"]
    assert [fn for fn, _ in waits] == ["nap"] * 4
    assert waits[1][1] >= 0.15  # "response d" waited for "busy" to finish


def test_queued_jobs_of_a_cancelled_owner_never_run() -> None:
    async def scenario(pool: WorkerPool) -> None:
        first, second = Owner("first"), Owner("second")
        running = asyncio.ensure_future(pool.call(first, f"{JOBS}:nap", 0.5, "first"))
        await until(lambda: pool.stats()["busy"] == 1, 10)
        queued = [asyncio.ensure_future(pool.call(second, f"{JOBS}:spin", 60)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert pool.stats()["queued"] == 3
        pool.cancel(second)
        assert await running == "first"  # the other owner's job is untouched
        for t in queued:
            with pytest.raises(asyncio.CancelledError):
                await t
        assert pool.stats()["queued"] == 0 and pool.stats()["killed_cancelled"] == 0

    run(1, scenario)


def test_a_job_over_the_memory_bound_is_killed_and_named() -> None:
    async def scenario(pool: WorkerPool) -> None:
        owner = Owner("r")
        baseline = resident_bytes(await pool.call(owner, f"{JOBS}:pid"))
        assert baseline is not None
        pool.memory_limit = baseline + 100 * 2**20
        start = time.monotonic()
        with pytest.raises(WorkerDied) as died:
            await pool.call(owner, f"{JOBS}:hog", 400)
        assert died.value.reason == "memory" and "MiB of memory" in str(died.value)
        assert time.monotonic() - start < 10
        assert pool.stats()["killed_memory"] == 1
        assert await pool.call(owner, f"{JOBS}:echo", 3) == 3

    run(1, scenario)


def test_a_job_that_crashes_twice_fails_alone_and_the_workers_are_replaced() -> None:
    async def scenario(pool: WorkerPool) -> None:
        owner = Owner("r")
        survivor = asyncio.ensure_future(pool.call(owner, f"{JOBS}:nap", 0.3, "ok"))
        with pytest.raises(WorkerDied) as died:
            await pool.call(owner, f"{JOBS}:crash")
        assert died.value.reason == "crash" and "twice" in str(died.value)
        assert await survivor == "ok"
        await until(lambda: pool.states()["idle"] == 2, 10)
        stats = pool.stats()
        assert stats["crashed"] == 2 and stats["retries"] == 1 and stats["restarts_by_cause"] == {"crash": 2}
        assert await pool.call(owner, f"{JOBS}:echo", 4) == 4

    run(2, scenario)


@pytest.mark.parametrize("size", [1, 2])
def test_a_request_with_many_items_does_not_hold_up_another(size: int) -> None:
    """Owner A queues eight jobs first, B one job after: B's runs among the next jobs a worker takes (by the
    order the jobs started in: the order they finished in follows each worker's pace, which a loaded host
    makes uneven). A's jobs last long enough that B is queued while A's first ones still run: with 0.1 s a
    loaded host's event loop once looked only after a third had started."""

    async def scenario(pool: WorkerPool) -> list[str]:
        a, b = Owner("a"), Owner("b")
        started: list[tuple[float, str]] = []

        async def job(owner: Owner, name: str, seconds: float) -> None:
            started.append(tuple(await pool.call(owner, f"{JOBS}:stamped_nap", seconds, name)))

        tasks = [asyncio.ensure_future(job(a, f"a{i}", 0.4)) for i in range(8)]
        await until(lambda: pool.stats()["busy"] == size, 10)
        assert not started, started  # B comes while A's first jobs run
        tasks.append(asyncio.ensure_future(job(b, "b", 0.1)))
        await asyncio.gather(*tasks)
        return [name for _, name in sorted(started)]

    order = run(size, scenario)
    assert order.index("b") <= size, order


def test_workers_exit_when_the_pool_stops() -> None:
    async def scenario(pool: WorkerPool) -> list[int]:
        await until(lambda: pool.states()["idle"] == 2, 10)
        return [w.process.pid for w in pool._workers]

    pids = run(2, scenario)
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)
    assert os.getpid() not in pids


def test_a_job_still_running_when_the_pool_stops_leaves_no_segment() -> None:
    """Stopping fails the running job at once, but its worker may still write the segment before it exits:
    the pool unlinks the job's `leaves` once the workers are gone."""
    name = f"{SEGMENT_PREFIX}{os.getpid()}_test_stop_leaves"

    async def scenario(pool: WorkerPool) -> None:
        task = asyncio.ensure_future(pool.call(Owner("r"), f"{JOBS}:write_segment", name, 0.3, leaves=(name,)))
        await until(lambda: pool.stats()["busy"] == 1, 10)
        pool.stop()  # run() stops it again: a no-op
        with pytest.raises(WorkerDied):
            await task

    try:
        run(1, scenario)
        assert not (SHM_DIR / name).exists()
    finally:
        unlink(name)


def test_workers_run_one_torch_thread_and_leave_the_servers_alone() -> None:
    """A worker is one core's worth of work. The server unpickles the workers' results, which imports
    their module: that import must not set the server's threads, which its CPU engine runs on."""
    assert run(1, lambda pool: pool.call(Owner("t"), f"{JOBS}:torch_threads")) == 1
    code = "import torch; torch.set_num_threads(2); import service.workers.jobs; print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "2"


def test_a_new_worker_is_warmed_up_before_its_first_job() -> None:
    """A fresh worker's first image paid for first-use initialisation (about 230 ms against 2.5 ms on
    the dev box); the pool runs the warm-up in every new worker, replacements included."""

    async def scenario(pool: WorkerPool) -> list[dict[str, Any]]:
        owner = Owner("w")
        first = await pool.call(owner, f"{JOBS}:warm_state")
        with pytest.raises(WorkerDied):
            await pool.call(owner, f"{JOBS}:crash")
        return [first, await pool.call(owner, f"{JOBS}:warm_state")]

    for state in run(1, scenario, warm_up=f"{JOBS}:marked_warm_up"):
        assert state["warmed"] is True
        assert state["pil_plugins"] >= 1  # PIL's image plugins are loaded
        assert state["modules"] == ["service.media.image_preprocess", "service.media.video_preprocess"]


def run_fresh(code: str) -> str:
    """What `code` prints, run in a fresh interpreter from the repository root: a fork server of its own."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_fork_server_preloads_what_the_warm_up_imports() -> None:
    """A new worker (a replacement too) imports nothing of its own beyond Pillow's plugins: the family
    registry, left out once the model package stopped importing it, cost each new worker 0.29 s of CPU."""
    probe = ("import importlib, sys\nfrom service.workers.processes import PRELOAD\n"
             "for m in PRELOAD:\n    importlib.import_module(m)\nbefore = set(sys.modules)\n"
             "from service.workers import jobs\njobs.warm_up()\n"
             "print(sorted(m for m in set(sys.modules) - before if not m.startswith(('PIL.', '_'))))")
    assert run_fresh(probe).splitlines()[-1] == "[]"


def test_the_loop_serves_while_the_fork_server_imports() -> None:
    """Starting the pool returns at once, its workers counted as starting, while the fork server imports
    its modules (made 1.5 s slower here); the first job waits for them and is served. A start that waited
    for the first fork held the event loop (health checks, the model's load) for 2.3 s on 2 cores."""
    probe = ("import asyncio, time\nfrom service.workers import processes\n"
             "processes.PRELOAD = [*processes.PRELOAD, 'tests.hooks.slow_import']\n"
             "from service.workers.pool import Owner, WorkerPool\n"
             "async def main():\n"
             "    pool = WorkerPool(2)\n"
             "    t = time.monotonic()\n"
             "    pool.start()\n"
             "    took, states = time.monotonic() - t, pool.states()\n"
             "    ticks = 0\n"
             "    job = asyncio.ensure_future(pool.call(Owner('o'), 'tests.hooks.jobs:echo', 7))\n"
             "    while not job.done():\n"
             "        await asyncio.sleep(0.01)\n"
             "        ticks += 1\n"
             "    print(round(took, 3), states['starting'], ticks, job.result())\n"
             "    pool.stop()\n"
             "asyncio.run(main())\n")
    took, starting, ticks, result = run_fresh(probe).split()
    assert float(took) < 0.5 and starting == "2" and result == "7"
    assert int(ticks) >= 50, "the loop did not run while the fork server imported"


def test_a_failing_warm_up_leaves_the_worker_serving() -> None:
    assert run(1, lambda pool: pool.call(Owner("w"), f"{JOBS}:echo", 5), warm_up=f"{JOBS}:broken_warm_up") == 5


def test_workers_that_cannot_start_are_retried_ever_more_slowly_until_one_starts(monkeypatch) -> None:
    """A worker dying before it is ready (a broken install) is replaced after a delay that doubles, so the
    pool does not spin a core forking; once a start succeeds, the pool serves at once."""
    from service.workers import pool as pool_module
    from tests.hooks.jobs import FAILING_STARTS

    monkeypatch.setattr(pool_module, "START_RETRY_FIRST_S", 0.2)
    monkeypatch.setattr(pool_module, "START_RETRY_MAX_S", 1.6)
    FAILING_STARTS.touch()

    async def scenario(pool: WorkerPool) -> None:
        await asyncio.sleep(3.0)
        # Waits of 0.2, 0.4, 0.8, 1.6 s: at most 5 starts in 3 s, where a replacement at once after each
        # death made 7 in 2 s on a loaded 2-core box (a start costs about 0.1-0.3 s there)
        assert 2 <= pool.stats()["restarts"] <= 5, pool.stats()
        assert pool.stats()["failed_starts"] == pool.stats()["restarts"]
        assert pool.live == 0 and pool.states()["starting"] == 1
        FAILING_STARTS.unlink()
        assert await asyncio.wait_for(pool.call(Owner("w"), f"{JOBS}:echo", 5), 5) == 5
        assert pool.states() == {"idle": 1, "busy": 0, "starting": 0, "dying": 0}

    try:
        run(1, scenario, warm_up=f"{JOBS}:failing_warm_up")
    finally:
        FAILING_STARTS.unlink(missing_ok=True)


def test_the_engine_warms_up_its_workers() -> None:
    from service.engine.core import Engine
    from service.settings import ServeSettings

    engine = Engine(ServeSettings(model="tiny-qwen2-vl", device="cpu"))
    assert engine.workers.warm_up == "service.workers.jobs:warm_up"


def test_rows_are_read_into_one_thread_buffer_only_for_a_lone_item(monkeypatch) -> None:
    """`views` reads a lone item's rows into the thread's scratch buffer, and several items' into their own."""
    import torch

    from service import shm
    from service.engine.types import OutputRef
    from service.workers import jobs

    names = shm.SegmentNames()
    rows = {n: torch.randn(n, 8).to(torch.bfloat16) for n in (3, 5)}
    results = []
    for n, t in rows.items():
        name = names.next("out")
        shm.write(name, t.view(torch.uint8).numpy().tobytes())
        results.append({"index": n, "modality": "image", "id": None, "grid_thw": [1, 2 * n, 2], "num_patches": 4 * n,
                        "num_tokens": n, "meta": {}, "output": OutputRef(name, n, 8, "bfloat16")})
    try:
        (five,) = jobs.views([results[1]], 4, torch.bfloat16)
        assert torch.equal(five.embeds, rows[5][:, :4]) and torch.equal(five.deepstack[0], rows[5][:, 4:])
        (three,) = jobs.views([results[0]], 4, torch.bfloat16)
        assert torch.equal(three.joined, rows[3])
        assert five.joined.data_ptr() == three.joined.data_ptr()  # the same buffer: the first view is spent
        both = jobs.views(results, 8, torch.float32)  # two items at once: each in memory of its own
        assert [torch.equal(v.embeds, rows[n].float()) for v, n in zip(both, (3, 5))] == [True, True]
        monkeypatch.setattr(jobs, "SCRATCH_MAX_BYTES", 16)
        (alone,) = jobs.views([results[1]], 8, torch.bfloat16)  # over the bound: a buffer of its own
        assert torch.equal(alone.embeds, rows[5]) and alone.joined.data_ptr() != three.joined.data_ptr()
    finally:
        for r in results:
            shm.unlink(r["output"].segment)


def test_an_image_s_header_is_read_once_for_its_estimate_and_its_decode(monkeypatch) -> None:
    """prepare_media reads the header once and hands it to the estimate and the decode; the pixels it
    writes are those of the one-call path."""
    import io

    import numpy as np
    from PIL import Image

    from models.config import ProcessorConfig
    from service import shm
    from service.media import estimate, image_preprocess, images
    from service.media.limits import MediaLimits
    from service.workers import jobs

    buf = io.BytesIO()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (90, 130, 3), dtype=np.uint8)).save(buf, "JPEG")
    data = buf.getvalue()
    cfg, limits = ProcessorConfig(), MediaLimits()
    expected = image_preprocess.preprocess_image_bytes(data, cfg, limits=limits)
    calls = []
    real = images.read_header

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1:])
        return real(*args, **kwargs)

    for module in (images, estimate, image_preprocess):
        monkeypatch.setattr(module, "read_header", counted)
    asked = []

    class Ctx:
        def ask(self, question: Any) -> None:
            asked.append(question)

    name = shm.SegmentNames().next("px")
    try:
        prepared = jobs.prepare_media(Ctx(), data, len(data), "image", cfg, {}, limits, name)
        pixels = np.empty(expected.pixels.size, np.uint8)
        shm.read_into(name, pixels)
    finally:
        shm.unlink(name)
    assert calls == [(limits.max_image_pixels,)]
    assert [a.grid_thw for a in asked] == [tuple(expected.grid_thw)] == [prepared.grid_thw]
    assert np.array_equal(pixels, expected.pixels.reshape(-1))


def test_a_job_whose_channel_fails_twice_fails_as_the_servers_fault() -> None:
    """A channel that fails under the same job twice is not the item's doing: the job fails with reason
    "channel" (the API's 503 worker_lost), not "crash" (its 422 decoder_crashed)."""

    async def scenario(pool: WorkerPool) -> None:
        owner = Owner("r")
        with pytest.raises(WorkerDied) as died:
            await pool.call(owner, f"{JOBS}:lose_channel")
        assert died.value.reason == "channel" and "channel" in str(died.value)
        assert pool.stats()["retries"] == 1 and pool.stats()["restarts_by_cause"] == {"channel": 2}
        assert await pool.call(owner, f"{JOBS}:echo", 5) == 5

    run(2, scenario)


def test_a_job_whose_worker_is_killed_from_outside_runs_again_on_another() -> None:
    """SIGKILL from outside (the OOM killer, an operator) is not the item's fault: the job runs once more."""

    async def scenario(pool: WorkerPool) -> None:
        owner = Owner("r")
        task = asyncio.ensure_future(pool.call(owner, f"{JOBS}:nap", 1.0, "done"))
        await until(lambda: pool.stats()["busy"] == 1, 10)
        first = busy_pid(pool)
        os.kill(first, 9)
        assert await task == "done"
        assert pool.stats()["retries"] == 1 and pool.stats()["restarts_by_cause"] == {"killed": 1}
        await until(lambda: pool.states() == {"idle": 2, "busy": 0, "starting": 0, "dying": 0}, 10)

    run(2, scenario)


def test_a_response_job_killed_before_its_answer_runs_again_on_its_output(tmp_path) -> None:
    """A response job gives up (retires) the output it encodes only once its answer is sent: killed after
    encoding but before answering, its next run still finds the output. Retiring it at once made that
    next run fail with FileNotFoundError, a 500 under workers killed from outside."""
    import torch

    from service import shm
    from service.engine.types import OutputRef

    names = shm.SegmentNames()
    rows = torch.randn(4, 8).to(torch.bfloat16)
    output, response = names.next("out"), names.next("resp")
    shm.write(output, rows.view(torch.uint8).numpy().tobytes())
    result = {"index": 0, "modality": "image", "id": None, "grid_thw": [1, 4, 4], "num_patches": 16,
              "num_tokens": 4, "meta": {}, "output": OutputRef(output, 4, 8, "bfloat16"), "release": True}

    async def scenario(pool: WorkerPool) -> None:
        length = await pool.call(Owner("r"), f"{JOBS}:encode_then_die_once", str(tmp_path / "died"), response,
                                 result, "base64", "bfloat16", False, 8, "qwen2_5_vl", 2, leaves=(response,))
        assert (tmp_path / "died").exists() and pool.stats()["restarts_by_cause"] == {"killed": 1}
        assert length > 0 and len(shm.open_segment(response)) >= length
        await until(lambda: not (SHM_DIR / output).exists(), 5)  # retired once the answer went

    try:
        run(2, scenario)
    finally:
        unlink(output)
        unlink(response)


@pytest.mark.parametrize("size", [1, 100 << 10, 300 << 10, 5 << 20])
def test_messages_of_any_size_cross_both_ways_whole(size: int) -> None:
    """Above the socket buffer (about 208 KiB) a message goes in parts: none may be cut or lost, and the
    event loop keeps serving meanwhile."""

    async def scenario(pool: WorkerPool) -> None:
        owner = Owner("r")
        payloads = [os.urandom(size) for _ in range(3)]
        async with asyncio.timeout(30):  # a message cut in two used to leave its job waiting for ever
            results = await asyncio.gather(*(pool.call(owner, f"{JOBS}:echo", p) for p in payloads))
            assert results == payloads
            asked = await pool.call(owner, f"{JOBS}:ask", payloads[0], on_ask=lambda q: q[::-1])
            assert asked == payloads[0][::-1]
        assert pool.stats()["restarts"] == 0

    run(2, scenario)


def test_a_job_past_the_job_timeout_loses_its_worker() -> None:
    async def scenario(pool: WorkerPool) -> None:
        owner = Owner("r")
        with pytest.raises(WorkerDied) as died:
            await pool.call(owner, f"{JOBS}:nap", 30, "late")
        assert died.value.reason == "deadline"
        assert pool.stats()["restarts_by_cause"] == {"deadline": 1}
        assert await pool.call(owner, f"{JOBS}:echo", 5) == 5

    run(1, scenario, job_timeout_s=0.5)


def test_an_idle_worker_that_stops_answering_is_replaced(monkeypatch) -> None:
    from service.workers import pool as pool_module

    monkeypatch.setattr(pool_module, "PING_INTERVAL_S", 0.2)
    monkeypatch.setattr(pool_module, "PING_TIMEOUT_S", 0.5)

    async def scenario(pool: WorkerPool) -> None:
        await until(lambda: pool.states()["idle"] == 1, 10)
        (worker,) = pool._workers
        os.kill(worker.process.pid, 19)  # SIGSTOP: alive, silent
        try:
            await until(lambda: pool.stats()["restarts_by_cause"].get("unresponsive") == 1, 10)
        finally:
            try:
                os.kill(worker.process.pid, 18)
            except ProcessLookupError:
                pass
        assert await pool.call(Owner("r"), f"{JOBS}:echo", 6) == 6

    run(1, scenario)
