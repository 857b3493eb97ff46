"""Shared-memory segments: how they are written, retired into a front's pool and taken again, and the
sweep a starting server runs over /dev/shm."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from service import shm


def _segment(pid: int, tag: str, mtime: float | None = None) -> str:
    name = f"{shm.PREFIX}{pid}_{tag}_out0"
    shm.write(name, b"x" * 64)
    if mtime is not None:
        os.utime(shm.SHM_DIR / name, (mtime, mtime))
    return name


def _exists(name: str) -> bool:
    return (shm.SHM_DIR / name).exists()


def test_the_sweep_removes_what_dead_or_earlier_processes_left_and_keeps_the_living():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_pid = int(dead.stdout)
    me = os.getpid()
    started = shm.process_started(me)
    assert started is not None and started <= time.time()
    left_by_dead = _segment(dead_pid, "aaaaaa")
    # A server restarted in a container gets its predecessor's pid: that one's segments predate this process.
    left_by_predecessor = _segment(me, "bbbbbb", mtime=started - 3600)
    ours = _segment(me, "cccccc")
    try:
        assert shm.sweep_stale() >= 2
        assert not _exists(left_by_dead) and not _exists(left_by_predecessor)
        assert _exists(ours)
    finally:
        for name in (left_by_dead, left_by_predecessor, ours):
            shm.unlink(name)


def test_parts_are_written_back_to_back_and_read_whole(monkeypatch):
    """`write_parts` (a response entry's JSON around its payload) and a pwritev that takes only some bytes
    per call, as the kernel may."""
    names = shm.SegmentNames()
    parts = [b'{"embedding":"', os.urandom(300_000), b"", memoryview(b'","shape":[1,2]}'), b"x" * 7]
    whole = b"".join(bytes(p) for p in parts)
    real = os.pwritev

    def short(fd, buffers, offset):  # at most 1000 bytes per call
        return real(fd, [memoryview(b)[:1000] for b in buffers[:1]], offset)

    for pwritev in (real, short):
        monkeypatch.setattr(os, "pwritev", pwritev)
        name = names.next("parts")
        shm.write_parts(name, parts)
        try:
            assert bytes(shm.open_segment(name)) == whole
        finally:
            shm.unlink(name)


@pytest.fixture
def names():
    names = shm.SegmentNames()
    names.open_pool()
    yield names
    names.close_pool()
    assert not names.pool.exists()


def _pooled(names: shm.SegmentNames) -> dict[int, int]:
    """inode -> size of the pool's files. A file the stocker is making is renamed to its size while this
    looks, so an entry listed may be gone by its stat: the list is taken again."""
    while True:
        try:
            stats = [(names.pool / e).stat() for e in os.listdir(names.pool)]
        except FileNotFoundError:
            continue
        return {st.st_ino: st.st_size for st in stats}


def _inode(name: str) -> int:
    return (shm.SHM_DIR / name).stat().st_ino


def test_a_retired_segment_is_rewritten_in_place_holding_only_the_new_bytes(names):
    first = names.next("out")
    shm.write(first, os.urandom(400_000))
    inode = _inode(first)
    shm.retire(first)
    assert not _exists(first) and _pooled(names) == {inode: 400_000}
    for size in (360_000, 400_000):  # smaller, then larger than the file it takes
        data = os.urandom(size)
        name = names.next("out")
        shm.write(name, data)
        assert _inode(name) == inode and _pooled(names) == {}
        assert bytes(shm.open_segment(name)) == data  # exactly the new bytes: cut to size, written over whole
        shm.retire(name)
    assert _pooled(names) == {inode: 400_000}
    taken = names.next("out")
    shm.write(taken, b"x" * 100_000)
    with pytest.raises(FileExistsError):  # a name is written once, pool or not
        shm.write(taken, b"y" * 400_000)
    assert bytes(shm.open_segment(taken)) == b"x" * 100_000 and _pooled(names) == {inode: 400_000}
    shm.unlink(taken)


def test_pixels_and_outputs_of_one_request_keep_a_file_each(names):
    """A request writes its pixels (1.2 MB), the engine retires them and writes the output (1.8 MB), the
    encoder retires that: once both sizes are in the pool, each write takes a file of its own size and
    no file is cut or grown (which frees or zeroes pages)."""
    inodes: dict[str, set[int]] = {"px": set(), "out": set()}
    for _ in range(4):
        for kind, size in (("px", 1_204_224), ("out", 1_835_008)):
            name = names.next(kind)
            shm.write(name, b"x" * size)
            inodes[kind].add(_inode(name))
            shm.retire(name)
    assert len(inodes["px"]) == len(inodes["out"]) == 1 and inodes["px"] != inodes["out"]


def test_a_write_takes_the_closest_fit_within_an_eighth_of_its_size_and_small_ones_stay_out(names):
    inodes = {}
    for size in (100_000, 300_000, 1_000_000):
        name = names.next("px")
        shm.write(name, b"x" * size)
        inodes[size] = _inode(name)
    for name in names.prefix + "px0", names.prefix + "px1", names.prefix + "px2":
        shm.retire(name)
    small = names.next("px")
    shm.write(small, b"y" * (shm.RECYCLED_MIN_BYTES - 1))
    assert _inode(small) not in inodes.values()  # too small to take a pooled file
    shm.retire(small)
    assert not _exists(small) and len(_pooled(names)) == 3  # nor to join the pool
    taken = []
    for size in (290_000, 1_050_000, 95_000):  # the smallest above, else the largest below
        name = names.next("px")
        shm.write(name, b"z" * size)
        taken.append(_inode(name))
        if size == 1_050_000:
            shm.retire(name)  # back, as a file of 1.05 MB
        else:
            shm.unlink(name)
    assert taken == [inodes[300_000], inodes[1_000_000], inodes[100_000]]
    for size in (900_000, 1_250_000):  # the pool's one file is more than an eighth above, then below
        name = names.next("px")
        shm.write(name, b"z" * size)
        assert _inode(name) != inodes[1_000_000] and len(_pooled(names)) == 1
        shm.unlink(name)


def test_the_stocker_writes_files_ahead_that_the_next_writes_of_that_size_take(names):
    """An engine's outputs kept by the cache never retire, so every output paid for a fresh file: the
    stocker keeps a file of the size written ahead in the pool, never seen outside it, and the next
    write of that size takes it."""
    assert shm.STOCK_DEPTH == 1
    stocker = shm.Stocker()
    size = 1_835_008
    written = [names.next("out")]
    shm.write(written[0], b"x" * size)  # fresh: the pool is empty
    deadline = time.monotonic() + 5
    for _ in range(3):
        stocker.want(written[-1], size)
        # By the size its name gives: a file being made already has its length, but no write takes it
        while [shm._pooled_size(e) for e in os.listdir(names.pool)] != [size]:
            assert time.monotonic() < deadline, _pooled(names)
            assert all(e.startswith(shm.POOL, len(names.prefix)) for e in os.listdir(shm.SHM_DIR)
                       if e.startswith(names.prefix) and e not in written)
            time.sleep(0.005)
        stocked = set(_pooled(names))
        written.append(names.next("out"))
        data = os.urandom(size)
        shm.write(written[-1], data)
        assert _inode(written[-1]) in stocked and bytes(shm.open_segment(written[-1])) == data
        assert _pooled(names) == {}
    shm.retire(written.pop())  # a file of the size in the pool: none made
    stocker.want(written[-1], size)
    stocker.want(written[-1], 1000)  # too small to pool: none made
    time.sleep(0.2)
    assert stocker.made == 3 and len(_pooled(names)) == 1
    for name in written:
        shm.unlink(name)


def test_the_pool_is_bounded_and_closed_pools_unlink(names, monkeypatch):
    monkeypatch.setattr(shm, "POOL_BYTES", 1_000_000)
    written = [names.next("out") for _ in range(4)]
    for name in written:
        shm.write(name, b"x" * 300_000)
    inodes = []
    for name in written:
        inodes.append(_inode(name))
        shm.retire(name)
        assert not _exists(name)
    # The fourth would pass the bound: the oldest makes room for it.
    assert set(_pooled(names)) == set(inodes[1:]) and sum(_pooled(names).values()) == 900_000
    monkeypatch.setattr(shm, "POOL_FILES", 2)
    newest = names.next("out")
    shm.write(newest, b"x" * 100_000)  # a fresh file: no pooled one within an eighth of its size
    inodes.append(_inode(newest))
    shm.retire(newest)
    assert set(_pooled(names)) == set(inodes[3:])  # at most two files: the two retired last
    names.close_pool()
    late = names.next("out")
    shm.write(late, b"x" * 300_000)  # no pool: a fresh file
    shm.retire(late)
    assert not _exists(late) and not names.pool.exists()


def test_concurrent_writers_never_share_a_file(names):
    """Threads write, read back and retire their own segments over one pool: a file taken by two writers
    at once would show the other's bytes."""
    errors: list[str] = []

    def worker(k: int) -> None:
        for i in range(40):
            data = bytes([k, i % 256]) * (70_000 + 997 * ((k + i) % 7))
            name = names.next(f"t{k}_")
            shm.write(name, data)
            if bytes(shm.open_segment(name)) != data:
                errors.append(name)
            shm.retire(name)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    pooled = _pooled(names)
    assert 0 < len(pooled) <= shm.POOL_FILES and sum(pooled.values()) <= shm.POOL_BYTES


def test_the_sweep_removes_a_dead_front_s_pool():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    pool = shm.SHM_DIR / f"{shm.PREFIX}{int(dead.stdout)}_dddddd_{shm.POOL}"
    pool.mkdir()
    (pool / "100000_abc").write_bytes(b"x" * 100)
    try:
        assert shm.sweep_stale() >= 1
        assert not pool.exists()
    finally:
        shutil.rmtree(pool, ignore_errors=True)


def test_a_full_dev_shm_frees_the_pool_before_refusing_a_write(names, monkeypatch):
    """The pool's files hold room that a write on a full /dev/shm needs: they go, and the write is tried
    once more; with an empty pool ENOSPC stands."""
    kept = names.next("out")
    shm.write(kept, b"x" * 300_000)
    shm.retire(kept)
    real = os.posix_fallocate

    def full_while_pooled(fd, offset, length):  # room only once the pool is empty
        if os.listdir(names.pool):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full_while_pooled)
    name = names.next("out")
    shm.write(name, b"y" * 100_000)  # too small to take the 300 kB file: a fresh one, which does not fit
    assert bytes(shm.open_segment(name)) == b"y" * 100_000 and _pooled(names) == {}
    shm.unlink(name)
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError) as refused:
        shm.write(names.next("out"), b"z" * 100_000)
    assert refused.value.errno == errno.ENOSPC and not any(shm.SHM_DIR.glob(f"{names.prefix}out*"))


_FAULTS_SCRIPT = """
import resource, sys
from service.shm import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):  # as a render: an embedding, its base64 and the joined body alive at once, then freed
    parts = [bytearray(1 << 20), bytearray(2 << 20), bytearray(2 << 20)]  # zero-filled: every page written
    del parts
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
"""


def test_processes_keep_freed_megabyte_buffers_instead_of_faulting_fresh_pages():
    """Each server process calls keep_freed_memory at start: a request's megabyte-sized buffers then
    reuse pages freed by the previous request instead of faulting in new ones (about 0.3 ms of a lone
    request's render on the H200 host)."""
    faults = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], capture_output=True, text=True,
                             check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        faults[mode] = int(out.stdout)
    # 40 rounds of 1280 pages: about 50000 faults when the freed heap top is handed back each time.
    assert faults["default"] > 20000, faults
    assert faults["keep"] < faults["default"] / 10, faults
