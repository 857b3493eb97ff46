"""Worker processes for the host work of requests (decoding and preprocessing media, encoding responses),
driven from the event loop.

Why processes: media work runs on untrusted bytes. A runaway decode can be stopped at once and its
memory returned by killing its process, and a crash in a decoder takes down one worker, not the server.
Processes also spread the work over the host's cores, which threads under one GIL cannot.

- Order: jobs queue per owner (one request). A free worker takes the next job of the waiting owner
  whose next job has the highest priority (a response to encode before media to prepare: finishing a
  request frees its memory and its slot, starting one adds to both), then with the fewest jobs running,
  then the one served least recently, so one request's many items cannot hold every worker while
  another request waits. How long each job waited for a worker goes to `on_wait`.
- Cancellation: cancelling an owner (its deadline passed, its client left) drops its queued jobs and
  kills the workers running its jobs; a caller whose `call` is cancelled abandons that job the same way.
  A killed worker is replaced at once (forked from a preloaded server process: milliseconds).
- Memory: a worker whose resident memory passes `memory_limit` while it runs a job is killed, and the
  job fails with `WorkerDied("memory")`.
- Capacity heals itself: every worker is starting (a replacement warming up, or waiting to be forked
  again after failed starts: `START_RETRY_FIRST_S`), idle, busy or dying (killed, not yet reaped), and
  each one lost is replaced at once. A worker is killed and replaced when
  its channel fails, when it does not answer (a start past `START_TIMEOUT_S`, an idle one silent to a
  ping past `PING_TIMEOUT_S`), or when its job outlives `job_timeout_s` (its request's deadline has
  passed: cancelling it should have stopped it already). A job whose worker died of anything but its own
  job's cost runs again on another worker: after a crash of its own (a signal such as SIGSEGV, an exit)
  once, so that a decoder that dies twice on the same item fails it (`WorkerDied("crash")`); after a
  death that is not the decoder's doing: SIGKILL from outside (the OOM killer, an operator) up to
  `MAX_TRIES` runs in all, a channel error or no answer once; then it fails with that cause.
- Channel: the front's end of each worker's pipe is a `service.channel.Channel` (why: see there).
- A job may ask its caller a question mid-way (`JobContext.ask`): media jobs report their estimated
  cost before decoding and wait for admission.
- Warm-up: each new worker first runs `warm_up` (a "module:function" of no arguments), so the first
  request it serves does not pay for first-use initialisation.

What runs inside a worker process is `service.workers.child`; the fork server it is forked from is
`service.workers.processes`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.channel import Channel, ChannelClosed
from service.shm import unlink
from service.workers.child import worker_main
from service.workers.processes import fork_context, resident_bytes, start_fork_server, wait_for_fork_server

log = logging.getLogger("vitserve.workers")

WATCH_INTERVAL_S = 0.1
START_TIMEOUT_S = 60.0  # from spawn to "ready" (warm-up included; a loaded 2-core box took about 2 s)
PING_INTERVAL_S = 5.0  # an idle worker silent this long is pinged
PING_TIMEOUT_S = 20.0  # and killed if it stays silent this long after the ping
CHANNEL_GRACE_S = 1.0  # a worker whose channel closed has this long to be seen exiting before it is killed
# A worker that fails before it is ready (a broken install, a start that cannot succeed) is replaced after a
# delay that doubles with each such failure in a row, from START_RETRY_FIRST_S up to START_RETRY_MAX_S, and
# resets once one starts: a pool that cannot start spins no core, and one that can comes back within a delay.
START_RETRY_FIRST_S = 0.25
START_RETRY_MAX_S = 30.0
# Why a worker was replaced, as `restarts_by_cause` counts it: "crash" (it exited, or died of a signal of
# its own), "killed" (SIGKILL from outside), "memory", "cancelled" (its job's request went away),
# "deadline", "channel", "unresponsive".
RETRIED_CAUSES = ("crash", "killed", "channel", "unresponsive")
MAX_TRIES = 4

class JobFailed(Exception):
    """A job raised something other than an input problem: a bug; the traceback is logged."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


class WorkerDied(Exception):
    """The worker running the job exited: `reason` is "memory" (over its limit), "crash" (twice: the item's
    own fault, most likely), "killed", "channel" or "unresponsive" (the server's fault: killed from outside
    every time it ran, or its channel failed or it stopped answering twice), "deadline" (it ran past the
    job timeout) or "stopped"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(eq=False)
class Owner:
    """The request jobs run for: the unit of fairness and of cancellation."""

    name: str = ""
    running: int = 0
    cancelled: bool = False
    last_turn: int = -1  # when a worker last took one of its jobs (the pool's dispatch count)


@dataclass(eq=False)
class _Job:
    id: int
    owner: Owner
    fn: str
    args: tuple
    future: asyncio.Future
    on_ask: Callable[[Any], Any] | None
    leaves: tuple[str, ...] = ()  # shared-memory segments the job creates: unlinked if nobody takes them
    priority: int = 1  # lower first
    queued: float = 0.0  # time.monotonic() when called
    worker: _Worker | None = None
    started: float = 0.0  # time.monotonic() when its current worker took it
    tries: int = 0  # workers it was sent to
    crashes: int = 0  # of those, how many died of a crash of their own


@dataclass(eq=False)
class _Worker:
    index: int
    process: Any  # a multiprocessing process
    channel: Channel
    job: _Job | None = None
    kill_reason: str | None = None
    ready: bool = False  # it said so after its warm-up
    spawned: float = 0.0
    heard: float = 0.0  # time.monotonic() of its last message
    pinged: float = 0.0  # of the last ping not yet answered (0: none)
    channel_lost: float = 0.0  # when its channel failed (0: it has not)

    @property
    def state(self) -> str:
        if self.kill_reason is not None:
            return "dying"
        if not self.ready:
            return "starting"
        return "busy" if self.job is not None else "idle"


class WorkerPool:
    def __init__(self, size: int, *, memory_limit: int | None = None, name: str = "vitserve-worker",
                 on_wait: Callable[[str, float], None] | None = None, warm_up: str | None = None,
                 job_timeout_s: float | None = None) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {size}")
        self.size = size
        self.memory_limit = memory_limit
        self.name = name
        self.on_wait = on_wait  # (function name, seconds the job waited for a worker)
        self.warm_up = warm_up
        self.job_timeout_s = job_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ctx = fork_context()
        self._workers: list[_Worker] = []
        self._idle: deque[_Worker] = deque()
        self._waiting: dict[Owner, deque[_Job]] = {}
        self._ids = itertools.count()
        self._indexes = itertools.count()
        self._turns = itertools.count()
        self._stopping = False
        self._watch_handle: asyncio.TimerHandle | None = None
        self.counters = {"jobs": 0, "killed_cancelled": 0, "killed_memory": 0, "crashed": 0, "restarts": 0,
                         "retries": 0, "failed_starts": 0}
        self._failed_starts = 0  # in a row, since a worker last became ready
        self._respawns: list[asyncio.TimerHandle] = []  # replacements waiting out their delay
        self._unforked = 0  # workers waiting for the fork server's first fork
        self.forked = threading.Event()  # set once they are forked, failed to (`start_error`) or were stopped
        self.start_error: str | None = None
        self.restarts_by_cause: dict[str, int] = {}

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the workers; call from the event loop that will drive them. Returns at once: the first fork
        waits for the fork server to import the media modules (2.3 s on 2 cores), which a thread waits out
        so that the loop serves meanwhile (health checks, the model's load); until then the workers count
        as starting."""
        self.loop = asyncio.get_running_loop()
        start_fork_server()
        self._unforked = self.size
        self.loop.run_in_executor(None, wait_for_fork_server, self._ctx).add_done_callback(self._fork_first)
        self._watch_handle = self.loop.call_later(WATCH_INTERVAL_S, self._watch)

    def _fork_first(self, waited: asyncio.Future) -> None:
        self._unforked = 0
        try:
            if self._stopping or waited.cancelled():
                return
            waited.result()  # raises what the wait raised
            for _ in range(self.size):
                self._spawn()
        except Exception as exc:  # fatal to the server's start, as it was when the forks ran in `start`
            self.start_error = f"the worker processes failed to start: {type(exc).__name__}: {exc}"
        finally:
            self.forked.set()

    def _spawn(self) -> None:
        assert self.loop is not None
        parent_end, child_end = self._ctx.Pipe(duplex=True)
        index = next(self._indexes)
        process = self._ctx.Process(target=worker_main, args=(child_end, os.getpid(), self.warm_up), daemon=True,
                                    name=f"{self.name}-{index}")
        process.start()
        child_end.close()
        now = time.monotonic()
        worker = _Worker(index, process, None, spawned=now, heard=now)  # type: ignore[arg-type]
        worker.channel = Channel(parent_end, self.loop, lambda m: self._received(worker, m),
                                 lambda reason: self._channel_failed(worker, reason))
        self._workers.append(worker)
        self.loop.add_reader(process.sentinel, self._exited, worker)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every worker (jobs still running fail with WorkerDied("stopped"))."""
        self._stopping = True
        self.forked.set()  # nothing waits for forks that will not come
        if self._watch_handle is not None:
            self._watch_handle.cancel()
        for handle in self._respawns:
            handle.cancel()
        self._respawns.clear()
        for owner in list(self._waiting):
            self.cancel(owner)
        for worker in list(self._workers):
            self._forget(worker)
            if worker.job is not None:
                self._fail(worker.job, WorkerDied("stopped", "the server stopped"))
            try:
                worker.channel.send(("stop",))
                worker.channel.flush_blocking(0.5)  # the loop may not run again to write it
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for worker in list(self._workers):
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(1)
            worker.channel.close()
            if worker.job is not None:  # failed above; what its worker wrote before exiting has no taker
                _unlink_all(worker.job.leaves)
        self._workers.clear()
        self._idle.clear()

    # ---- the caller's side --------------------------------------------------------------------
    async def call(self, owner: Owner, fn: str, *args: Any, on_ask: Callable[[Any], Any] | None = None,
                   leaves: tuple[str, ...] = (), priority: int = 1) -> Any:
        """Run `fn` ("module:function", called as fn(ctx, *args)) in a worker for `owner`; its return value.
        Raises what the job raised if that pickles (input errors), JobFailed for other exceptions, and
        WorkerDied if its worker died and it was not run again (see the module's docstring). A job may run
        twice: it must write nothing but its `leaves`, change its inputs only in `ctx.once_answered`, and
        expect `on_ask` to be asked again.
        Cancelling the awaiting task abandons the job (its worker is killed).
        `leaves`: the segments the job writes; an abandoned job's are unlinked once its worker has answered
        or exited (a worker killed a moment late may still create them). `priority`: lower goes first."""
        if owner.cancelled:
            raise asyncio.CancelledError()
        if self._stopping or self.loop is None:
            raise WorkerDied("stopped", "the server is stopping")
        job = _Job(next(self._ids), owner, fn, args, self.loop.create_future(), on_ask, leaves, priority,
                   time.monotonic())
        self._waiting.setdefault(owner, deque()).append(job)
        self.counters["jobs"] += 1
        self._dispatch()
        try:
            return await job.future
        except asyncio.CancelledError:
            self._abandon(job, "cancelled")
            raise

    def cancel(self, owner: Owner) -> None:
        """Drop the owner's queued jobs and kill the workers running its jobs."""
        owner.cancelled = True
        for job in self._waiting.pop(owner, deque()):
            if not job.future.done():
                job.future.cancel()
        for worker in self._workers:
            if worker.job is not None and worker.job.owner is owner:
                self._abandon(worker.job, "cancelled")

    def _abandon(self, job: _Job, reason: str) -> None:
        queue = self._waiting.get(job.owner)
        if queue is not None and job in queue:
            queue.remove(job)
            if not queue:
                del self._waiting[job.owner]
        worker = job.worker
        if worker is not None and worker.job is job and worker.kill_reason is None:
            self._kill(worker, reason)
        if not job.future.done():
            job.future.cancel()

    # ---- scheduling ---------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while self._idle and self._waiting:
            # The most urgent next job; then fewest jobs running; then the one served least recently.
            owner = min(self._waiting, key=lambda o: (self._waiting[o][0].priority, o.running, o.last_turn))
            queue = self._waiting[owner]
            job = queue.popleft()
            if not queue:
                del self._waiting[owner]
            if job.future.done():  # cancelled while queued
                continue
            # The worker that finished last: its caches and freed memory are still warm, and a lone
            # request keeps meeting the same one instead of a cold one in turn.
            worker = self._idle.pop()
            worker.job, job.worker = job, worker
            job.started, job.tries = time.monotonic(), job.tries + 1
            try:
                worker.channel.send(("run", job.id, job.fn, job.args))
            except (ChannelClosed, OSError, ValueError):  # it just failed: its job runs again once it is gone
                worker.channel_lost = worker.channel_lost or time.monotonic()
            owner.running += 1
            owner.last_turn = next(self._turns)
            if self.on_wait is not None:
                self.on_wait(job.fn.rpartition(":")[2], time.monotonic() - job.queued)

    def _finish(self, worker: _Worker) -> _Job | None:
        job = worker.job
        worker.job = None
        if job is not None:
            job.worker = None
            job.owner.running -= 1
        return job

    # ---- messages from workers ----------------------------------------------------------------
    def _channel_failed(self, worker: _Worker, reason: str) -> None:
        # Most often the worker exited and its exit handler follows at once; one still alive a moment
        # later has a broken channel and is killed (`_watch`).
        worker.channel_lost = time.monotonic()

    def _received(self, worker: _Worker, message: tuple) -> None:
        worker.heard, worker.pinged = time.monotonic(), 0.0
        kind = message[0]
        if kind == "ready":
            if not worker.ready and worker.kill_reason is None:
                worker.ready = True
                self._failed_starts = 0
                self._idle.append(worker)
                self._dispatch()
            return
        if kind == "pong":
            return
        job = worker.job
        if job is None or message[1] != job.id:
            return  # a reply for a job already abandoned
        if kind == "ask":
            self._answer(worker, job, message[2])
            return
        self._finish(worker)
        if job.future.done():  # abandoned: what it wrote has no taker
            _unlink_all(job.leaves)
        elif kind == "done":
            job.future.set_result(message[2])
        elif kind == "raised":
            self._fail(job, message[2])
        else:  # "failed": message, traceback
            log.error("worker job %s failed: %s\n%s", job.fn, message[2], message[3])
            self._fail(job, JobFailed(message[2], message[3]))
        if worker.kill_reason is None:
            self._idle.append(worker)
        self._dispatch()

    def _answer(self, worker: _Worker, job: _Job, question: Any) -> None:
        try:
            reply: Any = ("reply", job.on_ask(question) if job.on_ask else None)
        except BaseException as exc:  # the caller refused (e.g. admission): the job stops there
            reply = ("abort",)
            self._fail(job, exc)
        try:
            worker.channel.send(reply)
        except (OSError, ValueError):
            pass  # its channel failed: the worker is being killed, and its job runs again

    def _fail(self, job: _Job, exc: BaseException) -> None:
        if not job.future.done():
            job.future.set_exception(exc)

    # ---- deaths and kills ---------------------------------------------------------------------
    def _kill(self, worker: _Worker, reason: str, why: str = "") -> None:
        worker.kill_reason = reason
        self.counters[f"killed_{reason}"] = self.counters.get(f"killed_{reason}", 0) + 1
        if worker in self._idle:
            self._idle.remove(worker)
        if why:
            log.warning("worker %s (pid %s) killed and replaced: %s%s", worker.index, worker.process.pid, why,
                        f" while running {worker.job.fn}" if worker.job else "")
        try:
            worker.process.kill()
        except (OSError, ValueError):
            pass

    def _forget(self, worker: _Worker) -> None:
        if self.loop is not None:
            try:
                self.loop.remove_reader(worker.process.sentinel)
            except (OSError, ValueError):
                pass
        if worker in self._idle:
            self._idle.remove(worker)

    def _exited(self, worker: _Worker) -> None:
        self._forget(worker)
        if worker.kill_reason is None:  # it takes no job from now on
            worker.process.join(1)
            killed = worker.process.exitcode == -signal.SIGKILL  # no decoder sends itself that
            worker.kill_reason = "killed" if killed else "crash"
        reason = worker.kill_reason
        if not worker.channel.closed:
            worker.channel.read_now()  # a reply sent just before the exit still counts
        worker.process.join(1)
        if worker in self._workers:
            self._workers.remove(worker)
        worker.channel.close()
        job = self._finish(worker)
        if job is not None:
            _unlink_all(job.leaves)  # whatever it got to write, no result points at it
        if reason in ("crash", "killed"):
            self.counters["crashed"] += 1
            log.warning("worker %s (pid %s) exited with code %s%s", worker.index, worker.process.pid,
                        worker.process.exitcode, f" while running {job.fn}" if job else "")
        if job is not None and reason == "crash":
            job.crashes += 1
        if job is not None and not job.future.done():
            # A crash of its own: once more. SIGKILL from outside: up to MAX_TRIES runs in all. A channel that
            # failed, a worker that stopped answering: once more.
            allowed = {"crash": job.crashes < 2, "killed": job.tries < MAX_TRIES}.get(reason, job.tries < 2)
            if reason in RETRIED_CAUSES and allowed and not job.owner.cancelled and not self._stopping:
                # Not its own fault as far as we know (killed from outside, a channel, a hang): once more,
                # first in its owner's line. Its segments were unlinked above, so it writes them afresh.
                self.counters["retries"] += 1
                log.warning("running %s again on another worker (the first one's cause: %s)", job.fn, reason)
                self._waiting.setdefault(job.owner, deque()).appendleft(job)
            else:
                if job.crashes >= 2:
                    reason = "crash"
                message = {"memory": f"the item needed more than {self._limit_text()} of memory to process",
                           "crash": "the worker processing the item crashed twice",
                           "killed": f"the workers processing the item were killed {job.tries} times",
                           "channel": "the channel to the worker processing the item failed twice",
                           "unresponsive": "the worker processing the item stopped answering twice",
                           "deadline": "the item took longer than the job timeout",
                           "cancelled": "cancelled"}.get(reason, reason)
                self._fail(job, WorkerDied(reason, message))
        if not self._stopping:
            self.counters["restarts"] += 1
            self.restarts_by_cause[reason] = self.restarts_by_cause.get(reason, 0) + 1
            if worker.ready or reason == "killed":  # killed from outside: no sign that a start would fail
                self._spawn()
                self._dispatch()
            else:
                self._respawn_later(worker)

    def _respawn_later(self, worker: _Worker) -> None:
        """Replace a worker that died before it was ready once the current start delay has passed."""
        assert self.loop is not None
        self.counters["failed_starts"] += 1
        delay = min(START_RETRY_MAX_S, START_RETRY_FIRST_S * 2 ** self._failed_starts)
        self._failed_starts += 1
        log.warning("worker %s (pid %s) died before it was ready (exit code %s), %d time(s) in a row: the next "
                    "start in %.2gs", worker.index, worker.process.pid, worker.process.exitcode, self._failed_starts,
                    delay)

        def respawn() -> None:
            self._respawns.remove(handle)
            if not self._stopping:
                self._spawn()
                self._dispatch()

        handle = self.loop.call_later(delay, respawn)
        self._respawns.append(handle)

    def _limit_text(self) -> str:
        return f"{self.memory_limit / 2**20:.0f} MiB" if self.memory_limit else "the limit"

    def _watch(self) -> None:
        """Kill a worker whose job passed the memory limit or the job timeout, or that does not answer."""
        if self._stopping or self.loop is None:
            return
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.kill_reason is not None:
                continue
            job = worker.job
            if worker.channel_lost and now - worker.channel_lost > CHANNEL_GRACE_S:
                self._kill(worker, "channel", f"its channel failed ({worker.channel.reason})")
            elif not worker.ready:
                if now - worker.spawned > START_TIMEOUT_S:
                    self._kill(worker, "unresponsive", f"not ready {START_TIMEOUT_S:g}s after it started")
            elif job is None:
                if worker.pinged and now - worker.pinged > PING_TIMEOUT_S:
                    self._kill(worker, "unresponsive", f"no answer to a ping in {PING_TIMEOUT_S:g}s")
                elif not worker.pinged and now - worker.heard > PING_INTERVAL_S:
                    worker.pinged = now
                    try:
                        worker.channel.send(("ping",))
                    except (OSError, ValueError):
                        pass  # its channel failed: being killed
            elif self.job_timeout_s is not None and now - job.started > self.job_timeout_s:
                self._kill(worker, "deadline", f"{job.fn} ran past the job timeout of {self.job_timeout_s:g}s")
            elif self.memory_limit:
                rss = resident_bytes(worker.process.pid)
                if rss is not None and rss > self.memory_limit:
                    log.warning("worker %s uses %.0f MiB running %s: killed", worker.index, rss / 2**20, job.fn)
                    self._kill(worker, "memory")
        self._watch_handle = self.loop.call_later(WATCH_INTERVAL_S, self._watch)

    # ---- reporting ----------------------------------------------------------------------------
    def states(self) -> dict[str, int]:
        """Workers by state: idle and busy ones serve; starting and dying ones are being replaced."""
        out = dict.fromkeys(("idle", "busy", "starting", "dying"), 0)
        for w in self._workers:
            out[w.state] += 1
        out["starting"] += len(self._respawns) + self._unforked
        return out

    @property
    def live(self) -> int:
        """Workers able to take a job now or once their job ends."""
        return sum(w.ready and w.kill_reason is None for w in self._workers)

    def stats(self) -> dict[str, Any]:
        states = self.states()
        return {"workers": len(self._workers), "busy": states["busy"], "states": states,
                "pids": [w.process.pid for w in self._workers if w.kill_reason is None],
                "queued": sum(len(q) for q in self._waiting.values()), **self.counters,
                "restarts_by_cause": dict(self.restarts_by_cause)}


def _unlink_all(names: tuple[str, ...]) -> None:
    for name in names:
        unlink(name)
