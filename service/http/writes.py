"""Large response bodies go to the socket from a writer thread, not from the event loop.

uvloop writes to a socket inside `transport.write`, holding the GIL: the kernel's copy of a 2.4 MB
answer (one Qwen2.5-VL-7B image, base64) into a loopback TCP socket costs about 0.5 ms, a fifth of
what the event loop spends on the whole request, and nothing else in the process runs meanwhile.
`os.writev` releases the GIL, so a writer thread makes that copy on another core while the loop serves
the other requests.

`ThreadedWrites` wraps a connection's transport. What one loop turn writes (a response's head and
the parts of its body, see `responses.PartsResponse`) is written together at the end of the turn: up
to `THREAD_BYTES` in one system call by the transport, more by a writer thread in one `writev`.
Writes that come while the thread works wait behind it, so bytes keep their order. The thread makes one
pass of non-blocking writes on its own duplicate of the socket (a descriptor the loop closes meanwhile
cannot be reused under it) and never waits for the client: what the socket does not take at once goes
back to the transport, which sends it as the client reads, under its usual flow control. A close
asked for meanwhile happens once the thread is done.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

# Below this the loop's own write costs it less than the hand-over to a thread and back: about 22 us
# of the loop's CPU, where the kernel copies about 5 MB per ms into a loopback socket (2-core dev box).
THREAD_BYTES = 256 << 10
WRITER_THREADS = 2
log = logging.getLogger("vitserve.http")

Job = tuple[int, list[memoryview], Callable[[list[memoryview], OSError | None], None]]
_jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
_started: list[threading.Thread] = []
_start_lock = threading.Lock()


def submit(fd: int, buffers: list[memoryview], done: Callable[[list[memoryview], OSError | None], None]) -> None:
    """`write_once(fd, buffers)` on a writer thread, then `done(left, error)` there."""
    if len(_started) < WRITER_THREADS:
        with _start_lock:
            while len(_started) < WRITER_THREADS:
                t = threading.Thread(target=_writer, name=f"vitserve-write-{len(_started)}", daemon=True)
                t.start()
                _started.append(t)
    _jobs.put((fd, buffers, done))


def _writer() -> None:
    while True:  # a failure here must neither end the thread nor leave a connection waiting
        fd, buffers, done = _jobs.get()
        try:
            left, error = write_once(fd, buffers)
        except Exception as exc:
            log.exception("writing a response failed")
            left, error = buffers, OSError(f"{type(exc).__name__}: {exc}")
        try:
            done(left, error)
        except Exception:
            log.exception("handing a written response back failed")


def write_once(fd: int, buffers: list[memoryview]) -> tuple[list[memoryview], OSError | None]:
    """Write `buffers` to the non-blocking `fd` until it would block, then close `fd`; what is left
    unwritten, and the error that stopped the writing (None if none did)."""
    try:
        while buffers:
            try:
                sent = os.writev(fd, buffers)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            while sent and buffers:
                head = buffers[0]
                if sent >= len(head):
                    sent -= len(head)
                    buffers.pop(0)
                else:
                    buffers[0] = head[sent:]
                    sent = 0
        return buffers, None
    except OSError as exc:
        return buffers, exc
    finally:
        os.close(fd)


class ThreadedWrites:
    """A transport whose large writes are made by a writer thread (see the module docstring); every
    other call goes to the wrapped transport."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._queue: list[memoryview] = []  # written by the app, not yet handed to the kernel or transport
        self._writing = False  # a writer thread holds buffers of this connection
        self._flush_scheduled = False
        self._close_asked = False
        self.closed_here = False  # close() or abort() was called: this side ended the connection

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        self._queue.append(memoryview(data).cast("B"))
        if not self._writing:
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write what this loop turn wrote: small writes joined into one, large ones by a writer thread."""
        self._flush_scheduled = False
        if self._writing or not self._queue:
            return
        if self._transport.is_closing():
            self._queue.clear()
            return
        fd = -1
        if sum(len(b) for b in self._queue) >= THREAD_BYTES and not self._transport.get_write_buffer_size():
            try:
                fd = os.dup(self._transport.get_extra_info("socket").fileno())
            except (AttributeError, OSError):  # no socket to write to directly: the transport writes
                pass
        if fd < 0:
            self._give_back(self._take_queue())
            self._close_if_asked()
            return
        self._writing = True
        submit(fd, self._take_queue(), self._call_written)

    def _call_written(self, left: list[memoryview], error: OSError | None) -> None:  # on the writer thread
        try:
            self._loop.call_soon_threadsafe(self._written, left, error)
        except RuntimeError:  # the loop closed meanwhile: the server is gone
            pass

    def _take_queue(self) -> list[memoryview]:
        buffers, self._queue = self._queue, []
        return buffers

    def _give_back(self, buffers: list[memoryview]) -> None:
        """`buffers` to the transport, which writes at once what the socket takes and keeps the rest."""
        if self._transport.is_closing():  # the client went away meanwhile: nobody reads these
            return
        if sum(len(b) for b in buffers) < THREAD_BYTES:  # one system call for the lot
            self._transport.write(b"".join(buffers))
            return
        for b in buffers:
            self._transport.write(b)

    def _close_if_asked(self) -> None:
        if self._close_asked and not self._writing and not self._queue:
            self._transport.close()

    def _written(self, left: list[memoryview], error: OSError | None) -> None:
        self._writing = False
        if error is not None:  # the client is gone (or the socket broken): nothing more can reach it
            self._queue.clear()
            self._transport.abort()
            return
        if left:  # the client reads slowly: the transport sends the rest as it can, then what followed
            self._give_back(left + self._take_queue())
        elif self._queue:
            self._flush()
            return
        self._close_if_asked()

    # ---- what depends on bytes not yet given to the transport -------------------------------------
    def close(self) -> None:
        self.closed_here = True
        if self._writing or self._queue:
            self._close_asked = True
        else:
            self._transport.close()

    def is_closing(self) -> bool:
        return self._close_asked or self._transport.is_closing()

    def abort(self) -> None:
        self.closed_here = True
        self._queue.clear()
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(b) for b in self._queue)
