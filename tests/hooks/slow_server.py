"""`python -m tests.hooks.slow_server [serve flags]`: the server with a slow engine, for tests only.

Every batch waits VITSERVE_TEST_BATCH_DELAY_MS on its engine before it runs, so that work stays in flight
long enough to kill an engine or to drain. Engine processes are spawned: they import this module again
as their main module, so the delay applies there too.
"""

import os
import sys
import time

from service.engine import executor

_delay_s = float(os.environ.get("VITSERVE_TEST_BATCH_DELAY_MS", "0")) / 1000
_start = executor.BatchExecutor.start


def _slow_start(self: executor.BatchExecutor, job: executor.BatchJob) -> executor.Running:
    time.sleep(_delay_s)
    return _start(self, job)


executor.BatchExecutor.start = _slow_start  # type: ignore[method-assign]

if __name__ == "__main__":
    from service.http.server import main

    sys.exit(main())
