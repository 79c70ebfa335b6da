"""How many prompt tokens a filling request feeds this round, by measured time.

Why: a chunk rides in the running requests' verify forward, so each of its rows delays their
next tokens; and a row's cost grows with the prompt's cached part (its attention reads every
cached key), so no fixed chunk keeps that delay bounded through a long prompt. `ChunkSizer`
times the rounds instead: the recent wall time of rounds with no prompt rows (the base, per number
of running requests) and the marginal time of a prompt row in rounds with them, and sizes the
next chunk so that a round carrying it takes about `stall` times the base. With no request
running, nobody waits between tokens: the chunk is `hi`.

Pure bookkeeping on the times it is given (the scheduler times its rounds): the chunk only
decides when prompt rows go in, never what any request commits.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass, field


@dataclass
class ChunkSizer:
    stall: float = 1.5
    """A round carrying prompt rows aims at most this many times a round without. Not 2: the
    same round repeated varies by ~1.4x at p99 on a shared 2-core machine by itself (the noise
    floor in reports/prefill-stall-2026-11-29), so an aim of 2 put the streams' p99 well past 2x."""
    lo: int = 1
    """Fewest rows a filling request feeds a round beside running requests (progress). One: at
    2,000 cached tokens a row's attention alone costs ~2 ms over 30 layers, half a base round."""
    hi: int = 512
    """Most rows a round; what a request gets when no other is running."""
    whole: int = 256
    """A prompt of at most this many tokens goes in whole, in one round: chunking a chat turn
    delays that request's first token by several rounds, and with clients waiting on their turns
    that cost 9% of the tokens served at 4 clients (reports/serve-2026-11-29/in-process.md);
    vLLM's and SGLang's step budgets (2,048+ tokens) let such prompts in whole too. The stalls
    chunking is for are longer prompts' (a 2,000-token prompt: 1.4 s)."""
    first: int = 4
    """The chunk before a row's cost has been measured (then at most `grow` times more a round)."""
    grow: float = 2.0
    """A chunk at most this many times the previous one beside running requests: one noisy,
    cheap-looking round cannot buy a huge chunk."""
    window: int = 8
    """Rounds without prompt rows whose median is the base."""
    alpha: float = 0.3
    """Weight of the newest round in the running ms per row (it follows the growing context)."""
    probe_every: int = 8
    """With no base at this many running requests, every this many rounds the filling requests
    sit one out (a chunk of 0), so that a round without prompt rows is timed."""
    max_count: int = 16
    """Running-request counts from here on share their base."""
    base: dict = field(default_factory=dict)
    """Running requests -> wall ms of the latest rounds without prompt rows."""
    ms_per_row: float | None = None
    """Running marginal ms of one prompt row (None: not measured yet)."""
    _last: int = 0
    _waited: int = 0

    def __post_init__(self) -> None:
        if not 1 < self.stall < math.inf:
            raise ValueError(f"the prefill stall must be a number > 1 (got {self.stall})")
        if self.whole < 0:
            raise ValueError(f"the whole-prompt bound must be >= 0 (got {self.whole})")
        if not 1 <= self.lo <= self.first <= self.hi:
            raise ValueError(f"chunk bounds must be 1 <= lo <= first <= hi (got {self.lo}, {self.first}, {self.hi})")

    def size(self, running: int) -> int:
        """Rows a filling request feeds the next round, beside `running` requests decoding."""
        if running == 0:
            return self.hi
        base = self._base(running)
        if base is None or self.ms_per_row is None:
            if base is None:
                self._waited += 1
                if self._waited % self.probe_every == 1:
                    return 0
            n = self.first
        else:
            n = math.floor((self.stall - 1) * base / max(self.ms_per_row, 1e-6))
        n = max(self.lo, min(self.hi, n, math.floor(self.grow * (self._last or self.first))))
        self._last = n
        return n

    def record(self, ms: float, rows: int, running: int) -> None:
        """A round of `running` decoding requests took `ms` with `rows` prompt rows in it."""
        if running == 0 or not ms > 0:
            return  # nobody waited on it
        key = min(running, self.max_count)
        if rows == 0:
            self.base.setdefault(key, collections.deque(maxlen=self.window)).append(ms)
            self._waited = 0
            return
        base = self._base(running)
        if base is None:
            return
        per = max(ms - base, 0.0) / rows
        self.ms_per_row = per if self.ms_per_row is None else (1 - self.alpha) * self.ms_per_row + self.alpha * per

    def _base(self, running: int) -> float | None:
        times = self.base.get(min(running, self.max_count))
        return statistics.median(times) if times else None


def parse_chunk(text: str, stall: float = 1.5, flag: str = "--prefill-chunk",
                whole: int = 256) -> int | ChunkSizer | None:
    """A `flag` value: `auto` (sized by time, `stall`, prompts of at most `whole` tokens whole), N > 0
    tokens, or 0 (None: whole prompts). ValueError in one line otherwise."""
    if str(text).strip().lower() == "auto":
        return ChunkSizer(stall=stall, whole=whole)
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{flag} must be auto or an integer >= 0 (got {text!r})")
    return n or None
