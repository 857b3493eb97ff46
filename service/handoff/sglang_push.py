"""Delivering encoder outputs to SGLang's language-only server: who registered for each part, and the ZMQ
PUSH sockets to them. Follows SGLang 0.5.23's own encoder (`MMEncoder` in
sglang/srt/disaggregation/encoder/server.py); the message itself is `sglang_wire`'s.

- `zmq_to_scheduler` (SGLang's default): each scheduler rank binds one PULL socket for all its requests and
  posts `/scheduler_receive_url {req_id, receive_count, receive_url}` for every part, before or after that
  part's `/encode`. A registration is held until the part's `/encode` has begun (`Parts.register`; 504
  after `timeout_s`, SGLang's SGLANG_ENCODER_REQ_TIMEOUT). The part goes to every rank that registers, and
  its `/encode` is answered once it reached `receive_count` of them (`Parts.deliver`); ranks still missing
  after `timeout_s` (SGLang's SGLANG_ENCODER_SEND_TIMEOUT) are dropped and logged, and `/encode` answers 504.
- `zmq_to_tokenizer`: `/encode` names `prefill_host:embedding_port`, a socket of that one request.

Pushes (`Pushes.push`): one PUSH socket per receiver, reused by every part sent there (a one-request
receiver's is closed after its push); at most `HWM` messages queued on it, and `LINGER_MS` for them when
it closes; a push is done when ZMQ has written the message out, within `timeout_s`. A push that fails
closes its socket (the next part connects afresh) and fails that part alone: its `/encode` answers an
error, which SGLang turns into the abort of that request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger("vitserve.sglang")
HWM = 16  # messages queued per receiver socket before a push waits
LINGER_MS = 1000  # how long a closing socket may still send what it holds
IDLE_S = 60.0  # a receiver socket unused this long is closed
RESULTS = ("ok", "failed", "dropped")


class DeliveryFailed(Exception):
    """A part cannot be delivered, or a registration taken: `status` is the HTTP answer SGLang gets."""

    def __init__(self, message: str, status: int, code: str) -> None:
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


@dataclass(eq=False)
class Part:
    """One part (`<rid>_local_part_<k>`) from its `/encode` or its first registration to its release."""

    req_id: str
    started: asyncio.Event = field(default_factory=asyncio.Event)  # its /encode has begun
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # a receiver registered, or it was refused
    count: int | None = None  # receive_count: the ranks that will register
    endpoints: list[str] = field(default_factory=list)
    released: bool = False
    refused: str | None = None  # why it cannot be delivered (a rank asked for mooncake)
    waiting: int = 0  # registrations waiting for its /encode


class Parts:
    """The parts in flight, by req_id (event-loop only)."""

    def __init__(self, pushes: Pushes, timeout_s: float) -> None:
        self.pushes = pushes
        self.timeout_s = timeout_s
        self._parts: dict[str, Part] = {}

    def __len__(self) -> int:
        return len(self._parts)

    def begin(self, req_id: str) -> Part:
        """The part's /encode begins: registrations waiting for it go on."""
        part = self._parts.get(req_id)
        if part is not None and part.started.is_set():
            raise DeliveryFailed(f"req_id {req_id} is already being encoded", 409, "duplicate_req_id")
        if part is None:
            part = self._parts[req_id] = Part(req_id)
        part.started.set()
        return part

    def release(self, part: Part) -> None:
        part.released = True
        part.changed.set()
        if self._parts.get(part.req_id) is part:
            del self._parts[part.req_id]

    async def register(self, req_id: str, count: int, endpoint: str) -> None:
        part = self._parts.setdefault(req_id, Part(req_id))
        if not part.started.is_set():
            part.waiting += 1
            try:
                await asyncio.wait_for(part.started.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                raise DeliveryFailed(f"Timed out waiting for encoder request to start: {req_id}", 504,
                                     "not_started") from None
            finally:
                part.waiting -= 1
                if not part.started.is_set() and not part.waiting and part.refused is None:
                    self._forget(part)
        if part.released or part.refused is not None:
            raise DeliveryFailed(f"Encoder request is not active: {req_id}", 400, "not_active")
        if part.count is None:
            part.count = count
        elif part.count != count:
            raise DeliveryFailed(f"Inconsistent receive_count for req_id={req_id}: registered {part.count}, got "
                                 f"{count}", 400, "inconsistent_receive_count")
        if endpoint not in part.endpoints:
            part.endpoints.append(endpoint)
        part.changed.set()

    def refuse(self, req_id: str, message: str) -> None:
        """No delivery can be made for this part: its /encode fails with `message` (at once, or when it
        begins within the timeout)."""
        part = self._parts.setdefault(req_id, Part(req_id))
        part.refused = message
        part.changed.set()
        if not part.started.is_set():
            asyncio.get_running_loop().call_later(self.timeout_s, self._forget, part)

    def _forget(self, part: Part) -> None:
        if not part.started.is_set() and self._parts.get(part.req_id) is part:
            del self._parts[part.req_id]

    async def deliver(self, part: Part, frames: Sequence[bytes], warn: bool = True) -> None:
        """Push `frames` to every rank that registers for `part`, until `receive_count` of them have it;
        `warn`: a drop is logged as a warning (a part's rows; its error is the caller's to log)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        pushes: dict[str, asyncio.Future[None]] = {}
        failure: DeliveryFailed | None = None
        try:
            while True:
                part.changed.clear()
                if part.refused is not None:
                    failure = DeliveryFailed(part.refused, 501, "unsupported_backend")
                    break
                for endpoint in part.endpoints:
                    if endpoint not in pushes:
                        pushes[endpoint] = asyncio.ensure_future(self.pushes.push(endpoint, frames, self.timeout_s))
                if part.count is not None and len(pushes) >= part.count:
                    break
                remaining = deadline - loop.time()
                if remaining <= 0:
                    missing = (part.count or 1) - len(pushes)
                    self.pushes.counts["dropped"] += missing
                    failure = DeliveryFailed(
                        f"[{part.req_id}] embedding delivery failed: timed out after {self.timeout_s:g}s with "
                        f"{len(pushes)}/{part.count or '?'} destination(s) initiated", 504, "receivers_missing")
                    log.log(logging.WARNING if warn else logging.INFO,
                            "part %s dropped for %d receiver(s) that did not register within %gs "
                            "(--sglang-timeout-s); %d registered", part.req_id, missing, self.timeout_s, len(pushes))
                    break
                try:
                    await asyncio.wait_for(part.changed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
            results = await asyncio.gather(*pushes.values(), return_exceptions=True)
        except BaseException:
            for push in pushes.values():
                push.cancel()
            raise
        failed = [f"{endpoint} ({r})" for endpoint, r in zip(pushes, results) if isinstance(r, BaseException)]
        if failure is None and failed:
            failure = DeliveryFailed(f"[{part.req_id}] embedding delivery failed for {', '.join(failed)}", 502,
                                     "push_failed")
        if failure is not None:
            raise failure


class _Socket:
    def __init__(self, sock: object) -> None:
        self.sock = sock
        self.lock = asyncio.Lock()  # sends on one socket go out in order
        self.busy = 0
        self.used = time.monotonic()


class Pushes:
    """PUSH sockets to the receivers, one per endpoint (`tcp://host:port`); event-loop only."""

    def __init__(self) -> None:
        self._context: object | None = None
        self._sockets: dict[str, _Socket] = {}
        self.counts: Counter[str] = Counter(dict.fromkeys(RESULTS, 0))

    @property
    def open_sockets(self) -> int:
        return len(self._sockets)

    def _socket(self, endpoint: str) -> _Socket:
        entry = self._sockets.get(endpoint)
        if entry is None:
            import zmq
            import zmq.asyncio

            if self._context is None:
                self._context = zmq.asyncio.Context(io_threads=1)
            sock = self._context.socket(zmq.PUSH)  # type: ignore[attr-defined]
            sock.setsockopt(zmq.SNDHWM, HWM)
            sock.setsockopt(zmq.LINGER, LINGER_MS)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a connected receiver: a dead one fails the push
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
            entry = self._sockets[endpoint] = _Socket(sock)
        return entry

    async def push(self, endpoint: str, frames: Sequence[bytes], timeout_s: float, keep: bool = True) -> None:
        """`frames` as one message to `endpoint`, written out within `timeout_s`; `keep`: the socket stays
        for later parts (a scheduler rank's), else it closes once idle (one request's receiver)."""
        import zmq

        entry = self._socket(endpoint)
        entry.busy += 1
        ok = False
        try:
            async with asyncio.timeout(timeout_s):
                async with entry.lock:
                    tracker = await entry.sock.send_multipart(frames, copy=False, track=True)  # type: ignore
                delay = 0.0005
                while not tracker.done:  # ZMQ still holds the message: the receiver has not taken it yet
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 0.01)
            ok = True
        except (TimeoutError, asyncio.TimeoutError):
            raise DeliveryFailed(f"no receiver took the message at {endpoint} within {timeout_s:g}s", 504,
                                 "push_timeout") from None
        except zmq.ZMQError as exc:
            raise DeliveryFailed(f"pushing to {endpoint} failed: {exc}", 502, "push_failed") from None
        finally:
            entry.busy -= 1
            entry.used = time.monotonic()
            self.counts["ok" if ok else "failed"] += 1
            if not ok:
                self._close(endpoint, entry, linger=0)  # whatever it holds may never leave
            elif not keep and not entry.busy:
                self._close(endpoint, entry, linger=LINGER_MS)
            self._close_idle()

    def _close(self, endpoint: str, entry: _Socket, linger: int) -> None:
        if self._sockets.get(endpoint) is entry:
            del self._sockets[endpoint]
        entry.sock.close(linger=linger)  # type: ignore[attr-defined]

    def _close_idle(self) -> None:
        now = time.monotonic()
        for endpoint, entry in list(self._sockets.items()):
            if not entry.busy and now - entry.used > IDLE_S:
                self._close(endpoint, entry, linger=LINGER_MS)

    def close(self) -> None:
        """Every socket closed, what they hold given LINGER_MS, and the context ended."""
        for endpoint, entry in list(self._sockets.items()):
            self._close(endpoint, entry, linger=LINGER_MS)
        if self._context is not None:
            self._context.term()  # type: ignore[attr-defined]
            self._context = None
