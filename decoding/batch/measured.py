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

import statistics
from collections import deque
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
    look_share: float = 0.01
    """Most of the plain rounds' time the looks at drafting may take where plain is faster: a look
    costs its measured wall time above a plain round's (at 4 requests one took ~19 ms against
    5.4 ms, the heads catching up on what they skipped first), so looks come at least that over
    (look_share x a plain round) rounds apart; the rate gap alone spaced them every ~67th round,
    ~4% of the time (in process, 4 clients, 2-core Zen 5; reports/serve-2026-11-29/in-process.md)."""
    max_every: int = 512
    """Rounds at a count after which the slower kind is tried whatever it costs (the load drifts)."""
    decisive: float = 1.5
    """A timed count's winner leading by this rate ratio speaks for the counts not timed yet: they
    try the other kind as rarely as that count does (a tree lost 2.8x at 8 requests here)."""
    rate: dict = field(default_factory=dict)
    """(requests, drafted) -> tokens per ms (running mean)."""
    timed: dict = field(default_factory=dict)
    ms: dict = field(default_factory=dict)
    """(requests, drafted) -> wall ms of its latest rounds."""
    _turn: dict = field(default_factory=dict)
    _ahead: int = 0

    def drafts(self, n: int, explore: bool = True) -> bool:
        """Does a round of `n` requests draft? `explore` False: the faster kind as timed so far
        (plain before both are), no look at the other: a round whose time is not recorded
        (prompt rows riding in it) would pay for a look and learn nothing."""
        n = min(n, self.max_count)
        self._ahead = 0
        if not explore:
            return self._warm(n) and self._faster_drafted(n)
        self._turn[n] = self._turn.get(n, 0) + 1
        if not self._warm(n):
            warm = sorted({m for m, _ in self.rate if self._warm(m)}, key=lambda m: (abs(m - n), m))
            if not warm:  # nothing learnt yet: time both kinds here, drafted first, then alternating
                a, b = self.timed.get((n, True), 0), self.timed.get((n, False), 0)
                return a <= b
            # the nearest timed count's winner until this one is timed too, the other kind tried
            # every `explore_every` rounds, or as rarely as there where the winner leads by
            # `decisive` or more: a count met only while the queue drains (8 requests, then 7,
            # 6, ...), or a fresh server's each count, would otherwise pay a tree's first rounds,
            # heads catching up on whole prompts, at each (33 ms against 8 ms at 8 requests)
            m = warm[0]
            best = self._faster_drafted(m)
            hi, lo = sorted((self.rate[(m, True)], self.rate[(m, False)]), reverse=True)
            every = self._every(m, best) if lo > 0 and hi / lo >= self.decisive else self.explore_every
            return self._choose(n, best, every)
        best = self._faster_drafted(n)
        return self._choose(n, best, self._every(n, best))

    def _choose(self, n: int, best: bool, every: int) -> bool:
        """The faster kind, but the other every `every`-th round at `n` requests."""
        turn = self._turn[n]
        if not best and turn % every:
            self._ahead = every - turn % every - 1
        return best != (turn % every == 0)

    def lookahead(self) -> int:
        """After `drafts` said no: plain rounds that follow before the next look at drafting, while
        the count stays (0: the next may draft; decoding.stopping.StopPolicy.lookahead)."""
        return self._ahead

    def _every(self, n: int, best: bool) -> int:
        """Rounds between two tries of the slower kind at `n` requests: `explore_every`, rarer the
        further behind it is (a drafted round at 8 requests here took 2.2x a plain one: every
        16th cost ~7%), and where drafting is the slower, at least what keeps its looks within
        `look_share` of the time."""
        hi, lo = sorted((self.rate[(n, True)], self.rate[(n, False)]), reverse=True)
        every = int(self.explore_every * min(8.0, (hi / lo) ** 2)) if lo > 0 else 8 * self.explore_every
        if not best and self.ms.get((n, True)) and self.ms.get((n, False)):
            look, plain = statistics.median(self.ms[(n, True)]), statistics.median(self.ms[(n, False)])
            every = max(every, int(max(look - plain, 0.0) / (self.look_share * plain)))
        return max(1, min(every, self.max_every))

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
        self.ms.setdefault(key, deque(maxlen=4 if drafted else 8)).append(ms)
