"""`python -m tests.hooks.quick_learner [serve flags]`: the server looking at its padding ledger every
VITSERVE_TEST_LEDGER_EVERY replays (not 256), so that a test reaches a learned budget in a few requests."""

import os
import sys

from service.engine import padding

padding.LOG_EVERY = int(os.environ.get("VITSERVE_TEST_LEDGER_EVERY", str(padding.LOG_EVERY)))

if __name__ == "__main__":
    from service.http.server import main

    sys.exit(main())
