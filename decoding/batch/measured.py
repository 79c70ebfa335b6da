"""Whether a round drafts at all, by what drafting has measured at this many requests.

Why: the joint budget sizes trees by a cost curve of the target's and the draft's forwards, which
leaves out a level's top-k, warp and bookkeeping and the cache work of a tree. On a 2-core CPU at
4 requests that made it draft where one row a request was faster (in process, batched `ar` 524
tok/s against the budget's 433, docs/server.md). Rather than a model of every cost, the engine
times its own rounds: tokens per ms of drafted rounds and of plain rounds (no tree, one row a
request), per number of requests, and drafts while that wins, trying the other now and then.

Lossless as any tree policy that looks only at the past: whether this round drafts is decided
before any of its nodes is drawn, from earlier rounds' timings (decoding/batch/budget.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MeasuredChoice:
    warmup: int = 3
    """Rounds of each kind timed at a request count before the faster is preferred."""
    explore_every: int = 16
    """Every this many rounds at a count, the slower kind once (the load drifts)."""
    alpha: float = 0.2
    """Weight of the newest round in each kind's running rate."""
    max_count: int = 16
    """Request counts from here on share their timings."""
    rate: dict = field(default_factory=dict)
    """(requests, drafted) -> tokens per ms (running mean)."""
    timed: dict = field(default_factory=dict)
    _turn: dict = field(default_factory=dict)

    def drafts(self, n: int) -> bool:
        """Does a round of `n` requests draft?"""
        n = min(n, self.max_count)
        a, b = self.timed.get((n, True), 0), self.timed.get((n, False), 0)
        if min(a, b) < self.warmup:
            return a <= b  # drafted first, then alternate until both are timed
        self._turn[n] = self._turn.get(n, 0) + 1
        best = self.rate[(n, True)] >= self.rate[(n, False)]
        return best != (self._turn[n] % self.explore_every == 0)

    def record(self, n: int, drafted: bool, tokens: int, ms: float) -> None:
        """A round of `n` requests, steady (no prompt in it), committed `tokens` in `ms`."""
        if tokens <= 0 or ms <= 0:
            return
        key = (min(n, self.max_count), drafted)
        r = tokens / ms
        self.rate[key] = r if key not in self.rate else (1 - self.alpha) * self.rate[key] + self.alpha * r
        self.timed[key] = self.timed.get(key, 0) + 1
