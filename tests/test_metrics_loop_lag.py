"""The event loop's lag: a loop held by other work shows in vitserve_event_loop_lag_seconds."""

from __future__ import annotations

import asyncio
import time

from service.metrics import Metrics, watch_event_loop


def test_a_blocked_loop_shows_as_lag():
    metrics = Metrics()

    async def main() -> None:
        watch = asyncio.create_task(watch_event_loop(metrics.loop_lag_seconds, period_s=0.02))
        await asyncio.sleep(0.1)  # a few samples of an idle loop
        time.sleep(0.3)  # work holding the loop: the watcher's next wake-up comes late
        await asyncio.sleep(0.05)
        watch.cancel()

    asyncio.run(main())
    registry = metrics.registry
    count = registry.get_sample_value("vitserve_event_loop_lag_seconds_count")
    total = registry.get_sample_value("vitserve_event_loop_lag_seconds_sum")
    late = count - registry.get_sample_value("vitserve_event_loop_lag_seconds_bucket", {"le": "0.25"})
    assert count >= 3 and late >= 1  # the sample taken across the held loop
    assert 0.25 < total < 0.3 + 0.1 * count
