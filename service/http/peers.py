"""The other vitserve replicas, as this server sees them (`--replicas`, `--replicas-from`): the ring
(`service.handoff.membership`, the same as vLLM's connector resolves), this server's own URL in it, and the
peers that do not answer.

The OpenAI front places each item on the first replica of its content id's rendezvous order: this server's
own items are encoded in process, the others through that replica's `POST /encode` (vllm_ref, the content
id as the item's id), so the connector, which asks the same order, finds the output there. A replica that
does not answer (connection refused or reset, or 503: it drains or starts) is marked down until its /ready
answers 200 again (asked every PROBE_S), and its items go to the next replica in their order: at most
MAX_TRIES peers, then this server encodes them. An item whose replica changed (a member joined or left) is
not in its new replica's cache yet: it is encoded again there.

A draining server has left the ring (its /ready is 503, so DNS drops it) but still holds what it encoded:
`linger` keeps it answering the LLM server's fetches until they have been quiet for QUIET_S.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import httpx
import pybase64
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from service.handoff.membership import REFRESH_S, Membership, normalise, parse_source, url_for
from service.http.errors import ApiError
from service.metrics import Metrics
from service.settings import ServeSettings

log = logging.getLogger("vitserve.peers")

PROBE_S = 1.0  # how often a peer marked down is asked for /ready
MAX_TRIES = 3  # peers an item is sent to, in its order, before this server encodes it
CONNECT_TIMEOUT_S = 2.0  # a gone pod's address may not refuse: it stops answering
QUIET_S = 2 * REFRESH_S  # a draining server stops once no fetch came for this long (peers re-resolved twice)
FOUND = ("here", "peer", "encoded")


class ReplicaUnavailable(Exception):
    """A peer did not answer, or answered that it serves nothing now (503)."""


def own_url(settings: ServeSettings) -> str | None:
    """This server's URL in the ring: --advertise-url, else http://$POD_IP at the dns: source's port."""
    if settings.advertise_url:
        return normalise(settings.advertise_url)
    pod_ip = os.environ.get("POD_IP", "").strip()
    if not (settings.replicas_from and pod_ip):
        return None
    try:
        return url_for(pod_ip, parse_source(settings.replicas_from, settings.port).port)
    except ValueError:
        log.warning("POD_IP %r is not an IP address: this server's own items go over HTTP too", pod_ip)
        return None


class Peers:
    def __init__(self, settings: ServeSettings, metrics: Metrics) -> None:
        source = parse_source(settings.replicas_from, settings.port) if settings.replicas_from else None
        self.membership = Membership(settings.replicas, source)
        self.me = own_url(settings)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(settings.request_timeout_s, connect=CONNECT_TIMEOUT_S),
                                        trust_env=False,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.down: dict[str, asyncio.Task[None]] = {}
        self.found = dict.fromkeys(FOUND, 0)  # items of the front's requests, by where their output was found
        self.forwards = 0  # items sent to a peer's /encode
        self.retries = 0  # items sent on to the next replica because theirs did not answer
        self.last_fetch = 0.0  # time.monotonic() of the last encoder-cache request
        self.drain_started: float | None = None
        metrics.registry.register(PeersCollector(self))

    def start(self) -> None:
        self.membership.start()
        if self.membership.source is not None and self.me is None:
            log.warning("--replicas-from without POD_IP or --advertise-url: this server does not know its own "
                        "address in the ring, so its own items go over HTTP too")

    async def close(self) -> None:
        self.membership.close()
        for task in list(self.down.values()):
            task.cancel()
        await self.client.aclose()

    # ---- placing items ---------------------------------------------------------------------------
    def place(self, content_id: str, tried: set[str]) -> str | None:
        """The replica to encode `content_id` on, None for this server: the first of the id's order that is
        neither tried nor down; this server once MAX_TRIES peers were tried, or when it comes first."""
        if len(tried) >= MAX_TRIES:
            return None
        for url in self.membership.order(content_id):
            if url == self.me:
                return None
            if url not in tried and url not in self.down:
                return url
        return None

    async def encode(self, url: str, items: list[Any], authorization: str | None) -> tuple[list[dict[str, Any]], int]:
        """The items' parts as the replica at `url` encodes them (vllm_ref, each item's id its content id), and
        how many it found in its cache. ReplicaUnavailable when it does not answer or serves nothing now."""
        body = {"encoding_format": "vllm_ref", "items": [
            {"type": it.modality, it.modality: pybase64.b64encode(it.data).decode(), "id": it.id, **it.options}
            for it in items]}
        headers = {"authorization": authorization} if authorization else {}
        try:
            r = await self.client.post(url + "/encode", json=body, headers=headers)
        except httpx.TransportError as exc:
            raise ReplicaUnavailable(f"{type(exc).__name__}: {exc}") from None
        if r.status_code == 503:
            raise ReplicaUnavailable(f"HTTP 503: {r.text[:200]}")
        if r.status_code != 200:
            try:
                err = r.json()["error"]
            except (ValueError, KeyError, TypeError):
                err = {"message": r.text[:500], "type": "replica_error", "code": None}
            raise ApiError(r.status_code, err.get("type") or "replica_error", f"replica {url}: {err.get('message')}",
                           err.get("code"))
        self.forwards += len(items)
        hits = int(r.headers.get("x-vitserve-cache-hits", 0))
        self.count(peer=hits, encoded=len(items) - hits)
        return [e["content_part"] for e in r.json()["data"]], hits

    def count(self, **found: int) -> None:
        for where, n in found.items():
            self.found[where] += n

    def mark_down(self, url: str, reason: str, items: int) -> None:
        """`url` did not answer for `items` items, sent on to their next replicas: skip it until it is ready."""
        self.retries += items
        if url in self.down:
            return
        log.warning("replica %s did not answer (%s): its items go to the next replicas until its /ready answers",
                    url, reason)
        self.down[url] = asyncio.ensure_future(self._probe(url))

    async def _probe(self, url: str) -> None:
        try:
            while url in self.membership.members:  # one that left the ring needs no probe
                await asyncio.sleep(PROBE_S)
                try:
                    if (await self.client.get(url + "/ready", timeout=CONNECT_TIMEOUT_S)).status_code == 200:
                        log.info("replica %s is ready again", url)
                        return
                except httpx.HTTPError:
                    pass
        finally:
            self.down.pop(url, None)

    # ---- draining --------------------------------------------------------------------------------
    def fetched(self) -> None:
        """An encoder-cache request came (a check or a fetch)."""
        self.last_fetch = time.monotonic()

    async def linger(self, deadline: float) -> None:
        """While draining, after the last request in flight: keep serving the LLM server's fetches of what this
        server holds until none came for QUIET_S (counted from the drain's start at the earliest), or until
        `deadline` (time.monotonic())."""
        if self.drain_started is None:
            self.drain_started = time.monotonic()
            log.info("draining: out of the ring; serving encoder-cache fetches until they stop for %.0f s", QUIET_S)
        while (now := time.monotonic()) < deadline:
            if now - max(self.last_fetch, self.drain_started) >= QUIET_S:
                return
            await asyncio.sleep(0.1)

    def info(self) -> dict[str, Any]:
        return {"self": self.me, **self.membership.info(), "down": sorted(self.down), "found": dict(self.found),
                "forwards": self.forwards, "retries": self.retries}


class PeersCollector(Collector):
    """The ring as this server sees it, and where the front's items were found, read at scrape time."""

    def __init__(self, peers: Peers) -> None:
        self.peers = peers

    def collect(self) -> Iterable[Any]:
        p = self.peers
        members = GaugeMetricFamily("vitserve_replica_members", "Replicas in the ring this server sees (itself "
                                    "included once ready)")
        members.add_metric([], len(p.membership.members))
        down = GaugeMetricFamily("vitserve_replica_down", "Peers marked down (no answer) until their /ready answers")
        down.add_metric([], len(p.down))
        found = CounterMetricFamily("vitserve_replica_items", "Items of chat requests by where their output was "
                                    "found: here (this server's cache), peer (the cache of the replica the id "
                                    "picks), encoded (in no cache: encoded here or on that replica)",
                                    labels=["found"])
        for where in FOUND:
            found.add_metric([where], p.found[where])
        forwards = CounterMetricFamily("vitserve_replica_forwards", "Items sent to the replica their id picks")
        forwards.add_metric([], p.forwards)
        retries = CounterMetricFamily("vitserve_replica_retries", "Items sent on to the next replica in their "
                                      "order because theirs did not answer")
        retries.add_metric([], p.retries)
        changes = CounterMetricFamily("vitserve_replica_membership_changes", "Times the ring's members changed")
        changes.add_metric([], p.membership.changes)
        yield from (members, down, found, forwards, retries, changes)
