"""The LLM server's side of the hand-off without vLLM (service.handoff.ec_client): replicas picked by
rendezvous hashing, answers checked before they reach vLLM's encoder cache, a replica that does not answer."""

from __future__ import annotations

import pytest

from service.handoff.ec_client import CheckIncomplete, FetchError, Replicas, check_output, replica_for
from tests.http_helpers import free_port

URLS = [f"http://vitserve-{k}:8100" for k in range(4)]
IDS = [f"vit-{k:064x}" for k in range(400)]


def test_rendezvous_is_stable_spread_and_moves_only_what_it_must():
    picks = {i: replica_for(URLS, i) for i in IDS}
    assert picks == {i: replica_for(list(reversed(URLS)) + [URLS[0] + "/"], i) for i in IDS}  # order, slash
    counts = [sum(p == u for p in picks.values()) for u in URLS]
    assert min(counts) > 60  # 100 each on average
    fewer = URLS[:3]
    for i, url in picks.items():  # a replica gone: only its ids move
        if url != URLS[3]:
            assert replica_for(fewer, i) == url


def header(md: dict[str, str], rows: int = 4) -> dict:
    return {"__metadata__": md, "ec_cache": {"dtype": "BF16", "shape": [rows, 8], "data_offsets": [0, rows * 16]}}


def test_an_answer_is_checked_against_what_was_asked():
    cid = IDS[0]
    check_output(cid, header({"uuid": cid, "content_id": cid}), 4)
    check_output("vit-proxy-id", header({"uuid": "vit-proxy-id", "content_id": cid}), 4)  # a replica's alias
    check_output(cid, header({"content_id": cid}), 4)  # a folder file written before files named their uuid
    check_output("client-id", header({"content_id": cid}), 4)
    with pytest.raises(FetchError, match="with the output of"):
        check_output(cid, header({"uuid": IDS[1]}), 4)
    with pytest.raises(FetchError, match="with the output of"):
        check_output(cid, header({"content_id": IDS[1]}), 4)
    with pytest.raises(FetchError, match="needs 5 rows"):
        check_output(cid, header({"uuid": cid}), 5)


def test_a_replica_that_does_not_answer_holds_none_of_its_ids():
    dead = f"http://127.0.0.1:{free_port()}"
    replicas = Replicas([dead], timeout=2)
    with pytest.raises(CheckIncomplete) as err:
        replicas.check(IDS[:3])
    assert err.value.found == {i: None for i in IDS[:3]}
    with pytest.raises(FetchError):
        replicas.fetch(IDS[0])


def test_a_load_asks_again_a_replica_that_did_not_answer(monkeypatch):
    from service.handoff import ec_client

    calls = []

    def flaky(self, item_id, first=None):
        calls.append(item_id)
        if len(calls) < 3:
            raise FetchError("connection refused")
        return "tensor", {"ec_cache": {}}

    monkeypatch.setattr(ec_client.Loader, "_load", flaky)
    monkeypatch.setattr(ec_client, "RETRY_S", (0, 0, 0))
    loader = ec_client.Loader(Replicas(["http://127.0.0.1:1"]), "cpu")
    assert loader.load(IDS[0])[0] == "tensor" and len(calls) == 3

    def gone(self, item_id, first=None):
        calls.append(item_id)
        raise FetchError("HTTP 404", 404)

    monkeypatch.setattr(ec_client.Loader, "_load", gone)
    calls.clear()
    with pytest.raises(FetchError):
        loader.load(IDS[0])
    assert len(calls) == 1  # an answer is final
