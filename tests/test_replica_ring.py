"""Replicas that find each other, end to end: real `vitserve serve` processes on 127.0.0.2-5 (one port), each
with `--replicas-from dns:vitserve-peers.test` and its own POD_IP, behind a hosts file the test writes
(tests/hooks/hosts.py: `socket.getaddrinfo` answers the name from it, so the resolution's code path is the
real one). A thread stands for Kubernetes' endpoints controller: the name lists the replicas whose /ready
answers 200, so readiness gates membership as a headless Service does. Chat requests go through every
front (a stub LLM server records what they forward); the connector's lookups (`ec_client.Replicas` on its
own `Membership` of the same name) fetch every id.

Then a fourth replica joins, one drains (SIGTERM) and one is killed (SIGKILL, while the endpoints wait
as Kubernetes does before it sees a dead pod): no chat request fails, every fetch of an output a live
replica holds is answered (the draining one's too, once it has left every ring), the share of items found
in a cache is back to all of them after each change, and the ids that moved are exactly those the changed
replica wins or held. 40-75 s on two cores.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.handoff.ec_client import FetchError, Loader, Replicas, check_output
from service.handoff.membership import DnsSource, Membership, rendezvous
from tests.hooks import hosts
from tests.http_helpers import QuietHandler, SubprocessServer, free_port, image_bytes, loopback_http_server, server_url

NAME = "vitserve-peers.test"
ADDRESSES = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
# Enough ids that every replica wins some whatever the port (a joining one wins none once in 10,000 runs).
IMAGES = [image_bytes(48 + 4 * (k % 5), 48, seed=300 + k) for k in range(32)]
N = len(IMAGES)
PER_REQUEST = 4


class Recorder(QuietHandler):
    """The LLM server: keeps each forwarded chat by the tag in its first text part."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.chats[body["messages"][0]["content"][0]["text"]] = body  # type: ignore[attr-defined]
        self.reply(200, b'{"choices": []}', "application/json")


class Endpoints:
    """What the endpoints controller does for a headless Service with publishNotReadyAddresses false: the
    name lists the replicas whose readiness probe passes (/ready asked every 0.2 s, 3 s to answer; listed
    at the first 200, dropped after two failures in a row, as the chart's probe does). `paused()`: the
    time Kubernetes takes to see that a pod died."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.replicas: dict[str, str] = {}  # address -> URL
        self.listed: list[str] = []
        self.failures: dict[str, int] = {}
        self._lock = threading.Lock()  # held by each round of asking, and while paused
        self._stop = threading.Event()
        hosts.write(path, {})
        self._thread = threading.Thread(target=self._run, name="test-endpoints", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=3, trust_env=False) as client:
            while not self._stop.wait(0.2):
                with self._lock:
                    replicas = dict(self.replicas)  # the round asks those listed when it began
                    for address, url in replicas.items():
                        try:
                            passed = client.get(url + "/ready").status_code == 200
                        except httpx.HTTPError:
                            passed = False
                        self.failures[address] = 0 if passed else self.failures.get(address, 2) + 1
                    ready = [a for a in replicas if self.failures[a] < 2]
                    if ready != self.listed:
                        hosts.write(self.path, {NAME: ready})
                        self.listed = ready

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No round of asking runs meanwhile (one under way finishes first)."""
        with self._lock:
            yield

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def common_port() -> int:
    """A port free on every test address."""
    for _ in range(50):
        port = free_port(ADDRESSES[0])
        try:
            for address in ADDRESSES[1:]:
                with socket.socket() as s:
                    s.bind((address, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every test address")


class Ring:
    """The replicas, the LLM stub, the endpoints and the connector's side, with the checks the test makes."""

    def __init__(self, stack: ExitStack, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp
        self.port = common_port()
        self.hosts_file = str(tmp / "hosts")
        self.endpoints = Endpoints(self.hosts_file)
        stack.callback(self.endpoints.close)
        self.llm = stack.enter_context(loopback_http_server(Recorder))
        self.llm.chats = {}  # type: ignore[attr-defined]
        self.stack = stack
        self.servers: dict[str, SubprocessServer] = {}  # URL -> server
        self.uuids: list[str] = []  # per image
        self.requests = itertools.count(1)  # tags the chats the stub records
        # The connector's side: its own ring of the same name, resolved by its own thread.
        monkeypatch.setattr(socket, "getaddrinfo", hosts.getaddrinfo_from(self.hosts_file))
        self.connector = Replicas(Membership(source=DnsSource(NAME, self.port)), timeout=10)
        self.connector.membership.start()
        stack.callback(self.connector.membership.close)
        self.loader = Loader(self.connector, "cpu")

    def url(self, address: str) -> str:
        return f"http://{address}:{self.port}"

    def spawn(self, *addresses: str) -> None:
        """Replicas starting side by side, not yet published (`publish`)."""
        for address in addresses:
            server = SubprocessServer(
                "--replicas-from", f"dns:{NAME}", "--llm-url", server_url(self.llm), "--cache-bytes", str(64 << 20),
                "--preprocess-workers", "1", "--request-timeout-s", "30",
                host=address, port=self.port, launcher="tests.hooks.hosts", log_path=self.tmp / f"{address}.log",
                env={"POD_IP": address, "VITSERVE_TEST_HOSTS": self.hosts_file})
            self.stack.enter_context(_Stopped(server))
            self.servers[server.url] = server.start()

    def publish(self, *addresses: str) -> None:
        """Once each is ready, the endpoints list it whenever its /ready answers 200."""
        for address in addresses:
            server = self.servers[self.url(address)]
            try:
                _wait_ready(server)
            except RuntimeError:
                pytest.fail(f"replica {address} did not start:\n{server.log_path.read_text()[-3000:]}")  # type: ignore
            with self.endpoints.paused():  # not while a round of asking is under way
                self.endpoints.replicas[address] = server.url

    def live(self) -> list[str]:
        return [u for u, s in self.servers.items() if s.proc is not None and s.proc.poll() is None]

    def wait_ring(self, members: list[str], fronts: list[str], draining: str | None = None) -> None:
        """Until every front in `fronts` and the connector see exactly `members`; meanwhile the LLM server
        keeps asking the `draining` replica (an empty check), as it would while vLLM serves requests."""
        want = sorted(members)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if draining is not None:
                httpx.post(draining + "/v1/encoder_cache/check", json={"ids": []}, timeout=5)
            seen = [httpx.get(u + "/info", timeout=5).json()["replicas"]["members"] for u in fronts]
            if all(s == want for s in seen) and sorted(self.connector.urls) == want:
                return
            time.sleep(0.2)
        raise AssertionError(f"the ring did not become {want}: fronts see {seen}, the connector "
                             f"{list(self.connector.urls)}")

    # ---- traffic --------------------------------------------------------------------------------------
    def chat(self, front: str, indices: list[int]) -> tuple[list[str], int]:
        """One chat request through `front` with these images: (their uuids, the cache hits)."""
        tag = f"request {next(self.requests)}"
        content: list[dict[str, Any]] = [{"type": "text", "text": tag}]
        content += [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                         + base64.b64encode(IMAGES[i]).decode()}} for i in indices]
        r = httpx.post(front + "/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "user", "content": content}]}, timeout=60)
        assert r.status_code == 200, f"{front}: {r.status_code} {r.text}"
        forwarded = self.llm.chats[tag]["messages"][0]["content"][1:]  # type: ignore[attr-defined]
        return [p["uuid"] for p in forwarded], int(r.headers["x-vitserve-cache-hits"])

    def load(self, fronts: list[str], images: list[int] | None = None) -> int:
        """Every image (or those given) once, PER_REQUEST to a request, the requests spread over `fronts` and
        sent three at a time: the cache hits. Every request must succeed."""
        images = list(range(N)) if images is None else images
        batches = [images[k:k + PER_REQUEST] for k in range(0, len(images), PER_REQUEST)]
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda kb: self.chat(fronts[kb[0] % len(fronts)], kb[1]), enumerate(batches)))
        got = {i: u for batch, (uuids, _) in zip(batches, answers) for i, u in zip(batch, uuids)}
        if self.uuids:  # content ids: the same image is the same id on every replica
            assert all(self.uuids[i] == u for i, u in got.items())
        else:
            self.uuids = [got[i] for i in range(N)]
        return sum(hits for _, hits in answers)

    def holders(self) -> dict[str, set[str]]:
        """Which live replicas hold each id (their POST /v1/encoder_cache/check)."""
        out: dict[str, set[str]] = {u: set() for u in self.uuids}
        for url in self.live():
            try:
                present = httpx.post(url + "/v1/encoder_cache/check", json={"ids": self.uuids}, timeout=10).json()
            except httpx.HTTPError:  # a draining replica that has just gone
                continue
            for u, held in zip(self.uuids, present["present"]):
                if held:
                    out[u].add(url)
        return out

    def fetch_all(self) -> dict[str, str]:
        """The connector's check, then each id's fetch as a worker loads it: id -> the replica found on."""
        where = self.connector.check(self.uuids)
        for u in self.uuids:
            tensor, header = self.loader.load(u, where[u])
            check_output(u, header, tensor.shape[0])
        return {u: w for u, w in where.items() if w is not None}

    def counter(self, url: str, name: str, **labels: str) -> float:
        text = httpx.get(url + "/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        raise AssertionError(f"{url} has no {name} {labels}")


class _Stopped:
    """Stops a server at the end whatever happened (SIGKILL to its whole group)."""

    def __init__(self, server: SubprocessServer) -> None:
        self.server = server

    def __enter__(self) -> SubprocessServer:
        return self.server

    def __exit__(self, *exc: object) -> None:
        proc = self.server.proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _wait_ready(server: SubprocessServer) -> None:
    from tests.http_helpers import wait_ready

    assert server.proc is not None
    wait_ready(server.url, timeout=180, proc=server.proc)


def owner(members: list[str], item_id: str) -> str:
    return rendezvous(members, item_id)[0]


def test_replicas_follow_the_rings_members_through_a_join_a_drain_and_a_kill(tmp_path, monkeypatch):
    with ExitStack() as stack:
        ring = Ring(stack, tmp_path, monkeypatch)
        a, b, c, d = (ring.url(x) for x in ADDRESSES)

        # ---- three replicas: each id is encoded on its replica, found there by the connector -------------
        ring.spawn(*ADDRESSES)  # the fourth starts now too (it joins later: a pod the endpoints do not list yet)
        ring.publish(*ADDRESSES[:3])
        three = [a, b, c]
        ring.wait_ring(three, three)
        assert ring.load(three) == 0
        assert ring.holders() == {u: {owner(three, u)} for u in ring.uuids}
        assert ring.fetch_all() == {u: owner(three, u) for u in ring.uuids}
        assert ring.connector.found == {"home": N, "elsewhere": 0, "missing": 0}
        assert ring.load([c, a, b]) == N  # through other fronts: every item found where its id points
        info = httpx.get(a + "/info").json()["replicas"]
        assert info["self"] == a and info["source"] == f"dns:{NAME}:{ring.port}" and info["down"] == []
        assert sum(ring.counter(u, "vitserve_replica_items_total", found="encoded") for u in three) == N
        assert sum(ring.counter(u, "vitserve_replica_forwards_total") for u in three) > 0
        assert ring.counter(a, "vitserve_replica_members") == 3

        # ---- a fourth joins: it wins some ids; they are found on their old replica until encoded again ---
        ring.publish(ADDRESSES[3])
        four = [a, b, c, d]
        ring.wait_ring(four, four)
        before = ring.holders()
        moved = moved_ids(ring.uuids, three, four, d, before)  # d holds nothing yet: all that move
        found = ring.fetch_all()  # before anything is encoded again: the next replica in each id's order
        assert found == {u: owner(three, u) for u in ring.uuids}
        assert ring.connector.found["elsewhere"] == len(moved)
        assert ring.load(four) == N - len(moved)  # a moved item is a miss: encoded again on its new replica
        assert diff(before, ring.holders()) == {(u, d) for u in moved}
        assert ring.load([d, c, b, a]) == N  # recovered
        assert ring.fetch_all() == {u: owner(four, u) for u in ring.uuids}

        # ---- one drains: out of the ring at once, its outputs still fetched while it lingers -------------
        before = ring.holders()
        drained = max(four, key=lambda url: sum(urls == {url} for urls in before.values()))  # most ids alone
        only_there = {u for u, urls in before.items() if urls == {drained}}
        ring.servers[drained].terminate()
        deadline = time.monotonic() + 10  # the signal arrives within moments: /ready says so first
        while httpx.get(drained + "/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/ready did not turn 503 on SIGTERM"
            time.sleep(0.02)
        held = next(iter(only_there))  # out of the ring, but still serving what it holds
        assert httpx.get(f"{drained}/v1/encoder_cache/{held}", timeout=5).status_code == 200
        fetch_while_draining(ring, drained, only_there)
        rest = [u for u in four if u != drained]
        # At once, while some fronts may still count it in: its /encode answers 503 and its items go to the
        # next replica in their order, the one they move to. No request fails; an item is a miss only if
        # its replica changed and the new one does not hold it yet. Two of its own ids wait (`late`).
        fresh = moved_ids(ring.uuids, four, rest, drained, before)
        late = set(sorted(only_there)[:2])
        early = [i for i, u in enumerate(ring.uuids) if u not in late]
        assert ring.load(rest, early) == len(early) - len(fresh - late)
        ring.wait_ring(rest, rest, draining=drained)
        # Out of every ring now, but alive: what only it holds is found there, among the members that left.
        assert ring.connector.check(sorted(late)) == dict.fromkeys(sorted(late), drained)
        fetch_while_draining(ring, drained, only_there)
        assert ring.load(rest) == N - len(late)  # the rest of the ids it won: encoded again on their new replica
        assert {pair for pair in diff(before, ring.holders()) if pair[1] != drained} == \
            {(u, owner(rest, u)) for u in fresh}
        assert ring.load(rest[::-1]) == N  # recovered
        code, log = ring.servers[drained].wait(60)
        assert code == 0, log[-3000:]

        # ---- one is killed: until the endpoints see it, its items go to the next replica ----------------
        killed = max(rest, key=lambda url: sum(owner(rest, u) == url for u in ring.uuids))  # wins the most
        alive = [u for u in rest if u != killed]
        before = ring.holders()
        with ring.endpoints.paused():
            os.killpg(ring.servers[killed].proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
            ring.servers[killed].proc.wait(30)  # type: ignore[union-attr]
            fresh = moved_ids(ring.uuids, rest, alive, killed, before)
            retries = sum(ring.counter(u, "vitserve_replica_retries_total") for u in alive)
            assert ring.load(alive) == N - len(fresh)  # no request fails: each item on the next replica
            assert diff(before, ring.holders()) == {(u, owner(alive, u)) for u in fresh}
            assert sum(ring.counter(u, "vitserve_replica_retries_total") for u in alive) > retries
            assert any(killed in httpx.get(u + "/info").json()["replicas"]["down"] for u in alive)
            found = ring.fetch_all()  # the dead replica is still a member: each id is found on the next
            assert found == {u: owner(alive, u) for u in ring.uuids}
        ring.wait_ring(alive, alive)
        assert ring.load(alive[::-1]) == N  # recovered
        assert ring.fetch_all() == {u: owner(alive, u) for u in ring.uuids}
        home = ring.connector.found["home"]
        ring.fetch_all()
        assert ring.connector.found["home"] == home + N


def moved_ids(uuids: list[str], old: list[str], new: list[str], changed: str, held: dict[str, set[str]]) -> set[str]:
    """The ids a pass must encode again after `changed` joined or left (`old` -> `new` members): those whose
    replica changed, which are exactly the ones `changed` wins, and whose new replica does not hold them."""
    moved = {u for u in uuids if owner(new, u) != owner(old, u)}
    assert moved and moved == {u for u in uuids if changed in (owner(old, u), owner(new, u))}
    return {u for u in moved if owner(new, u) not in held[u]}


def diff(before: dict[str, set[str]], after: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(id, replica) pairs held after and not before."""
    return {(u, url) for u, urls in after.items() for url in urls - before.get(u, set())}


def fetch_while_draining(ring: Ring, drained: str, only_there: set[str]) -> None:
    """Every id is fetched; one that fails was held only by the draining replica, and only once it had gone."""
    for u in ring.uuids:
        try:
            ring.loader.load(u)
        except FetchError:
            assert u in only_there and ring.servers[drained].proc.poll() is not None, u  # type: ignore[union-attr]
