"""Which vitserve replicas make up one encoder cache, and in what order an id asks them. Standard library only:
vLLM's connector (`vllm_connector`, through `ec_client`) uses it inside vLLM's processes, and the OpenAI
front (`service.http.peers`) the same way, so both sides see the same ring.

Members come from two sources, together:
- a fixed list of URLs (`--replicas`, the connector's `url` / `urls`);
- `dns:NAME[:PORT]` (`--replicas-from`, the connector's `replicas_from`): the A and AAAA records of NAME,
  resolved again every REFRESH_S seconds, each address a member at `http://ADDRESS:PORT`. On Kubernetes NAME
  is a headless Service that publishes ready pods only: a pod joins the ring when its readiness probe
  passes, and leaves it when it drains (its /ready turns 503) or goes away.

An id's members are ordered by rendezvous hashing (the highest hash of (URL, id) first): every process
with the same members orders them alike without talking to the others, and a member that joins or leaves
moves only the ids it wins. A member that left stays a fallback for LINGER_S seconds (`fallbacks`): what
it encoded before it left is still held there while it drains.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vitserve.membership")

DNS_PREFIX = "dns:"
REFRESH_S = 3.0  # how often a dns: source is resolved again
LINGER_S = 120.0  # how long a member that left stays a fallback (vitserve's default --cache-hold-s)
STALE_S = 1.0  # a lookup that found nothing resolves again when the last resolution is older than this
# Resolver errors that mean "no such records" (every pod not ready: the name has no address), not "no answer".
_NO_RECORDS = {socket.EAI_NONAME, *(getattr(socket, n) for n in ("EAI_NODATA", "EAI_ADDRFAMILY") if hasattr(socket, n))}

Resolver = Callable[[str, int], Sequence[str]]


def normalise(url: str) -> str:
    return url.strip().rstrip("/")


def _score(url: str, item_id: str) -> bytes:
    return hashlib.blake2b(f"{url}\0{item_id}".encode(), digest_size=8).digest()


def rendezvous(urls: Iterable[str], item_id: str) -> list[str]:
    """`urls` in `item_id`'s order: the highest hash of (URL, id) first."""
    return sorted({normalise(u) for u in urls}, key=lambda u: _score(u, item_id), reverse=True)


def replica_for(urls: Sequence[str], item_id: str) -> str:
    """The replica that holds `item_id`: the first of its order."""
    if len(urls) == 1:
        return normalise(urls[0])
    return rendezvous(urls, item_id)[0]


@dataclass(frozen=True)
class DnsSource:
    """`dns:NAME[:PORT]`: the replicas are NAME's addresses, each at PORT."""

    name: str
    port: int
    scheme: str = "http"

    def __str__(self) -> str:
        return f"{DNS_PREFIX}{self.name}:{self.port}"


def parse_source(spec: str, default_port: int) -> DnsSource:
    """`dns:NAME` or `dns:NAME:PORT` (PORT defaults to `default_port`); ValueError names what is wrong."""
    text = spec.strip()
    if not text.startswith(DNS_PREFIX):
        raise ValueError(f"{spec!r}: expected dns:NAME[:PORT] (a headless Service's name)")
    name, _, port = text[len(DNS_PREFIX):].partition(":")
    name = name.strip().rstrip(".")
    if not name or any(c in name for c in "/[] @"):
        raise ValueError(f"{spec!r}: expected dns:NAME[:PORT] with a host name")
    if not port:
        return DnsSource(name, default_port)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{spec!r}: the port must be a number from 1 to 65535")
    return DnsSource(name, int(port))


def resolve(name: str, port: int) -> list[str]:
    """NAME's IPv4 and IPv6 addresses (A and AAAA records, or the hosts file), through the system's resolver."""
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({canonical_address(sockaddr[0]) for _, _, _, _, sockaddr in infos})


def canonical_address(address: str) -> str:
    """One spelling per address (IPv6 compressed, no zone), so that the same member is the same URL."""
    return ipaddress.ip_address(address.split("%", 1)[0]).compressed


def url_for(address: str, port: int, scheme: str = "http") -> str:
    address = canonical_address(address)
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


class Membership:
    """The members of the ring, re-resolved by a thread (`start`) when a dns: source is given."""

    def __init__(self, static: Iterable[str] = (), source: DnsSource | None = None, resolver: Resolver = resolve,
                 refresh_s: float = REFRESH_S, linger_s: float = LINGER_S) -> None:
        self.static = tuple(sorted({normalise(u) for u in static if normalise(u)}))
        self.source = source
        self.resolver = resolver
        self.refresh_s = refresh_s
        self.linger_s = linger_s
        self.changes = 0  # how often the members changed since the start
        self.error: str | None = None  # the last resolution's error, None once one succeeds
        self.resolved_at: float | None = None  # time.monotonic() of the last successful resolution
        self._members: tuple[str, ...] = self.static
        self._departed: dict[str, float] = {}  # member that left -> when
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def members(self) -> tuple[str, ...]:
        return self._members

    def order(self, item_id: str) -> list[str]:
        """The members in `item_id`'s rendezvous order."""
        return rendezvous(self._members, item_id)

    def fallbacks(self, item_id: str) -> list[str]:
        """Members that left less than LINGER_S ago, in `item_id`'s order: they may still hold its output."""
        now = time.monotonic()
        with self._lock:
            for url in [u for u, when in self._departed.items() if now - when > self.linger_s]:
                del self._departed[url]
            departed = list(self._departed)
        return rendezvous(departed, item_id)

    # ---- resolution -------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Resolve the source again; True when the members changed. A resolver that does not answer keeps the
        members it gave last; a name without records (no pod ready) leaves the fixed list alone."""
        if self.source is None:
            return False
        try:
            addresses = list(self.resolver(self.source.name, self.source.port))
        except socket.gaierror as exc:
            if exc.errno not in _NO_RECORDS:
                return self._failed(f"{self.source}: {exc}")
            addresses = []
        except OSError as exc:
            return self._failed(f"{self.source}: {exc}")
        found = {url_for(a, self.source.port, self.source.scheme) for a in addresses}
        return self._set(sorted(found | set(self.static)))

    def refresh_if_stale(self) -> bool:
        """`refresh` unless the last resolution is recent: for a lookup that found nothing where it asked."""
        if self.source is None or (self.resolved_at is not None and time.monotonic() - self.resolved_at < STALE_S):
            return False
        return self.refresh()

    def _failed(self, message: str) -> bool:
        if message != self.error:
            log.warning("replicas: cannot resolve %s; keeping the %d member(s) known", message, len(self._members))
        self.error = message
        return False

    def _set(self, members: list[str]) -> bool:
        now = time.monotonic()
        with self._lock:
            self.error, self.resolved_at = None, now
            before = set(self._members)
            if before == set(members):
                return False
            for url in before - set(members):
                self._departed[url] = now
            for url in members:
                self._departed.pop(url, None)
            self._members = tuple(members)
            self.changes += 1
        joined, left = sorted(set(members) - before), sorted(before - set(members))
        log.info("replicas: %d member(s)%s%s", len(members), f", joined {', '.join(joined)}" if joined else "",
                 f", left {', '.join(left)}" if left else "")
        return True

    def start(self) -> None:
        """Resolve every `refresh_s` seconds on a thread (a resolver may block), at once unless resolved already."""
        if self.source is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="vitserve-membership", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        delay = 0.0 if self.resolved_at is None else self.refresh_s  # resolved already: by the caller
        while not self._stop.wait(delay):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a resolver's bug must not end the ring's updates
                log.exception("replicas: resolving %s failed", self.source)
            delay = self.refresh_s

    def close(self) -> None:
        self._stop.set()

    def info(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            departed = sorted(u for u, when in self._departed.items() if now - when <= self.linger_s)
        return {"source": str(self.source) if self.source else None, "static": list(self.static),
                "members": list(self._members), "departed": departed, "changes": self.changes,
                "resolved_s_ago": None if self.resolved_at is None else round(now - self.resolved_at, 3),
                "error": self.error}
