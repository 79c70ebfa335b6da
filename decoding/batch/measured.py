"""Whether a round drafts at all, by what drafting has measured at this many requests.

Why: the joint budget sizes trees by a cost curve of the target's and the draft's forwards, which
leaves out a level's top-k, warp and bookkeeping and the cache work of a tree. On a 2-core CPU at
4 requests that made it draft where one row a request was faster (in process, batched `ar` 524
tok/s against the budget's 433, docs/server.md). Rather than a model of every cost, the engine
times its own rounds: tokens per ms of drafted rounds and of plain rounds (no tree, one row a
request), per number of requests, and drafts while that wins, trying the other now and then. A
count not yet timed takes plain rounds where plain won at fewer requests.

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
    """Every this many rounds at a count, the slower kind once (the load drifts); up to 8x rarer
    as the slower falls behind."""
    alpha: float = 0.2
    """Weight of the newest round in each kind's running rate."""
    max_count: int = 16
    """Request counts from here on share their timings."""
    rate: dict = field(default_factory=dict)
    """(requests, drafted) -> tokens per ms (running mean)."""
    timed: dict = field(default_factory=dict)
    _turn: dict = field(default_factory=dict)

    def drafts(self, n: int, explore: bool = True) -> bool:
        """Does a round of `n` requests draft? `explore` False: the faster kind as timed so far
        (plain before both are), no look at the other: a round whose time is not recorded
        (prompt rows riding in it) would pay for a look and learn nothing."""
        n = min(n, self.max_count)
        if not explore:
            return self._warm(n) and self._faster_drafted(n)
        self._turn[n] = self._turn.get(n, 0) + 1
        if not self._warm(n):
            m = max((m for m in self.rate if m[0] < n and self._warm(m[0])), default=None)
            if m is None or self._faster_drafted(m[0]):  # nothing learnt below: time both kinds here
                a, b = self.timed.get((n, True), 0), self.timed.get((n, False), 0)
                return a <= b  # drafted first, then alternate until both are timed
            # plain won at fewer requests: a round of more gains less from its tree (the weights are
            # read for more rows already), so plain here too until drafting is timed by exploring
            return self._turn[n] % self.explore_every == 0
        best = self._faster_drafted(n)
        hi, lo = sorted((self.rate[(n, True)], self.rate[(n, False)]), reverse=True)
        # the slower kind once every `explore_every` rounds, rarer the further behind it is (a
        # drafted round at 8 requests here took 2.2x a plain one: every 16th cost ~7%)
        every = int(self.explore_every * min(8.0, (hi / lo) ** 2)) if lo > 0 else 8 * self.explore_every
        return best != (self._turn[n] % every == 0)

    def _warm(self, n: int) -> bool:
        return min(self.timed.get((n, True), 0), self.timed.get((n, False), 0)) >= self.warmup

    def _faster_drafted(self, n: int) -> bool:
        return self.rate[(n, True)] >= self.rate[(n, False)]

    def record(self, n: int, drafted: bool, tokens: int, ms: float) -> None:
        """A round of `n` requests, steady (no prompt in it), committed `tokens` in `ms`."""
        if tokens <= 0 or ms <= 0:
            return
        key = (min(n, self.max_count), drafted)
        r = tokens / ms
        self.rate[key] = r if key not in self.rate else (1 - self.alpha) * self.rate[key] + self.alpha * r
        self.timed[key] = self.timed.get(key, 0) + 1
