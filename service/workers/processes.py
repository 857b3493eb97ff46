"""The operating system's side of worker processes: the fork server each worker is forked from (with the
media modules already imported, so a replacement is ready in milliseconds), and a process's resident
memory, which the pool watches."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext

# Imported once in the fork server, so a new worker starts with them already loaded. The family registry
# (which processor each model type uses) brings the towers' modules with it: 0.29 s of CPU in every new
# worker's warm-up when it was left out (2-core dev box).
PRELOAD = ["service.workers.jobs", "service.media.estimate", "service.media.image_preprocess",
           "service.media.video_preprocess", "models.families"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def fork_context() -> ForkServerContext:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def start_fork_server() -> None:
    """Start the fork server with SIGTERM ignored, which it keeps across its exec: a SIGTERM sent to every
    process of the server (systemd's stop, `pkill`) would end it, and with it every worker, mid-drain."""
    try:
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread: it cannot be set here, and the fork server starts as it is
        forkserver.ensure_running()
        return
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)


def wait_for_fork_server(context: ForkServerContext) -> None:
    """Returns once the fork server forks, which it does only after importing `PRELOAD`: by forking a
    process that exits at once."""
    probe = context.Process(target=_exit_at_once, name="vitserve-fork-probe", daemon=True)
    probe.start()
    probe.join()


def _exit_at_once() -> None:
    pass


def resident_bytes(pid: int | None) -> int | None:
    """Resident memory of a process from /proc (None where unavailable)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None
