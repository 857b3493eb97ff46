"""Named shared-memory segments (files under /dev/shm) that carry pixels and embeddings between the
server's processes, so that the HTTP front never copies tensor data.

The front names every segment (`SegmentNames`: its pid, a random tag and a counter), so it can unlink any
of them whatever happened to the process that was to write it; a killed worker leaks nothing. Writers
reserve the whole size up front (`posix_fallocate`): on a full /dev/shm the write fails with ENOSPC at
once, rather than a SIGBUS when a page is first touched. A segment is unlinked as soon as the last
process that needs to open it has done so; mappings stay valid after the unlink.

Large segments that no process will read again are *retired* instead, into their front's pool (a folder
beside them), and the next write of that front's segments takes a retired file of about its size: tmpfs
then keeps the pages instead of freeing them and zeroing fresh ones (see `retire`).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import math
import mmap
import os
import queue
import secrets
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
PREFIX = "vitserve_"
ALIGN = 64  # bytes: every array in a segment starts on a cache line
POOL = "pool"  # the folder of a front's retired files: <its name prefix>pool
# Writing a fresh 1.8 MB segment (one image's embedding) took 0.50 ms and unlinking it 0.20, against
# 0.15 ms to rename a retired file and rewrite it (2-core dev box): tmpfs allocates and zeroes a new
# file's pages. Smaller files gain too little for a place in the pool.
RECYCLED_MIN_BYTES = 64 << 10
POOL_BYTES = 64 << 20  # retired bytes a front keeps (racing retirements may pass it by a file each)
POOL_FILES = 64
# A write takes a retired file only within this fraction of its size. Cutting or growing a file frees or
# zeroes the difference's pages; with any size taken, one request's pixels (1.2 MB) and embedding
# (1.8 MB) took turns on the one pooled file, and every write paid for 0.6 MB (H200 host: an output
# write took 0.74 ms against 0.21 ms into a file of its size). A file that fits no write ages out.
FIT = 1 / 8


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class SegmentNames:
    """Unique segment names of one front process: vitserve_<pid>_<tag>_<kind><n>, and the pool of retired
    files they share (vitserve_<pid>_<tag>_pool, a folder: `pool_of`), open between `open_pool` and
    `close_pool`."""

    def __init__(self) -> None:
        self.prefix = f"{PREFIX}{os.getpid()}_{secrets.token_hex(3)}_"
        self._counter = itertools.count()

    def next(self, kind: str = "") -> str:
        return f"{self.prefix}{kind}{next(self._counter)}"

    @property
    def pool(self) -> Path:
        return pool_of(self.prefix)

    def open_pool(self) -> None:
        """From now on, retired segments of these names are kept for reuse (up to `POOL_BYTES`)."""
        self.pool.mkdir(mode=0o700, exist_ok=True)

    def close_pool(self) -> None:
        """Free the retired files; later retirements unlink. Call once no process retires or writes (a
        `Stocker` finishing a file as the folder goes is removed by the next pass)."""
        for _ in range(3):
            shutil.rmtree(self.pool, ignore_errors=True)
            if not self.pool.exists():
                return


# Map every page at once: a segment is read whole right after it is mapped, and one populate costs far
# less than a page fault per 4 KiB (600 of them for one image's embedding).
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def open_segment(name: str, populate: bool = True) -> mmap.mmap:
    """The whole segment, mapped read-only; `populate=False` leaves each page to its first reader."""
    fd = os.open(SHM_DIR / name, os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | (_POPULATE if populate else 0), prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        pass


def pool_of(name: str) -> Path:
    """The pool of segment `name`'s front (`SegmentNames.pool`): vitserve_<pid>_<tag>_pool."""
    return SHM_DIR / f"{'_'.join(name.split('_', 3)[:3])}_{POOL}"


def _pooled_field(entry: str, i: int) -> int:
    """Field `i` of a pooled file's name (<bytes>_<retired at, ns>_<random>): 0 for the size, 1 for the
    time; 0 for a name of any other form."""
    fields = entry.split("_")
    return int(fields[i]) if len(fields) == 3 and fields[i].isdigit() else 0


def _pooled_size(entry: str) -> int:
    return _pooled_field(entry, 0)


def retire(name: str) -> None:
    """Done with segment `name`: no process will read it again (a mapping may remain, unread), since its
    file may be rewritten with another segment's contents at once. It joins its front's pool when the
    pool is open, and the pool's oldest files make room for it (the sizes wanted now are those retired
    last); otherwise it is unlinked."""
    path = SHM_DIR / name
    try:
        size = os.stat(path).st_size
        if RECYCLED_MIN_BYTES <= size <= POOL_BYTES:
            _into_pool(path, pool_of(name), size)
            return
    except OSError:  # gone already, no pool (closed, or names not from SegmentNames)
        pass
    unlink(name)


def _into_pool(path: Path, pool: Path, size: int) -> None:
    """Rename the file at `path` into `pool` as a file of `size` bytes, its oldest files making room."""
    entries = sorted(os.listdir(pool), key=lambda e: _pooled_field(e, 1))
    total = sum(map(_pooled_size, entries))
    while entries and (len(entries) >= POOL_FILES or total + size > POOL_BYTES):
        oldest = entries.pop(0)
        total -= _pooled_size(oldest)
        _unlink_path(pool / oldest)
    os.rename(path, pool / f"{size}_{time.time_ns()}_{secrets.token_hex(6)}")


def _unlink_path(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # taken or evicted by another process meanwhile
        pass


def _take_retired(name: str, size: int) -> bool:
    """Rename a retired file of `name`'s pool to `name`: of `size` bytes or the smallest above, else the
    largest below, within `FIT` of the size; False when there is none. A rename is atomic: two writers
    never share a file."""
    pool = pool_of(name)
    try:
        entries = [(_pooled_size(e), e) for e in os.listdir(pool)]
    except OSError:
        return False
    target = SHM_DIR / name
    if entries and target.exists():  # what O_CREAT | O_EXCL refuses for a fresh file: a rename would replace it
        raise FileExistsError(errno.EEXIST, "segment exists", str(target))
    slack = int(size * FIT)
    above = sorted((n, e) for n, e in entries if size <= n <= size + slack)
    below = sorted((n, e) for n, e in entries if size - slack <= n < size)[::-1]
    for _, entry in above + below:
        try:
            os.rename(pool / entry, target)
            return True
        except FileNotFoundError:  # another writer took it
            continue
    return False


def write(name: str, data: bytes | memoryview) -> None:
    """A new segment holding `data`, written with pwrite: no mapping in this process, so no page faults
    nor TLB shootdowns (2.4 MB: 0.7 ms against 1.7 ms through a mapping, Linux, 2 cores); raises
    OSError (ENOSPC) when /dev/shm is full, before anything is written."""
    write_parts(name, [data])


def write_parts(name: str, parts: Sequence[bytes | memoryview]) -> None:
    """A new segment holding `parts` back to back, as `write` does for one buffer (one pwritev). A large
    one reuses a retired file of its front's pool when there is one (`retire`): cut to the new size, and
    written over whole, so nothing of the old contents can be read from it. On a full /dev/shm the pool's
    files are freed and the write tried once more before ENOSPC is raised."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
    try:
        _write_views(name, views)
    except OSError as exc:
        if exc.errno != errno.ENOSPC or not _empty_pool(name):
            raise
        _write_views(name, views)


def _write_views(name: str, views: list[memoryview]) -> None:
    size = sum(len(v) for v in views)
    fd = _open_retired(name, size) if size >= RECYCLED_MIN_BYTES else -1
    fresh = fd < 0
    if fresh:
        fd = os.open(SHM_DIR / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if views and fresh:
            os.posix_fallocate(fd, 0, size)
        done = 0
        while views:
            sent = os.pwritev(fd, views, done)
            done += sent
            while sent:  # drop what went, cut into the first buffer that went in part
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0], sent = views[0][sent:], 0
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)


def _open_retired(name: str, size: int) -> int:
    """A retired file renamed to `name` and cut to `size`, its pages reserved, open for writing; -1 when
    there is none."""
    if not _take_retired(name, size):
        return -1
    try:
        fd = os.open(SHM_DIR / name, os.O_WRONLY)
    except FileNotFoundError:  # unlinked meanwhile by its front (the request was cancelled)
        return -1
    try:
        grows = os.fstat(fd).st_size < size  # a file written whole has its pages: only growth needs them
        os.ftruncate(fd, size)
        if grows:
            os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    return fd


def _empty_pool(name: str) -> bool:
    """Unlink every file of `name`'s pool; whether there was any."""
    pool = pool_of(name)
    try:
        entries = os.listdir(pool)
    except OSError:
        return False
    for entry in entries:
        _unlink_path(pool / entry)
    return bool(entries)


STOCK_DEPTH = 1  # files of one size written ahead: one, taken by the next write and made again after it
STOCK_MAX_BYTES = 16 << 20


class Stocker:
    """Keeps `STOCK_DEPTH` file(s) of a wanted size written ahead in a front's pool, from a thread of its
    own. A writer whose segments are kept finds nothing retired to reuse (the encoder-output cache holds
    an engine's outputs until it is full), and a fresh file's page faults fall on the request's path: an
    output of 1.8 MB took 0.7 ms to write fresh against 0.33 ms into a written file (2-core dev box; 1.32
    against 0.21 ms on the H200 host)."""

    def __init__(self) -> None:
        self._wanted: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._names = itertools.count()
        self.made = 0

    def want(self, like: str, size: int) -> None:
        """Files of `size` bytes for the pool of segment `like`, soon; returns at once."""
        if not RECYCLED_MIN_BYTES <= size <= STOCK_MAX_BYTES:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vitserve-shm-stock", daemon=True)
            self._thread.start()
        self._wanted.put((like, size))

    def _run(self) -> None:
        while True:
            wanted = self._wanted.get()
            while not self._wanted.empty():  # behind: only the latest wish counts
                wanted = self._wanted.get()
            try:
                self._fill(*wanted)
            except OSError:  # no pool (closed, or not opened), or /dev/shm full: writes go to fresh files
                pass

    def _fill(self, like: str, size: int) -> None:
        pool = pool_of(like)
        slack = int(size * FIT)
        have = sum(size - slack <= _pooled_size(e) <= size + slack for e in os.listdir(pool))
        for _ in range(STOCK_DEPTH - have):
            # Written inside the pool under size 0, which no write takes, then renamed to its size: no
            # segment of the front's is ever seen outside its pool.
            making = pool / f"0_{time.time_ns()}_{os.getpid()}x{next(self._names)}"
            fd = os.open(making, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
                zeros = memoryview(bytes(size))
                done = 0
                while done < size:  # written, not only reserved: a reserved page still faults on first write
                    done += os.pwrite(fd, zeros[done:], done)
                _into_pool(making, pool, size)
            except BaseException:
                _unlink_path(making)
                raise
            finally:
                os.close(fd)
            self.made += 1


def write_array(name: str, arr: np.ndarray) -> None:
    """One array into a new segment of exactly its size."""
    write(name, np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)


def read_into(name: str, out: np.ndarray) -> None:
    """The segment's first `out.nbytes` bytes into `out` (contiguous), with pread: no mapping here."""
    view = memoryview(out).cast("B")
    fd = os.open(SHM_DIR / name, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], done)
            if n == 0:
                raise ValueError(f"segment {name} holds {done} bytes, {len(view)} expected")
            done += n
    finally:
        os.close(fd)


def free_bytes() -> int | None:
    """Free space of /dev/shm, or None where there is no such folder."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def sweep_stale() -> int:
    """Remove segments (and pools) left by front processes that no longer exist (killed outright); returns how many.
    A segment older than the process now holding its pid was left by an earlier one: in a container a
    restarted server gets its predecessor's pid, and /dev/shm (a pod's memory volume) outlives it."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    born: dict[int, float] = {}  # pid -> segments written before this are stale
    for entry in names:
        if not entry.startswith(PREFIX):
            continue
        field = entry[len(PREFIX):].split("_", 1)[0]
        if not field.isdigit():
            continue
        pid = int(field)
        if pid not in born:
            # Dead: all its segments. Alive: those older than it (its start is known to about a second: the
            # boot time is in whole seconds); none when its start is unknown (another user's, no /proc).
            started = process_started(pid) if process_alive(pid) else math.inf
            born[pid] = -math.inf if started is None else started - 1.0
        try:
            if os.stat(SHM_DIR / entry).st_mtime >= born[pid]:
                continue
        except OSError:
            continue
        if (SHM_DIR / entry).is_dir():  # a front's pool of retired files
            shutil.rmtree(SHM_DIR / entry, ignore_errors=True)
        else:
            unlink(entry)
        removed += 1
    return removed


def process_started(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch (Linux /proc); None if unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start, in ticks since boot
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_when_orphaned(parent: int, also: int | None = None) -> None:
    """Exit this process once `parent` is no longer its parent (and, with `also`, once that process is
    gone too); run in a daemon thread. A server killed outright cannot stop its children, and a child
    busy loading would not notice its pipe closing."""
    while os.getppid() == parent and (also is None or process_alive(also)):
        time.sleep(1.0)
    os._exit(0)


def keep_freed_memory() -> None:
    """Keep freed blocks below 32 MiB in the process for reuse, and the heap's free top below 64 MiB.
    glibc's defaults unmap every freed block above 128 KiB, so every megabyte-sized buffer of a request
    (an image, an embedding, a response body) faulted fresh pages in again: a 448x448 image took 3.6 ms
    in a worker against 2.4 ms in a warm process (2.5 ms with these settings), and base64 of one 1.8 MB
    embedding joined into a body took 2.9 ms against 1.9 ms (Linux, 2 cores). Called at the start of
    every server process: front, workers, engines."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: its own allocator's defaults
        pass
