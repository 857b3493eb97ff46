"""What graph replays spend on padding, and the budgets that would save it.

A replay costs its whole budget whatever the batch holds: a lone 448x448 image of the Qwen3 line (196 tokens)
replays in the 256-token graph of the default power-of-two ladder, 1.2x the time a graph of its own 196 tokens
takes (docs/performance.md). Traffic whose batches keep the same size (a sidecar's lone requests, a client
that always sends the same images) pays that on every batch; `--budgets auto,196` gives the size a graph of
its own. The ledger counts, per batch size, the replays and the padding they carried, and names the sizes
worth a budget: those that recur and pay much padding.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

MAX_SIZES = 4096  # distinct (modality, tokens, budget) kept; later new ones count only in the totals
MIN_REPLAYS = 20  # below this many replays nothing is suggested: too little to tell a pattern
SIZE_SHARE = 0.05  # a suggested size is at least this share of the replays...
PADDING_SHARE = 0.10  # ...and its budget at least this share padding
MAX_SUGGESTED = 4
TOP_SIZES = 8  # sizes shown, those that paid the most padding
LOG_EVERY = 256  # replays between looks at whether the suggestion changed (for the log)


class PaddingLedger:
    """Replayed batches by (modality, tokens): how many, in which budget. One per front, on its event loop."""

    def __init__(self) -> None:
        self.replays: Counter[tuple[str, int, int]] = Counter()  # (modality, tokens, budget) -> replays
        self.replayed = 0
        self.item_tokens = 0
        self.padding_tokens = 0
        self._said: list[int] = []  # the suggestion last logged

    def add(self, modality: str, tokens: int, budget: int) -> None:
        self.replayed += 1
        self.item_tokens += tokens
        self.padding_tokens += budget - tokens
        key = (modality, tokens, budget)
        if key in self.replays or len(self.replays) < MAX_SIZES:
            self.replays[key] += 1

    def suggested_budgets(self, budgets: tuple[int, ...]) -> list[int]:
        """Batch sizes that make at least `SIZE_SHARE` of the replays and pay at least `PADDING_SHARE` of their
        budget in padding: the `MAX_SUGGESTED` that paid the most, ascending, none already in `budgets`. Not below
        the smallest budget: there a replay costs its launches more than its tokens (the packing's cost model
        prices all such batches alike)."""
        if self.replayed < MIN_REPLAYS:
            return []
        wanted: Counter[int] = Counter()
        for (_, tokens, budget), n in self.replays.items():
            recurs = n >= SIZE_SHARE * self.replayed and budget - tokens >= PADDING_SHARE * budget
            if recurs and tokens > budgets[0] and tokens not in budgets:
                wanted[tokens] += n * (budget - tokens)
        return sorted(tokens for tokens, _ in wanted.most_common(MAX_SUGGESTED))

    @property
    def share(self) -> float:
        """Of the tokens the replays ran, the share that was padding."""
        spent = self.item_tokens + self.padding_tokens
        return self.padding_tokens / spent if spent else 0.0

    def new_suggestion(self, budgets: tuple[int, ...]) -> list[int] | None:
        """Every `LOG_EVERY` replays: the suggested budgets if they changed since last said (to log), else None."""
        if self.replayed % LOG_EVERY:
            return None
        sizes = self.suggested_budgets(budgets)
        if not sizes or sizes == self._said:
            return None
        self._said = sizes
        return sizes

    def report(self, budgets: tuple[int, ...]) -> dict[str, Any]:
        """For /info: the padding's share of the replayed budgets, the sizes that paid the most of it, and
        the budgets worth adding (`--budgets auto,...`, or to the list given)."""
        top = sorted(self.replays.items(), key=lambda kv: -kv[1] * (kv[0][2] - kv[0][1]))[:TOP_SIZES]
        return {
            "replays": self.replayed,
            "share": round(self.share, 4),
            "sizes": [{"modality": m, "tokens": t, "budget": b, "replays": n, "padding_tokens": n * (b - t)}
                      for (m, t, b), n in top],
            "suggested_budgets": self.suggested_budgets(budgets),
        }
