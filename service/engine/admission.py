"""Admission and backpressure for the engine's queue: the `--max-concurrent-requests` slots, the
`--max-queued-tokens` bound on tokens admitted and not yet handed to an engine, and the early 429 for
work that could not be done by its request's deadline. It keeps the measures that last check rests on
(the usual item's tokens, a worker's time per item) and is driven from the event loop, like the engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

from service.engine.batcher import Batcher
from service.engine.types import Overloaded, RequestRejected
from service.metrics import Metrics
from service.settings import ServeSettings
from service.workers.pool import WorkerPool

# The share of a request's time left that the work ahead of it may take at the measured rate: the rest
# is for decoding it, encoding its response, and the rate's error (the batches ahead may run slower
# than the last ones did). A request admitted closer to its deadline ends, more often than not, in a 504
# after the whole wait, where a 429 at once would have told its client to come back.
DEADLINE_SHARE = 0.8
PREPARE_WARM_UP = 2  # items prepared before their time is trusted
PREPARE_DECAY = 0.8  # per item
ITEM_TOKENS_DECAY = 0.9  # per item


class Admission:
    def __init__(self, settings: ServeSettings, metrics: Metrics, batcher: Batcher, workers: WorkerPool) -> None:
        self.settings = settings
        self.metrics = metrics
        self.batcher = batcher
        self.workers = workers
        self.inflight = 0  # requests holding a slot
        self.reserved = 0  # tokens admitted and not yet handed to an engine
        self.unestimated = 0  # items on their way to a worker, their tokens not known yet
        self._prepared = 0  # items prepared by the workers
        self._item_tokens: float | None = None  # tokens of one item, decayed mean of the estimates
        self._prepare_s: float | None = None  # seconds a worker spends on one item, decayed mean

    @contextmanager
    def request_slot(self) -> Iterator[None]:
        """One of `--max-concurrent-requests` slots for the request's whole life, else 429."""
        if self.inflight >= self.settings.max_concurrent_requests:
            raise Overloaded(f"{self.inflight} requests in flight, the limit is "
                             f"{self.settings.max_concurrent_requests}")
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        try:
            yield
        finally:
            self.inflight -= 1
            self.metrics.inflight.set(self.inflight)

    def estimated(self, tokens: int) -> None:
        """An item's first estimate came: it counts as the usual item's size from now on."""
        self.unestimated -= 1
        self._item_tokens = tokens if self._item_tokens is None else \
            ITEM_TOKENS_DECAY * self._item_tokens + (1 - ITEM_TOKENS_DECAY) * tokens

    def prepared(self, seconds: float) -> None:
        """A worker prepared an item in `seconds`."""
        self._prepared += 1
        if self._prepared > PREPARE_WARM_UP:  # a worker's first items pay for its warm-up
            self._prepare_s = seconds if self._prepare_s is None else \
                PREPARE_DECAY * self._prepare_s + (1 - PREPARE_DECAY) * seconds

    def admit(self, tokens: int, request_tokens: int, deadline: float | None = None) -> None:
        """Count an item's estimated tokens against the queue bound (before any decoding), and refuse it
        if the work ahead of it cannot be done by its request's `deadline` (`time.monotonic()`)."""
        limit = self.settings.queue_tokens_limit
        if request_tokens > limit:
            raise RequestRejected(f"the request needs {request_tokens} tokens, above the queue limit of {limit} "
                                  "(--max-queued-tokens): send fewer or smaller items", "too_many_tokens")
        if self.reserved + tokens > limit:
            raise Overloaded(f"the queue holds {self.reserved} tokens; {tokens} more would pass the limit of "
                             f"{limit}")
        self.check_deadline(tokens, deadline)
        self.reserved += tokens
        self.metrics.queue_tokens.set(self.reserved)

    def check_deadline(self, tokens: int, deadline: float | None, before_workers: bool = False) -> None:
        """429 now for work that would end in a 504: what is ahead of it takes longer than the time left
        until `deadline` (`time.monotonic()`).

        Ahead of an item: the tokens decoded and queued before it and those on the engines (the queue is
        served in order of arrival), at the engines' measured rate. Items still being decoded are not
        counted: a slow one (a long video) does not hold up the small items decoded after it. Ahead of
        a request that has not reached a worker yet (`before_workers`), also the items waiting for a
        worker, at the usual item's tokens, and the media jobs queued or running, at the measured time
        of one over the workers. Decoding and encoding proceed side by side, so the longer of the two is
        the least the request must wait. Nothing is refused on a guess: a measure not taken yet counts
        for nothing (the token bound still holds). Retry-After is when a request with a fresh deadline
        would fit, were nothing added.
        """
        if deadline is None:
            return
        waits: list[tuple[float, str]] = []
        rate = self.batcher.rate()
        if rate:
            ahead = self.batcher.queued_tokens + self.batcher.outstanding_tokens
            if before_workers and self._item_tokens is not None:  # items ahead, not yet read: the usual size
                ahead += round(self.unestimated * self._item_tokens)
            waits.append(((ahead + tokens) / rate, f"{ahead + tokens} tokens to encode at the measured "
                                                   f"{rate:.0f} tokens/s"))
        if before_workers and self._prepare_s is not None:
            stats = self.workers.stats()
            jobs, workers = stats["busy"] + stats["queued"], max(1, stats["workers"])
            waits.append((jobs / workers * self._prepare_s, f"{jobs} media jobs ahead for {workers} workers at "
                                                             f"the measured {self._prepare_s * 1000:.0f} ms each"))
        if not waits:
            return
        needed, why = max(waits)
        left = deadline - time.monotonic()
        if needed <= left * DEADLINE_SHARE:
            return
        wait = max(1, math.ceil(needed - self.settings.request_timeout_s * DEADLINE_SHARE))
        raise Overloaded(f"the server is behind: {why} take about {needed:.1f}s, and the request has "
                         f"{max(left, 0):.1f}s left (--request-timeout-s); retry later", wait, "deadline_unreachable")

    def release(self, tokens: int) -> None:
        self.reserved -= tokens
        self.metrics.queue_tokens.set(self.reserved)
