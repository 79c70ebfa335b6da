"""The grow rules' default draft gate (`--gate request`): each request decides by its own rounds,
timed on the wall (`--gate context`: decoding.stopping.gate, every request's near the context)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from decoding.stopping.gate import MEMORY, MOVED, DraftGate, _near

# Why per request: DraftGate prices drafting from the drafted rounds of every request near the
# current context, so the first requests at a context decide for the later ones. Where the first
# drafted badly its looks came hundreds of rounds apart and code prompts that would have drafted
# 2-5 tokens a round ran plain (reports/context-2026-12-07-warm). Here each new prompt looks at
# once, keeps drafting while its own latest drafted rounds commit more tokens per wall ms than a
# plain round does, and closes as soon as they do not; a closed prompt looks again after
# `backoff` plain rounds, then twice as many each time, so where drafting loses a request of R
# rounds pays about log2(R / backoff) looks. Lossless as every gate: a decision reads only
# earlier rounds' times and tokens.


@dataclass
class PromptGate(DraftGate):
    """Whether a round drafts, from this request's own drafted rounds (the comment above)."""

    recent: int = 8
    """This request's latest drafted rounds its drafting rate is measured over."""
    backoff: int = 4
    """Plain rounds before a closed request's next look; each later look waits twice as long
    (at most `max_every`)."""
    prior: float = 0.0
    """Drafted rounds' worth of earlier requests near this context (their mean tokens and wall ms
    a round, the latest 32) that a request's own rounds are weighed with (0: its own alone). Why
    tried: a drafted round commits 1-4 tokens, so one lucky look where drafting loses on average
    opens a streak. Off: the rounds remembered are those the gate chose to draft, streaks while
    they win, and read better than drafting runs; at 4 on a Zen 5 (2 threads, the context suite's
    `default-prior`) it drafted 30% of rounds at 600 cached tokens against 22% and ran 0.976x
    [0.958, 0.994] the default there (reports/context-2026-12-07-prior)."""
    _mine: deque = field(default_factory=deque, repr=False)
    """(tokens committed, wall ms less the head's catch-up) of this request's latest drafted rounds."""
    _this: list = field(default_factory=list, repr=False)
    """(tokens, ms, context) of every drafted round of this request, with a prior: earlier
    requests' (`_theirs`) when the next prompt comes."""
    _theirs: deque = field(default_factory=lambda: deque(maxlen=MEMORY), repr=False)
    _wait: int = 0
    _idle: int = 0
    """Plain rounds since this request's last drafted round (or its prompt)."""
    _tokens: int | None = None
    _step: float = 0.0

    def __post_init__(self):
        self._mine = deque(maxlen=max(self.recent, 1))

    def drafts(self, cost, explore: bool = True, context: int | None = None) -> bool:
        context = int(cost.context if context is None else context)
        if not self._context <= context <= self._context + MOVED:  # a new prompt: it decides anew
            self._mine, self._wait, self._idle, self._ahead = deque(maxlen=max(self.recent, 1)), 0, 0, 0
            self._theirs.extend(self._this)
            self._this = []
        self._context = context
        pays, _, step, tree = self._priced(cost)
        # read once a round, and not in promised plain rounds (their promise ends where the look is due)
        winning = self._ahead <= 0 and bool(self._mine) and self.wins(step)
        if self._ahead > 0:  # plain rounds promised by `lookahead`
            go, self._ahead = False, self._ahead - 1
        elif not pays:
            go, self._ahead = False, self.max_every  # until a new prompt
        elif winning:
            go = True
        else:  # a look (the first at once: the prompt's round drafts nothing, and is not timed)
            go = explore and self._idle >= self._wait
        self._looking = self._cold = go and self._idle > 0
        self._idle = 0 if go else self._idle + 1
        if not go and pays and not self._ahead:
            self._ahead = 0 if winning else max(self._wait - self._idle, 0)
        self._now, self._tokens, self._step = (cost, tree if go else step), None, step
        return go

    def plain_ms(self, step: float) -> float:
        """A plain round's wall ms near this context (their median; before any: `step`, the
        curve's price, at the plain rounds' measured scale)."""
        plain = sorted(ms for ms, _ in self._near(self._ms["plain"], 8))
        return plain[len(plain) // 2] if plain else step * self.scale(False)

    def wins(self, step: float) -> bool:
        """Do this request's latest drafted rounds commit at least a token per plain round's time?"""
        tokens, ms = sum(t for t, _ in self._mine), sum(m for _, m in self._mine)
        near = _near(self._theirs, self._context, self.scale_span, 32) if self.prior > 0 else []
        if near:
            tokens += self.prior * sum(t for t, _, _ in near) / len(near)
            ms += self.prior * sum(m for _, m, _ in near) / len(near)
        return ms <= 0 or tokens * self.plain_ms(step) >= ms

    def record(self, tokens: int, nodes: int, draft_sizes: list[int], parents: int) -> None:
        super().record(tokens, nodes, draft_sizes, parents)
        self._tokens = tokens

    def timed(self, drafted: bool, ms: float, behind_ms: float = 0.0) -> None:
        super().timed(drafted, ms, behind_ms)
        if drafted and self._tokens is not None and ms > 0:
            self._mine.append((self._tokens, max(ms - behind_ms, 0.0)))
            if self.prior > 0:  # kept only where it is read
                self._this.append((*self._mine[-1], self._context))
            if not self.wins(self._step):  # closed: each look that leaves it closed doubles the wait
                self._wait = min(max(self.backoff, 2 * self._wait), self.max_every)
        self._tokens = None


def make_gate(name: str) -> DraftGate:
    """The grow rules' draft gate of that name (decoding.options.GATES)."""
    return PromptGate() if name == "request" else DraftGate()
