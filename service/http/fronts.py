"""Several HTTP front processes on one port (`--fronts`): one per engine, so that parsing, response
writing and the event loop's other work use as many cores as there are engines.

The supervisor (the process `vitserve serve` started; `server.run_fronts`) binds the port, starts one
front process per engine and waits. Each front listens on its own socket of the port (SO_REUSEPORT,
`preflight.bind`), and the kernel spreads new connections evenly over them by their addresses: a
client's keep-alive connections stay with the front they reached, so an uneven split would leave one
engine short of work for as long as they last. Each front is a whole server (its own engine, worker
processes and bounds, see `ServeSettings.for_front`) and also listens on a private Unix socket,
through which a front answering GET /metrics reads its siblings' series (a scrape of the shared port
sees the whole server, each series labelled with its `front`), and GET /ready asks theirs (the
server is ready once every front is).

Signals: SIGTERM and SIGINT to the supervisor are passed on to every front, which handles them as a
lone server does (`server.DrainingServer`): the first drains, a second ends the drain (SIGINT, a
second Ctrl-C: at once). Fronts sit in their own process group, so that Ctrl-C reaches them only
through the supervisor, once. A front that exits on its own (its engine failed) stops the others,
and the supervisor exits 1. Fronts exit if the supervisor dies.
"""
from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

SIBLING_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class FrontRole:
    """This process's place among the fronts: its index, how many there are, and where each listens
    privately (the Unix sockets, by index)."""

    index: int
    count: int
    sockets: tuple[str, ...] = field(default=())

    @property
    def siblings(self) -> list[tuple[int, str]]:
        return [(i, path) for i, path in enumerate(self.sockets) if i != self.index]


def unix_socket_paths(folder: str, count: int) -> tuple[str, ...]:
    return tuple(str(Path(folder) / f"front-{i}.sock") for i in range(count))


def bind_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


# ---- /metrics across fronts --------------------------------------------------------------------
async def ask_siblings(role: FrontRole, path: str) -> list[tuple[str, Any]]:
    """(front, httpx response) of GET `path`?scope=front on every sibling; None where none came in time."""
    import httpx

    async def one(index: int, socket_path: str) -> tuple[str, Any]:
        try:
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path),
                                         timeout=SIBLING_TIMEOUT_S) as client:
                return str(index), await client.get(f"http://front{path}", params={"scope": "front"})
        except (httpx.HTTPError, OSError):
            return str(index), None

    return list(await asyncio.gather(*(one(i, p) for i, p in role.siblings)))


def merge_expositions(parts: Iterable[tuple[str, str]]) -> bytes:
    """Prometheus texts of several fronts as one, each sample labelled with its `front`."""
    families: dict[str, Metric] = {}
    for front, text in parts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                merged.add_sample(s.name, {"front": front, **s.labels}, s.value, s.timestamp, s.exemplar)

    class _Merged:
        def collect(self) -> Iterable[Metric]:
            return families.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())  # type: ignore[arg-type]
    return generate_latest(registry)
