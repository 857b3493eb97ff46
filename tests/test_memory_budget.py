"""`--gpu-memory` on the CPU: how the setting reads, and which budgets a server keeps when captures under
the cap run out of memory (the GPU side is tests/test_cuda_memory.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from graphs.budgets import BudgetPlan, GraphKey
from service.engine.loading import _budgets_that_fit
from service.engine.memory import MemoryBudgetError, out_of_memory, parse_memory

OOM = "OutOfMemoryError: CUDA out of memory. Tried to allocate 40.00 MiB."


@pytest.mark.parametrize("text, expected", [
    ("0.5", (0.5, None)), ("1", (1.0, None)), ("4GiB", (None, 4 * 2**30)), ("4096 MiB", (None, 4 * 2**30)),
    ("4000000000", (None, 4_000_000_000)), ("2gb", (None, 2_000_000_000)), (None, (None, None)),
])
def test_the_setting_is_a_fraction_or_bytes(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["0", "-1GiB", "4 parsecs", "GiB", "half"])
def test_a_setting_that_is_neither_is_refused_with_the_forms_it_takes(text):
    with pytest.raises(ValueError, match="--gpu-memory"):
        parse_memory(text)


def runner_with(failed: dict[GraphKey, str], budgets: list[int]) -> SimpleNamespace:
    plan = BudgetPlan.create(max_batch_tokens=budgets[-1], budgets=budgets)
    return SimpleNamespace(pool=SimpleNamespace(failed=failed), plan=plan)


def test_every_capture_fitting_keeps_the_plan():
    assert _budgets_that_fit(runner_with({}, [256, 1024, 4096]), "4GiB") is None
    other = {GraphKey("image", 4096, 16384): "RuntimeError: something else"}  # served eagerly, not a size matter
    assert _budgets_that_fit(runner_with(other, [256, 1024, 4096]), "4GiB") is None
    assert out_of_memory(OOM) and not out_of_memory("RuntimeError: something else")


def test_budgets_below_the_smallest_that_ran_out_of_memory_are_kept():
    failed = {GraphKey("image", 4096, 16384): OOM, GraphKey("video", 2048, 64): OOM}
    assert _budgets_that_fit(runner_with(failed, [256, 1024, 2048, 4096]), "4GiB") == [256, 1024]


def test_nothing_left_below_the_failures_refuses_with_the_keys_and_what_to_change():
    failed = {GraphKey("image", b, 64): OOM for b in (256, 1024)}
    with pytest.raises(MemoryBudgetError, match=r"--gpu-memory 4GiB: 2 graph\(s\) did not fit .*image/b256/L64.*"
                                                r"raise --gpu-memory"):
        _budgets_that_fit(runner_with(failed, [256, 1024]), "4GiB")
