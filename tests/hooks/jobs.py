"""Job functions for the worker-pool tests: run in the pool's worker processes by name."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from service.media.errors import MediaError


def echo(ctx: Any, value: Any) -> Any:
    return value


def pid(ctx: Any) -> int:
    return os.getpid()


def nap(ctx: Any, seconds: float, value: Any) -> Any:
    time.sleep(seconds)
    return value


def stamped_nap(ctx: Any, seconds: float, value: Any) -> tuple[float, Any]:
    """`nap`, returning when it started as well (CLOCK_MONOTONIC: one clock for every process of the host)."""
    started = time.monotonic()
    time.sleep(seconds)
    return started, value


def spin(ctx: Any, seconds: float) -> int:
    """Burn CPU (the way a runaway decode does) for `seconds`; returns the worker's pid."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return os.getpid()


def hog(ctx: Any, mib: int) -> None:
    """Take `mib` MiB of resident memory, then hold it."""
    block = bytearray(mib * 2**20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    time.sleep(60)


def crash(ctx: Any) -> None:
    os._exit(3)


def lose_channel(ctx: Any) -> None:
    """Close this worker's end of its channel and stay alive: the front sees the channel fail."""
    os.close(ctx._conn.fileno())
    time.sleep(60)


def bad_input(ctx: Any) -> None:
    raise MediaError("the item is broken", "corrupt_image")


def bug(ctx: Any) -> None:
    raise ZeroDivisionError("a bug")


def ask(ctx: Any, question: Any) -> Any:
    return ctx.ask(question)


def write_segment(ctx: Any, name: str, seconds: float) -> str:
    """After `seconds`, create segment `name` (what a media job does last), then linger."""
    from service import shm

    time.sleep(seconds)
    shm.write(name, b"pixels")
    return name


def torch_threads(ctx: Any) -> int:
    import torch

    return torch.get_num_threads()


def warm_state(ctx: Any) -> dict[str, Any]:
    """What a worker had set up before this, its first job."""
    import sys

    from PIL import Image

    return {"warmed": warmed, "pil_plugins": Image._initialized,
            "modules": [m for m in ("service.media.image_preprocess", "service.media.video_preprocess")
                        if m in sys.modules]}


warmed = False  # set in a worker by `marked_warm_up`


def marked_warm_up() -> None:
    """The server's warm-up, then a mark that it ran in this process."""
    global warmed
    from service.workers import jobs

    jobs.warm_up()
    warmed = True


def broken_warm_up() -> None:
    raise RuntimeError("warm-up failed on purpose")


FAILING_STARTS = Path(tempfile.gettempdir()) / "vitserve-test-failing-starts"


def failing_warm_up() -> None:
    """Exit before the worker is ready while `FAILING_STARTS` exists: a start that cannot succeed."""
    if FAILING_STARTS.exists():
        os._exit(7)


def encode_then_die_once(ctx: Any, marker: str, *args: Any) -> int:
    """`jobs.encode_item`, then, on the first run only (no `marker` file yet), SIGKILL before its answer
    is sent: the window in which a job's worker dies with its work done."""
    import signal

    from service.workers import jobs

    length = jobs.encode_item(ctx, *args)
    if not Path(marker).exists():
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return length
