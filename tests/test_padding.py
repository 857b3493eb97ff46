"""The padding ledger: what graph replays spend on padding, by batch size, and the budgets that would save it
(`/info` padding, `vitserve_replay_tokens_total`). Real servers on loopback, lone requests of real PNGs."""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.engine import padding as padding_module
from service.engine.padding import LOG_EVERY, MIN_REPLAYS, PaddingLedger
from tests.http_helpers import ServerThread, b64, image_bytes, settings

BUDGETS = (64, 128, 256)


def ledger(*batches: tuple[int, int, int]) -> PaddingLedger:
    """(tokens, budget, replays) each."""
    out = PaddingLedger()
    for tokens, budget, n in batches:
        for _ in range(n):
            out.add("image", tokens, budget)
    return out


def test_a_recurring_padded_size_is_suggested_as_a_budget():
    report = ledger((196, 256, 40), (100, 128, 2), (250, 256, 10)).report(BUDGETS)
    # 100 is under the share of replays, 250 pays too little padding
    assert report["suggested_budgets"] == [196]
    assert report["replays"] == 52
    assert report["share"] == pytest.approx((40 * 60 + 2 * 28 + 10 * 6) / (40 * 256 + 2 * 128 + 10 * 256), abs=1e-4)
    assert report["sizes"][0] == {"modality": "image", "tokens": 196, "budget": 256, "replays": 40,
                                  "padding_tokens": 40 * 60}


def test_nothing_is_suggested_from_few_replays_or_below_the_smallest_budget():
    assert ledger((196, 256, MIN_REPLAYS - 1)).report(BUDGETS)["suggested_budgets"] == []
    assert ledger((196, 256, MIN_REPLAYS)).report(BUDGETS)["suggested_budgets"] == [196]
    assert ledger((16, 64, 50)).report(BUDGETS)["suggested_budgets"] == []
    assert ledger().report(BUDGETS) == {"replays": 0, "share": 0.0, "sizes": [], "suggested_budgets": []}


def test_at_most_four_sizes_the_largest_padding_first():
    report = ledger(*((130 + k, 256, 10 + k) for k in range(6))).report(BUDGETS)
    assert report["suggested_budgets"] == [132, 133, 134, 135]


def test_a_new_suggestion_is_said_once():
    ledger_ = ledger((196, 256, LOG_EVERY - 1))
    assert ledger_.new_suggestion(BUDGETS) is None  # only every LOG_EVERY replays
    ledger_.add("image", 196, 256)
    assert ledger_.new_suggestion(BUDGETS) == [196]
    for _ in range(LOG_EVERY):
        ledger_.add("image", 196, 256)
    assert ledger_.new_suggestion(BUDGETS) is None  # the same again


def replay_tokens(metrics_text: str) -> dict[str, float]:
    [family] = [f for f in text_string_to_metric_families(metrics_text) if f.name == "vitserve_replay_tokens"]
    return {s.labels["kind"]: s.value for s in family.samples if s.name.endswith("_total")}


def serve_lone_images(srv: ServerThread, n: int) -> tuple[dict, dict[str, float]]:
    """`n` lone 280x224 images (80 tokens: between the budgets 64 and 128), then two 56x56 (4 tokens)."""
    with srv.client() as c:
        for k in range(n + 2):
            size = (280, 224) if k < n else (56, 56)
            r = c.post("/encode", json={"items": [{"type": "image", "image": b64(image_bytes(*size, seed=k))}]})
            assert r.status_code == 200, r.text
        return c.get("/info").json(), replay_tokens(c.get("/metrics").text)


def test_a_server_names_the_budget_that_ends_its_padding_and_taking_it_ends_it(monkeypatch, caplog):
    """With learning off (`--learn-budgets 0`), the operator is told the budget and gives it at the next start."""
    n = MIN_REPLAYS + 4
    monkeypatch.setattr(padding_module, "LOG_EVERY", n)  # the log's look comes at the last 80-token replay
    with ServerThread(settings(learn_budgets=0)) as srv, caplog.at_level(logging.INFO, "vitserve.engine"):
        info, tokens = serve_lone_images(srv, n)
    [said] = [r.getMessage() for r in caplog.records if "padding" in r.getMessage()]
    assert "batches of 80 tokens recur" in said and "--budgets auto,80" in said
    assert info["budgets"] == [64, 128, 256, 512, 1024]
    padding = info["padding"]
    assert padding["suggested_budgets"] == [80]
    assert padding["sizes"][0] == {"modality": "image", "tokens": 80, "budget": 128, "replays": n,
                                   "padding_tokens": 48 * n}
    assert tokens == {"items": 80 * n + 2 * 4, "padding": 48 * n + 2 * 60}
    assert padding["share"] == pytest.approx(tokens["padding"] / (tokens["items"] + tokens["padding"]), abs=1e-4)

    with ServerThread(settings(budgets="auto,80")) as srv:  # what the first server suggested
        info, tokens = serve_lone_images(srv, n)
    assert info["budgets"] == [64, 80, 128, 256, 512, 1024]
    assert info["padding"]["suggested_budgets"] == []
    assert tokens == {"items": 80 * n + 2 * 4, "padding": 2 * 60}


def test_a_server_learns_a_recurring_size_and_stops_padding_it(monkeypatch, caplog):
    """Learning on (the default): at the look that finds 80-token batches recurring, the engine captures a budget
    of 80 between batches, checks it against eager, and the front packs them into it from then on. The same
    image's embedding is the same bytes before and after."""
    n = MIN_REPLAYS + 4
    monkeypatch.setattr(padding_module, "LOG_EVERY", n)
    body = {"items": [{"type": "image", "image": b64(image_bytes(280, 224, seed=0))}], "encoding_format": "base64"}
    with ServerThread(settings()) as srv, caplog.at_level(logging.INFO, "vitserve"), srv.client() as c:
        first = c.post("/encode", json=body).json()["data"][0]["embedding"]  # in the 128-token graph
        info, tokens = serve_lone_images(srv, n)
        deadline = time.monotonic() + 30
        while info["learned_budgets"]["learned"] != [80] and time.monotonic() < deadline:
            time.sleep(0.05)
            info = c.get("/info").json()
        assert info["learned_budgets"] == {"limit": 4, "learned": [80], "learning": [], "refused": {}}
        assert info["budgets"] == [64, 80, 128, 256, 512, 1024] and info["padding"]["suggested_budgets"] == []
        more, after = serve_lone_images(srv, 6)
        again = c.post("/encode", json=body).json()["data"][0]["embedding"]
    assert after["padding"] == tokens["padding"] + 2 * 60  # the 80-token batches paid no more (the 4-token ones did)
    assert sum(n for key, n in more["pool"]["replays"].items() if key.startswith("image/b80/")) >= 6, more["pool"]
    assert first == again
    said = [r.getMessage() for r in caplog.records]
    assert any("learning them as budgets" in line for line in said)
    assert any("budget 80 is in the plan" in line and "--budgets auto,80" in line for line in said)


def test_an_eager_server_pays_no_padding():
    with ServerThread(settings(eager=True)) as srv:
        info, tokens = serve_lone_images(srv, 2)
    assert info["padding"]["replays"] == 0
    assert tokens == {}
