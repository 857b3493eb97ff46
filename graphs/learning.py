"""Budgets learned while serving: the graphs of one more token budget, captured into a runner's pool after
start-up (see `service.engine.batcher`: which sizes, and when)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from graphs.budgets import BudgetPlan, GraphKey
from graphs.packing import CostModel
from graphs.runner import GraphRunner
from graphs.self_check import check_replay, sample_item

log = logging.getLogger("vitserve.graphs")


@dataclass(frozen=True)
class LearnedBudget:
    """What `learn_budget` did: the runner's plan and costs after it (picklable)."""

    budget: int
    ok: bool
    reason: str  # "ok", or why the budget was refused
    plan: BudgetPlan
    cost: CostModel | None
    seconds: float = 0.0


def learn_budget(runner: GraphRunner, budget: int) -> LearnedBudget:
    """Add a budget to a runner while it serves: capture its graphs into the pool, check one replay per modality
    against eager, time a replay into the cost model, then add it to the plan. Everything or nothing: a key that
    fails leaves the plan as it was (its graphs dropped). Call with the device idle (`GraphPool.capture_more`)."""
    start = time.perf_counter()
    if budget in runner.plan.budgets:
        return LearnedBudget(budget, True, "already in the plan", runner.plan, runner.cost)
    if not runner.use_graphs or not runner.pool.graphs:
        return LearnedBudget(budget, False, "this engine serves without graphs", runner.plan, runner.cost)
    plan = runner.plan.with_budget(budget)  # BudgetError past the largest budget: the caller's mistake
    keys = plan.budget_keys(budget, runner.modalities)
    stats = runner.stats.as_dict()
    try:
        failures = runner.pool.capture_more(keys)
        if failures:
            key, why = next(iter(failures.items()))
            raise RuntimeError(f"{len(failures)} of {len(keys)} graphs failed ({key}: {why})")
        old_plan, old_cost, runner.plan = runner.plan, runner.cost, plan
        try:
            for modality in runner.modalities:  # the sample goes to the new budget's graph of its length class
                item = sample_item(runner, modality)
                key = GraphKey(modality, budget, plan.length_class(max(
                    runner.tower.geometry.segment_lengths(item.grid_thw))))
                with torch.inference_mode():
                    reference = runner.eager(item.pixels, [item.grid_thw], modality).joined().clone()
                check_replay(runner, key, item, reference)
            if runner.cost is not None:  # timed as calibrated: packed without costs, so in one replay
                costs, runner.cost = runner.cost, None
                cost = runner.replay_cost(budget)
                replays = sorted({**dict(costs.replays), **({budget: cost} if cost is not None else {})}.items())
                runner.cost = CostModel(tuple(replays), costs.eager)
        except BaseException:
            runner.plan, runner.cost = old_plan, old_cost
            raise
    except Exception as exc:  # noqa: BLE001 - the budget is refused with its reason; serving goes on
        runner.pool.drop(keys)
        runner.stats.reset_to(stats)
        reason = f"{type(exc).__name__}: {exc}"
        log.error("budget %d not learned: %s", budget, reason)
        return LearnedBudget(budget, False, reason, runner.plan, runner.cost, time.perf_counter() - start)
    runner.stats.reset_to(stats)  # the checks and timing are not traffic
    seconds = time.perf_counter() - start
    cost = dict(runner.cost.replays).get(budget) if runner.cost is not None else None
    log.info("budget %d learned: %d graphs in %.2fs%s", budget, len(keys), seconds,
             f", replay {cost * 1e3:.2f} ms" if cost is not None else "")
    return LearnedBudget(budget, True, "ok", runner.plan, runner.cost, seconds)
