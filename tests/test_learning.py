"""The front's teaching of learned budgets (`Batcher._learn`): one engine at a time, the plan grows once every
live engine has the budget, a refusal stops it, an engine that exits mid-lesson or comes back is taught again.
Stub engines here (what they capture is tests/test_graphs.py's; real engine processes: tests/test_data_parallel.py
and tests/test_padding.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch

from graphs.learning import LearnedBudget
from graphs.runner import GraphRunner, plan_for
from models import load_tower
from service import shm
from service.engine.batcher import Batcher
from service.engine.types import ModelInfo
from service.metrics import Metrics
from service.settings import ServeSettings


class StubEngine:
    def __init__(self, index: int, model: ModelInfo) -> None:
        self.index, self.device, self.state, self.model = index, "cpu", "ready", model
        self.stats: dict[str, Any] = {}
        self.pid, self.exitcode, self.error, self.threads = 1000 + index, None, None, 0
        self.lessons: list[int] = []

    def attach(self, loop, on_reply, on_exit) -> None:
        self.on_reply, self.on_exit = on_reply, on_exit

    def learn(self, budget: int) -> None:
        self.lessons.append(budget)

    def submit(self, job) -> None:
        raise AssertionError("no batch in these tests")

    def reply(self, budget: int, ok: bool = True, reason: str = "ok", cost: float = 1e-3) -> None:
        model = self.model
        costed = dataclasses.replace(model.cost, replays=tuple(sorted((*model.cost.replays, (budget, cost)))))
        learned = LearnedBudget(budget, ok, reason, model.plan, costed, 0.5)
        self.on_reply(self, ("learned", learned, {"engine": self.index}))


@pytest.fixture(scope="module")
def model() -> ModelInfo:
    tower = load_tower("tiny-qwen2-vl", device="cpu", dtype="float32")
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower, max_batch_tokens=1024), modalities=("image",))
    runner.capture()
    runner.calibrate()
    return ModelInfo.from_runner(runner)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()  # the batcher's: nothing runs on it here (the stubs reply at once)
    yield loop
    loop.close()


def front(loop, model: ModelInfo, engines: int, limit: int = 4) -> tuple[Batcher, list[StubEngine]]:
    settings = ServeSettings(model="tiny-qwen2-vl", device="cpu", learn_budgets=limit)
    batcher = Batcher(settings, Metrics(), shm.SegmentNames(), lambda works: None, lambda engine: None)
    stubs = [StubEngine(i, model) for i in range(engines)]
    batcher.start(loop, stubs, model)
    return batcher, stubs


def test_engines_are_taught_one_at_a_time_and_the_plan_grows_once_all_have_it(loop, model):
    batcher, (a, b) = front(loop, model, 2)
    batcher._learn([80, 196])
    assert (a.lessons, b.lessons) == ([80], [])  # one lesson under way at a time
    a.reply(80)
    assert (a.lessons, b.lessons) == ([80], [80]) and batcher.model.plan.budgets == model.plan.budgets
    assert batcher.learning_report()["learning"] == [80, 196]
    b.reply(80, cost=2e-3)
    assert 80 in batcher.model.plan.budgets and 196 not in batcher.model.plan.budgets
    assert dict(batcher.model.cost.replays)[80] == 1e-3  # the first engine's measured price
    assert a.lessons == [80, 196]
    a.reply(196)
    b.reply(196)
    assert batcher.learning_report() == {"limit": 4, "learned": [80, 196], "learning": [], "refused": {}}
    assert [r["learned_budgets"] for r in batcher.engine_rows()] == [[80, 196], [80, 196]]
    batcher._learn([80, 196, 300])  # known sizes are not taught again; 300 is new
    assert a.lessons == [80, 196, 300]


def test_a_refused_budget_stays_out_of_the_plan_and_is_not_asked_again(loop, model):
    batcher, (a, b) = front(loop, model, 2)
    batcher._learn([80])
    a.reply(80, ok=False, reason="RuntimeError: 1 of 8 graphs failed")
    assert b.lessons == [] and 80 not in batcher.model.plan.budgets
    assert batcher.learning_report()["refused"] == {"80": "RuntimeError: 1 of 8 graphs failed"}
    batcher._learn([80])
    assert a.lessons == [80] and b.lessons == []


def test_at_most_the_limit_and_never_past_the_largest_budget(loop, model):
    batcher, (a,) = front(loop, model, 1, limit=2)
    batcher._learn([80, 96, 112, model.plan.max_budget + 8])
    a.reply(80)
    a.reply(96)
    assert a.lessons == [80, 96] and batcher.learning_report()["learned"] == [80, 96]


def test_an_engine_that_exits_mid_lesson_is_taught_again_when_back(loop, model):
    batcher, (a, b) = front(loop, model, 2)
    batcher._learn([80])
    a.reply(80)
    assert b.lessons == [80]
    b.state, b.exitcode = "down", -9
    batcher._on_exit(b)  # no reply will come: the lesson ends with the process
    assert 80 in batcher.model.plan.budgets  # the live engine has it
    assert [r["learned_budgets"] for r in batcher.engine_rows()] == [[80], []]
    b.state = "ready"
    batcher.attach(b)  # back from its restart: a new process
    assert b.lessons == [80, 80]
    b.reply(80)
    assert [r["learned_budgets"] for r in batcher.engine_rows()] == [[80], [80]]


def test_with_every_engine_down_the_budget_waits_for_one_to_learn_it(loop, model):
    batcher, (a,) = front(loop, model, 1)
    a.state = "down"
    batcher._learn([80])
    assert a.lessons == [] and batcher.learning_report()["learning"] == [80]
    assert 80 not in batcher.model.plan.budgets
    a.state = "ready"
    batcher.attach(a)
    a.reply(80)
    assert 80 in batcher.model.plan.budgets
