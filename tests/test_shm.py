"""Segments left behind: the sweep a starting server runs over /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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
