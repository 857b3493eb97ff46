"""A chaos soak over a real server: concurrent mixed traffic (images of many sizes, a few videos) while a
media worker is SIGKILLed every second and, once, every engine process at the same time (two CPU
engines, `--data-parallel 2`: engines run as processes there, as on a GPU).

What a client must see: no dropped connection and no timeout; every request 200, or 503 with
Retry-After while no engine is up. Afterwards the server is back at full capacity by itself (every
worker idle, every engine ready, `/ready` 200), holds no segment in /dev/shm but its pool of retired
files, and its memory is back near where it started."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.http_helpers import SubprocessServer, b64, image_bytes, shm_entries
from tests.videos import make_video

SOAK_S = 30.0
SOAK_MAX_S = 80.0
CLIENTS = 6
WORKERS = 3
KILL_EVERY_S = 1.0
ENGINES_KILLED_AT_S = 8.0


def media() -> list[tuple[str, dict]]:
    """(name, item) of the traffic: JPEG and PNG from 2 KB to about 230 KB (inline, in a segment, above
    the pipe's buffer), and two short videos."""
    items = []
    for i, (w, h, fmt) in enumerate([(32, 32, "PNG"), (96, 80, "JPEG"), (160, 160, "PNG"), (275, 275, "PNG"),
                                     (448, 448, "JPEG"), (200, 120, "WEBP")]):
        items.append((f"{fmt.lower()}-{w}x{h}", {"type": "image", "image": b64(image_bytes(w, h, seed=i, fmt=fmt))}))
    for i, (frames, w, h) in enumerate([(8, 112, 84), (16, 160, 120)]):
        clip = make_video(frames, fps=4, width=w, height=h)
        items.append((f"video-{i}", {"type": "video", "video": b64(clip), "fps": 2.0}))
    return items


def status_of(pid: int) -> tuple[int, int] | None:
    """(parent pid, resident bytes) of a live process; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if stat[0] == "Z":
        return None
    return int(stat[1]), int(stat[21]) * os.sysconf("SC_PAGE_SIZE")


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and every process below it."""
    procs = {int(p.name): s for p in Path("/proc").iterdir() if p.name.isdigit() and (s := status_of(int(p.name)))}
    total, frontier = 0, {root}
    while frontier:
        total += sum(procs[p][1] for p in frontier if p in procs)
        frontier = {pid for pid, (parent, _) in procs.items() if parent in frontier}
    return total


def watch(admin: httpx.Client, began: float, engines_down: list[float]) -> float | None:
    """Until the soak ends: when the engines were back, as a client sees it (/ready 200 after a 503)."""
    back_at, seen_down = None, False
    # At least SOAK_S, and on until the engines are back (their restart loads weights: seconds on an idle
    # 2-core machine, many more on a busy one), within SOAK_MAX_S.
    while time.monotonic() - began < SOAK_S or (back_at is None and time.monotonic() - began < SOAK_MAX_S):
        time.sleep(0.25)
        if engines_down and back_at is None:
            up = admin.get("/ready").status_code == 200
            seen_down = seen_down or not up
            if up and seen_down:
                back_at = time.monotonic() - began
    return back_at


def worker_pids(server: int) -> list[int]:
    """The media workers: the children of the server's fork server (read from /proc, not from the server)."""
    def children(parent: int) -> list[int]:
        return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                and (s := status_of(int(p.name))) is not None and s[0] == parent]

    def cmdline(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return ""

    servers = [p for p in children(server) if "multiprocessing.forkserver" in cmdline(p)]
    return [w for fs in servers for w in children(fs)]


def test_the_server_heals_under_killed_workers_and_a_killed_engine() -> None:
    traffic = media()
    flags = ["--data-parallel", "2", "--preprocess-workers", str(WORKERS), "--request-timeout-s", "60",
             "--log-level", "warning"]
    with SubprocessServer(*flags) as srv, httpx.Client(base_url=srv.url, timeout=30) as admin:
        assert srv.proc is not None and srv.proc.stdout is not None
        pid = srv.proc.pid
        # Its log, read as it comes: a full pipe would block the server on its next line (every worker
        # killed is a warning).
        log: list[str] = []
        threading.Thread(target=lambda: log.extend(srv.proc.stdout), daemon=True).start()  # type: ignore[union-attr]
        for _, item in traffic:  # warm: every kind of item once, so the memory baseline has seen them all
            assert admin.post("/encode", json={"items": [item]}, timeout=60).status_code == 200
        baseline = tree_rss(pid)
        engine_pids = [e["pid"] for e in admin.get("/info").json()["engines"]]

        # (time, item, status or error, retry-after, the body of an answer neither 200 nor 503)
        outcomes: list[tuple[float, str, int | str, str | None, str | None]] = []
        stop = threading.Event()
        began = time.monotonic()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                while not stop.is_set():
                    name, item = rng.choice(traffic)
                    try:
                        r = c.post("/encode", json={"items": [item]})
                        outcomes.append((time.monotonic() - began, name, r.status_code, r.headers.get("retry-after"),
                                         None if r.status_code in (200, 503) else r.text[:300]))
                        if r.status_code == 503:
                            time.sleep(0.2)
                    except httpx.HTTPError as exc:  # a dropped connection or a timeout: never acceptable
                        outcomes.append((time.monotonic() - began, name, f"{type(exc).__name__}: {exc}", None, None))

        killed = {"workers": 0, "engines": 0}
        engines_down: list[float] = []

        def chaos() -> None:
            rng = random.Random(0)
            while not stop.wait(KILL_EVERY_S):
                now = time.monotonic() - began
                if now >= ENGINES_KILLED_AT_S and not engines_down:
                    engines_down.append(now)
                    for engine in engine_pids:
                        os.kill(engine, signal.SIGKILL)
                        killed["engines"] += 1
                pids = worker_pids(pid)
                if pids:
                    try:
                        os.kill(rng.choice(pids), signal.SIGKILL)
                        killed["workers"] += 1
                    except ProcessLookupError:
                        pass

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        threads.append(threading.Thread(target=chaos, daemon=True))
        for t in threads:
            t.start()
        try:
            back_at = watch(admin, began, engines_down)
        finally:
            stop.set()
            for t in threads:
                t.join(90)

        # Full capacity again, on its own.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = admin.get("/info").json()
            if admin.get("/ready").status_code == 200 and info["workers"]["states"]["idle"] == WORKERS \
                    and all(e["state"] == "ready" for e in info["engines"]):
                break
            time.sleep(0.2)
        info = admin.get("/info").json()
        ready = admin.get("/ready")
        time.sleep(1.0)  # what the last requests released, gone
        leftover = shm_entries(f"vitserve_{pid}_", pools=False)
        rss = tree_rss(pid)

    errors = [o for o in outcomes if not isinstance(o[2], int)]
    assert not errors, f"{len(errors)} dropped or timed out, e.g. {errors[:5]}"
    statuses = [o[2] for o in outcomes]
    logged = "".join(line for line in log if " ERROR " in line or "Error" in line)[:6000]
    unexpected = [o for o in outcomes if o[2] not in (200, 503)][:10]
    assert set(statuses) <= {200, 503}, f"{unexpected}\n{logged}"
    refused = [o for o in outcomes if o[2] == 503]
    assert all(o[3] for o in refused), "a 503 without Retry-After"
    assert engines_down and back_at is not None, "the engines never came back while the soak ran"
    late = [o for o in refused if not engines_down[0] - 1 <= o[0] <= back_at + 1]
    assert not late, f"503 outside the engines' restart ({engines_down[0]:.1f}-{back_at:.1f}s): {late[:5]}"
    # Traffic flowed throughout (34 answers on a 2-core box busy with other work: the floor is below that)
    assert statuses.count(200) >= 20 and killed["workers"] >= SOAK_S / KILL_EVERY_S / 2, (statuses.count(200),
                                                                                             killed)
    assert ready.status_code == 200, ready.text
    assert info["workers"]["states"] == {"idle": WORKERS, "busy": 0, "starting": 0, "dying": 0}, info["workers"]
    assert [e["state"] for e in info["engines"]] == ["ready", "ready"] and info["engine_restarts"] == 2
    assert info["workers"]["restarts"] >= killed["workers"]
    assert leftover == [], leftover
    # Every server process keeps its freed megabyte buffers (shm.keep_freed_memory), and a restarted engine or
    # worker starts from its own high-water mark: growth of a fifth of the tree is that, not a leak (seen: 9%).
    bound = baseline + max(200 * 2**20, baseline // 5)
    assert rss < bound, f"{rss / 2**20:.0f} MiB against {baseline / 2**20:.0f} MiB before"
