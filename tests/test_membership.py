"""The ring of replicas (service.handoff.membership) and how the LLM server's side looks an id up in it
(service.handoff.ec_client): `dns:` sources resolved through `socket.getaddrinfo` (A and AAAA records; a
hosts file the test writes, tests/hooks/hosts.py), a change of members moving only the ids the joining or
leaving replica wins, and lookups that walk an id's rendezvous order over real HTTP replicas on loopback
(stub servers that hold given ids), including one that left and one that does not answer."""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest

from service.handoff import ec_client, membership
from service.handoff.ec_client import CheckIncomplete, FetchError, Replicas
from service.handoff.membership import DnsSource, Membership, parse_source, rendezvous, resolve, url_for
from service.http.peers import Peers, own_url
from service.metrics import Metrics
from tests.hooks import hosts
from tests.http_helpers import QuietHandler, free_port, loopback_http_server, server_url, settings

IDS = [f"vit-{k:064x}" for k in range(600)]
NAME = "vitserve-peers.test"


def test_a_dns_source_names_a_host_and_a_port():
    assert parse_source("dns:vit-peers.inference.svc.cluster.local:8100", 8000) == \
        DnsSource("vit-peers.inference.svc.cluster.local", 8100)
    assert parse_source(" dns:vit-peers. ", 8000) == DnsSource("vit-peers", 8000)
    assert str(parse_source("dns:vit-peers", 9000)) == "dns:vit-peers:9000"
    for bad in ("vit-peers:8000", "dns:", "dns::8000", "dns:vit:http", "dns:vit:0", "dns:vit:70000",
                "dns:http://vit:8000", "dns:[::1]:8000"):
        with pytest.raises(ValueError, match="dns:"):
            parse_source(bad, 8000)


def test_a_name_resolves_to_its_ipv4_and_ipv6_addresses(tmp_path, monkeypatch):
    assert "127.0.0.1" in resolve("localhost", 8000)  # the system's resolver (its hosts file)
    path = str(tmp_path / "hosts")
    hosts.write(path, {NAME: ["127.0.0.3", "fd00:0::1", "127.0.0.2", "::1", "127.0.0.2"]})
    monkeypatch.setattr(socket, "getaddrinfo", hosts.getaddrinfo_from(path))
    assert resolve(NAME, 8000) == sorted(["127.0.0.2", "127.0.0.3", "::1", "fd00::1"])
    ring = Membership(source=DnsSource(NAME, 8100))
    assert ring.refresh() and ring.members == ("http://127.0.0.2:8100", "http://127.0.0.3:8100",
                                               "http://[::1]:8100", "http://[fd00::1]:8100")
    hosts.write(path, {})
    assert ring.refresh() and ring.members == ()  # no ready pod: the name has no address
    assert ring.error is None and ring.changes == 2


class Names:
    """A resolver the test sets: name -> addresses, or an error to raise."""

    def __init__(self, *addresses: str) -> None:
        self.addresses: list[str] | Exception = list(addresses)
        self.calls = 0

    def __call__(self, name: str, port: int) -> list[str]:
        self.calls += 1
        if isinstance(self.addresses, Exception):
            raise self.addresses
        return list(self.addresses)


def test_a_change_of_members_moves_only_the_ids_the_changed_replica_wins():
    names = Names("10.0.0.1", "10.0.0.2", "10.0.0.3")
    ring = Membership(["http://fixed:8000/"], DnsSource("peers", 8000), resolver=names)
    ring.refresh()
    assert ring.members == ("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000",
                            "http://fixed:8000")  # the fixed list and the records, together
    before = {i: ring.order(i)[0] for i in IDS}
    assert min(sum(o == u for o in before.values()) for u in ring.members) > 90  # 150 each on average

    names.addresses = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]  # one joins
    assert ring.refresh()
    joined = "http://10.0.0.4:8000"
    after = {i: ring.order(i)[0] for i in IDS}
    moved = {i for i in IDS if after[i] != before[i]}
    assert moved == {i for i in IDS if after[i] == joined} and len(moved) > 80
    for i in moved:  # the replica that held it is next in the id's order
        assert ring.order(i)[1] == before[i]

    names.addresses = ["10.0.0.1", "10.0.0.3", "10.0.0.4"]  # one leaves
    assert ring.refresh()
    left = "http://10.0.0.2:8000"
    again = {i: ring.order(i)[0] for i in IDS}
    assert {i for i in IDS if again[i] != after[i]} == {i for i in IDS if after[i] == left}
    assert ring.fallbacks(IDS[0]) == [left]  # it still holds what it encoded while it drains
    assert ring.info()["departed"] == [left] and ring.changes == 3

    names.addresses = OSError("the resolver does not answer")
    assert not ring.refresh() and len(ring.members) == 4 and "does not answer" in ring.error
    names.addresses = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    assert not ring.refresh() and len(ring.members) == 4  # no answer is not "no records": members kept
    names.addresses = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert ring.refresh() and ring.members == ("http://fixed:8000",)

    ring.linger_s = 0.0
    time.sleep(0.01)
    assert ring.fallbacks(IDS[0]) == []


def test_the_ring_is_resolved_again_on_a_thread():
    names = Names("10.0.0.1")
    ring = Membership(source=DnsSource("peers", 8000), resolver=names, refresh_s=0.05)
    ring.start()
    try:
        deadline = time.monotonic() + 10
        while ring.members != ("http://10.0.0.1:8000",) and time.monotonic() < deadline:
            time.sleep(0.01)
        names.addresses = ["10.0.0.2"]
        while ring.members != ("http://10.0.0.2:8000",) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ring.members == ("http://10.0.0.2:8000",) and names.calls >= 2
    finally:
        ring.close()


def test_the_fronts_own_address_is_its_pod_ip(monkeypatch):
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert own_url(settings(replicas_from="dns:peers", port=8100)) == "http://10.1.2.3:8100"
    assert own_url(settings(replicas_from="dns:peers:9000", port=8100)) == "http://10.1.2.3:9000"
    monkeypatch.setenv("POD_IP", "fd00::0:7")
    assert own_url(settings(replicas_from="dns:peers", port=8100)) == "http://[fd00::7]:8100"
    assert own_url(settings(replicas_from="dns:peers", advertise_url="http://me:1/")) == "http://me:1"
    monkeypatch.setenv("POD_IP", "not-an-address")
    assert own_url(settings(replicas_from="dns:peers")) is None
    monkeypatch.delenv("POD_IP")
    assert own_url(settings(replicas_from="dns:peers")) is None


def test_the_front_places_an_item_on_the_first_replica_that_answers(monkeypatch):
    monkeypatch.setenv("POD_IP", "10.0.0.1")
    peers = Peers(settings(replicas_from="dns:peers:8000"), Metrics())
    peers.membership.resolver = Names("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4")
    peers.membership.refresh()
    me = "http://10.0.0.1:8000"
    for i in IDS[:100]:
        order = peers.membership.order(i)
        assert peers.place(i, set()) == (None if order[0] == me else order[0])
        tried = set(order[:order.index(me)])  # every peer before this server did not answer
        assert peers.place(i, tried) is None
        others = [u for u in order if u != me]
        assert peers.place(i, set(others[:3])) is None  # MAX_TRIES peers tried: encoded here
    i = next(i for i in IDS if peers.membership.order(i)[:2] == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"])
    peers.down["http://10.0.0.2:8000"] = None  # type: ignore[assignment] - marked down
    assert peers.place(i, set()) == "http://10.0.0.3:8000"


# ---- lookups over HTTP ----------------------------------------------------------------------------------
def body_for(item_id: str) -> bytes:
    header = json.dumps({"__metadata__": {"uuid": item_id}, "ec_cache": {"dtype": "F32", "shape": [1, 2],
                                                                         "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.0, 2.0)


class Holder(QuietHandler):
    """A replica holding the ids in `server.held`."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        ids = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["ids"]
        self.server.asked.append(("check", ids))  # type: ignore[attr-defined]
        self.reply(200, json.dumps({"present": [i in self.server.held for i in ids]}).encode(),  # type: ignore
                   "application/json")

    def do_GET(self) -> None:  # noqa: N802
        item_id = self.path.rsplit("/", 1)[-1]
        self.server.asked.append(("get", item_id))  # type: ignore[attr-defined]
        if item_id in self.server.held:  # type: ignore[attr-defined]
            self.reply(200, body_for(item_id), "application/vnd.safetensors")
        else:
            self.reply(404, b'{"error": {"message": "unknown"}}', "application/json")


def test_a_lookup_walks_the_ids_order_to_the_replica_that_holds_it():
    with loopback_http_server(Holder) as a, loopback_http_server(Holder) as b, loopback_http_server(Holder) as c:
        servers = {server_url(s): s for s in (a, b, c)}
        dead = f"http://127.0.0.1:{free_port()}"  # a member whose pod is gone: nothing listens
        for s in servers.values():
            s.held, s.asked = set(), []  # type: ignore[attr-defined]
        ring = Membership([*servers, dead])
        replicas = Replicas(ring, timeout=5)
        order = {i: ring.order(i) for i in IDS[:40]}
        # each id held by the second replica of its order that is up (its first is another, or the dead one)
        for i, o in order.items():
            servers[[u for u in o if u != dead][1]].held.add(i)  # type: ignore[attr-defined]
        where = replicas.check(list(order))
        assert where == {i: [u for u in o if u != dead][1] for i, o in order.items()}
        for i in list(order)[:10]:
            body, header = replicas.fetch(i)
            assert header["__metadata__"]["uuid"] == i
        assert replicas.found == {"home": 0, "elsewhere": 10, "missing": 0}
        body, header = replicas.fetch(IDS[0], first=where[IDS[0]])  # where the check found it: asked first
        assert servers[where[IDS[0]]].asked[-1] == ("get", IDS[0])  # type: ignore[attr-defined]

        # A replica that left still holds what it encoded: asked after the id's order.
        gone = next(u for u in servers if u != order[IDS[1]][0])
        for s in servers.values():
            s.held.discard(IDS[1])  # type: ignore[attr-defined]
        servers[gone].held.add(IDS[1])  # type: ignore[attr-defined]
        ring._set(sorted(set(ring.members) - {gone}))
        assert replicas.check([IDS[1]]) == {IDS[1]: gone}
        assert replicas.fetch(IDS[1])[1]["__metadata__"]["uuid"] == IDS[1]

        # Nobody holds it: a 404 after the bounded tries (the dead member, marked down, is asked last).
        unknown = "vit-" + "f" * 64
        with pytest.raises(FetchError, match="no vitserve replica holds") as err:
            replicas.fetch(unknown)
        assert err.value.status == 404 and replicas.found["missing"] == 1
        asked = sum(1 for s in servers.values() for kind, i in s.asked if i == unknown)  # type: ignore
        assert asked <= ec_client.MAX_TRIES + 1


def test_a_replica_that_does_not_answer_is_asked_last_for_a_while():
    with loopback_http_server(Holder) as a:
        a.held, a.asked = set(IDS), []  # type: ignore[attr-defined]
        dead = f"http://127.0.0.1:{free_port()}"
        replicas = Replicas([server_url(a), dead], timeout=5)
        first_dead = next(i for i in IDS if replicas.membership.order(i)[0] == dead)
        assert replicas.check([first_dead]) == {first_dead: server_url(a)}  # found: no CheckIncomplete
        assert replicas.candidates(first_dead) == [server_url(a), dead]  # marked down: after the others
        assert replicas.fetch(first_dead)[1]["__metadata__"]["uuid"] == first_dead
        a.held.clear()  # type: ignore[attr-defined]
        with pytest.raises(CheckIncomplete) as err:  # found nowhere, and one replica did not answer
            replicas.check([first_dead])
        assert err.value.found == {first_dead: None}


def test_membership_imports_only_the_standard_library():
    import ast
    import sys

    tree = ast.parse(open(membership.__file__).read())
    imported = {n.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for n in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_rendezvous_is_one_order_for_everyone():
    urls = [url_for(f"10.0.0.{k}", 8000) for k in range(1, 6)]
    for i in IDS[:50]:
        assert rendezvous(urls, i) == rendezvous(reversed(urls + [urls[0] + "/"]), i)


@pytest.mark.cuda
def test_a_gpu_load_reads_into_the_pinned_buffer_from_the_replica_that_holds_it():
    """The worker's GPU path: the body of the replica that answers 200 (not the 404s before it) is read into
    the pinned staging buffer and copied to the device."""
    import torch

    with loopback_http_server(Holder) as a, loopback_http_server(Holder) as b:
        a.held, a.asked, b.held, b.asked = set(), [], set(), []  # type: ignore[attr-defined]
        replicas = Replicas([server_url(a), server_url(b)], timeout=5)
        i = next(i for i in IDS if replicas.membership.order(i)[0] == server_url(a))
        b.held.add(i)  # type: ignore[attr-defined] - the second of its order holds it
        tensor, header = ec_client.Loader(replicas, "cuda:0").load(i)
        assert tensor.device.type == "cuda" and tensor.tolist() == [[1.0, 2.0]]
        assert header["__metadata__"]["uuid"] == i and replicas.found["elsewhere"] == 1
        assert torch.cuda.is_available()
