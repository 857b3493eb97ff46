"""The front's end of a pipe to one of its child processes (a media worker, an engine process), driven by
the event loop.

Why this transport: the child's end stays an ordinary blocking `multiprocessing.Connection` (it has
nothing else to do while it waits), but the front's end is watched by the event loop, and uvloop's
`add_reader` leaves that descriptor non-blocking. `Connection.send` on it raised EAGAIN part-way through
any message larger than the free room of the socket buffer (about 208 KiB), leaving the peer holding
half a message for ever; `Connection.recv` raised it part-way through a message that had not arrived
whole, losing the part already read. Blocking on the loop instead would stall every request behind one
slow child. So here the loop does both halves itself, in `Connection`'s own framing:
- `send` pickles the message and queues it whole; what the socket does not take at once is written by
  the loop as room appears (`add_writer`). A send never fails half-way: the message is either queued
  whole, or the channel is closed and the owner told once (`on_closed`), and the peer is then stopped.
- reading collects bytes until a message is whole, then hands it to `on_message`.
How much a channel may hold unsent is bounded by its protocol, not here: a worker has one job at a time,
an engine `batcher.MAX_INFLIGHT` batches.
"""

from __future__ import annotations

import asyncio
import errno
import os
import select
import struct
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

READ_CHUNK = 1 << 20


class ChannelClosed(ConnectionError):
    """The channel is closed: nothing more can be sent on it."""


def _header(n: int) -> bytes:
    # `Connection._send_bytes`: a 4-byte big-endian length, or -1 and an 8-byte one above 2 GiB.
    return struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)


class Channel:
    """Messages to and from the peer of `conn` (the front's end of a `multiprocessing.Pipe`), on `loop`.
    `on_message(obj)` gets each message in order; `on_closed(reason)` is called once, on the loop, when
    the peer closed its end ("closed") or the socket failed (the error's text)."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop, on_message: Callable[[Any], None],
                 on_closed: Callable[[str], None]) -> None:
        self.conn, self.loop = conn, loop
        self.on_message, self.on_closed = on_message, on_closed
        self.fd = conn.fileno()
        self.closed = False
        self.reason: str | None = None
        self._in = bytearray()
        self._out: deque[memoryview] = deque()
        self._writing = False
        os.set_blocking(self.fd, False)
        loop.add_reader(self.fd, self._readable)

    # ---- sending ------------------------------------------------------------------------------
    @property
    def unsent(self) -> int:
        return sum(len(v) for v in self._out)

    def send(self, obj: Any) -> None:
        """Queue `obj` whole and write what the socket takes now; raises ChannelClosed if closed."""
        if self.closed:
            raise ChannelClosed(f"the channel is closed ({self.reason})")
        data = ForkingPickler.dumps(obj)
        self._out.append(memoryview(_header(len(data))))
        self._out.append(memoryview(data).cast("B"))
        if not self._writing:
            self._flush()

    def _flush(self) -> None:
        while self._out and not self.closed:
            view = self._out[0]
            try:
                sent = os.write(self.fd, view)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._fail(f"write failed: {exc}")
                return
            if sent < len(view):
                self._out[0] = view[sent:]
            else:
                self._out.popleft()
        want = bool(self._out) and not self.closed
        if want != self._writing:
            self._writing = want
            if want:
                self.loop.add_writer(self.fd, self._flush)
            else:
                self.loop.remove_writer(self.fd)

    def flush_blocking(self, timeout: float) -> bool:
        """Write what is queued, waiting up to `timeout` (for a stop, when the loop may not run again);
        whether it all went."""
        deadline = time.monotonic() + timeout
        while self._out and not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                select.select([], [self.fd], [], left)
            except (OSError, ValueError):
                return False
            self._flush()
        return not self._out

    # ---- receiving ----------------------------------------------------------------------------
    def _readable(self) -> None:
        self.read_now()

    def read_now(self) -> None:
        """Read what has arrived and deliver every whole message (also after the peer exited: its last
        replies still count)."""
        eof: str | None = None
        while not self.closed:
            try:
                chunk = os.read(self.fd, READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                eof = "closed" if exc.errno in (errno.ECONNRESET, errno.EPIPE) else f"read failed: {exc}"
                break
            if not chunk:
                eof = "closed"
                break
            self._in += chunk
            if len(chunk) < READ_CHUNK:
                break
        self._deliver()
        if eof is not None:
            self._fail(eof)

    def _deliver(self) -> None:
        while not self.closed and len(self._in) >= 4:
            size, = struct.unpack_from("!i", self._in)
            start = 4
            if size == -1:
                if len(self._in) < 12:
                    return
                size, = struct.unpack_from("!Q", self._in, 4)
                start = 12
            end = start + size
            if len(self._in) < end:
                return
            message = ForkingPickler.loads(self._in[start:end])
            del self._in[:end]
            self.on_message(message)

    # ---- closing ------------------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        if self.closed:
            return
        self.close(reason)
        self.loop.call_soon(self.on_closed, reason)

    def close(self, reason: str = "closed by this side") -> None:
        """Stop watching the socket and close this end (the peer reads EOF). Idempotent; `on_closed` is
        not called for a close asked for here."""
        if self.closed:
            return
        self.closed, self.reason = True, reason
        for remove in (self.loop.remove_reader, self.loop.remove_writer):
            try:
                remove(self.fd)
            except (OSError, ValueError, RuntimeError):  # the loop is closed already
                pass
        self._out.clear()
        self._in.clear()
        self.conn.close()
