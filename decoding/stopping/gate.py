"""The draft gate: whether a round drafts at all (depth 0: a plain `ar` step, one row, no draft
step), before the stop policy sizes the tree (decoding.stopping, decoding.growth)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields

# Why a gate before the first draft step: the grow rule (decoding.growth) sizes a level once the
# draft has read its parents, so by its first decision the round has already paid the draft's step
# (and a feature head's catch-up); choosing no node there still costs that step. Where drafting
# cannot pay (a long context makes every verify row and draft step dearer, a text the draft reads
# badly) a round must skip the draft altogether to run at `ar`'s speed.
#
# The gate compares, at the current context's cost curve:
# - plain: 1 token in target(1) ms;
# - drafted: the tokens the last drafted rounds committed (1 + accepted nodes), over what those
#   rounds' trees cost at this context: verify rows, every draft step, each level's host work
#   (policy_ms per parent) and a tree round's fixed host cost (overhead_ms).
# A curve on which even certain acceptance of a chain cannot beat plain never drafts. Otherwise it
# drafts while the priced history says drafting wins, each side scaled by what its rounds measured
# beside their price. The history, the drafted rounds' scale and the looks' cost are those of
# contexts near the current one: what the grow rule sizes and what a round pays move with the
# context. Skipping, it looks (drafts one round) as often as a look's measured cost allows
# (`look_share`), since the text changes and a skipped round records nothing.
#
# Lossless as every stop policy: the decision reads only earlier rounds and the cost curve, never
# this round's draws, and a skipped round verifies no tree (the target's own next token).


def tree_ms(cost, nodes: int, draft_sizes: list[int], parents: int) -> float:
    """What a drafted round costs on `cost`: the verify of its nodes with the pending token, its
    draft steps (tokens each fed), its levels' host work (`parents`: the levels' parents, all
    counted) and a tree round's fixed host cost (none without a node: one row was verified)."""
    return (float(cost.target(nodes + 1)) + sum(float(cost.draft(n)) for n in draft_sizes)
            + parents * cost.policy_ms + (cost.overhead_ms if nodes else 0.0))


def can_pay(cost, max_depth: int) -> bool:
    """Could any chain of up to `max_depth` nodes, every one certain to be accepted, beat a plain
    step? (the most a tree of that depth can commit: extra siblings add rows, never tokens)"""
    plain = 1.0 / float(cost.target(1))
    for d in range(1, max(max_depth, 0) + 1):
        if (1 + d) / tree_ms(cost, d, [2] + [1] * (d - 1), d) > plain:
            return True
    return False


MOVED = 80
"""Most cached tokens a round adds (its committed tokens; max_nodes 64 and the pending one): a
larger move, or any fall, is a new prompt."""


def _near(rounds, context: int, span: float, n: int) -> list:
    """The latest `n` of `rounds` (each with its context, cached tokens, last) whose context is
    within `span` of `context`, oldest first. Below 128 cached tokens the keys cost little beside
    the weights: one context. (Read a few times a decision over up to MEMORY rounds: no call per
    row, ~30 us for 512 on an AVX2 Zen 3 when few are near.)"""
    c = max(context, 128)
    lo, hi, out = c / span, c * span, []
    lo = 0.0 if lo <= 128 else lo  # a context below 128 counts as 128
    for x in reversed(rounds):
        if lo <= x[-1] <= hi:
            out.append(x)
            if len(out) == n:
                break
    return out[::-1]


MEMORY = 512
"""Rounds of each kind the gate remembers, at every context: one context's rounds must not push
out what another's measured. A history of 32 (and of 128) lost 600's rounds to the ~210 that
the context suite's 8 requests drafted at 100 cached tokens, and the next pass warmed up again
at 600: 5 rounds that committed 1 token each at 1.6x a plain round's time."""


@dataclass
class DraftGate:
    """Whether a round drafts at all (the comment above says how it decides)."""

    window: int = 8
    """Drafted rounds remembered near the current context (their tokens and tree shapes)."""
    warmup: int = 4
    """Drafted rounds near the current context before the history may close the gate."""
    explore_every: int = 16
    """Plain rounds in a row after which one round drafts again (times the squared rate gap, at
    most 8), until looks are timed: then their measured cost spaces them (`look_share`)."""
    look_share: float = 0.005
    """Most of the plain rounds' time the looks may take: a look (a drafted round after plain ones,
    the head catching up on what it skipped first) costs its measured wall time above what plain
    rounds would take for the tokens it committed (`net_looks`), so looks come at least that over
    (look_share x a plain round) rounds apart (a look at 600 cached tokens took ~19 ms against 4 ms
    a plain round: one every 48th, as the rate gap alone spaced them, cost ~8%;
    reports/context-2026-11-29). Where drafting loses, this share is all the gate costs against
    `ar`: half a percent."""
    max_every: int = 512
    """Plain rounds in a row after which a look comes whatever it costs (the text changes)."""
    max_depth: int = 8
    """Deepest chain the static bound (`can_pay`) considers."""
    burst: int = 1
    """Drafted rounds a look runs in a row. A look's first round drafts from a feature head
    restarted a few dozen positions back, and a lone look's tokens may undersell drafting: at
    2,400 cached tokens on an AVX2 Zen 3 (2 threads) six lone looks committed 1.33 tokens each
    where sd g2 committed 1.79 a round and ran 1.27x `ar`, and the gate stayed shut. The rounds
    after the first show the rate as drafting runs; looks are spaced by the whole burst's cost,
    so the share they may take (`look_share`) holds."""
    net_looks: bool = True
    """A look's cost is its wall time less a plain round's for each token it committed (False: less
    one plain round, whatever it committed). A look that commits what drafting gives is no loss:
    at 2,400 cached tokens on an AVX2 Zen 3 (2 threads) looks of 25-30 ms committing 2-3 tokens
    beside 16.5 ms plain rounds were counted as 9-13 ms lost each, spaced the looks 512 plain
    rounds apart, and the gate stayed shut (3% of rounds drafted) where sd g2 ran 1.28x `ar`;
    netted, it drafted 76% of rounds at 1.17x `ar` (reports/context-2026-12-06-net)."""
    scale_span: float = 1.5
    """Drafted rounds price drafting only at contexts within this factor of the current one
    (cached tokens, 128 at least): the trees the grow rule sizes and what a round pays beside its
    price move with the context (AVX2 Zen 3, 2 threads: 1.72-1.78x at 600 cached tokens, 1.15x at
    2,400), and a history kept from shorter contexts (empty trees, dear rounds) held the gate shut
    at 2,400 where sd g2 ran 1.2-1.3x `ar`. A context with no drafted rounds near it warms up."""
    scale_warm: int = 4
    """Drafted rounds timed near this context before their scale prices drafting; until then it
    is the plain rounds' (timed at every context), so a gate that opens drafts these rounds in a
    row and measures its own: a single round timed at 2.35x its price kept the gate shut."""
    fresh_share: float = 0.0
    """Most of the plain rounds' time looks at a new prompt may take (0: none beyond `look_share`'s):
    a shut gate's looks come hundreds of rounds apart, so where one request drafts badly every
    later one at that context runs plain, however well it would draft. A new prompt's first round
    after its own looks (`fresh_burst` rounds) when at least (look_share / fresh_share) of the
    measured spacing has passed; the prompt's features are then kept for the head's catch-up.
    Off: at 0.02 on a Zen 5 (2 threads, the context suite's `default-fresh`, two runs;
    reports/context-2026-12-07-warm) it ran 1.12x and 1.08x the default at 2,400 cached tokens,
    where drafting pays, but 0.94x it at 600 in one run, where drafting loses."""
    fresh_burst: int = 3
    """Drafted rounds a new prompt's look runs in a row (the first is cold: its head catches up)."""
    _past: deque = field(default_factory=lambda: deque(maxlen=MEMORY), repr=False)
    _ms: dict = field(default_factory=lambda: {"look": deque(maxlen=MEMORY), "plain": deque(maxlen=MEMORY)},
                      repr=False)
    """The latest looks' (wall ms, tokens committed, 0 with `net_looks` off; context) and plain
    rounds' (wall ms, context) (`timed`): looks are spaced by those near the current context
    (`_look_rounds`). Looks at 100 cached tokens that cost nothing spaced looks at 600 one plain
    round apart: 6 looks in 511 rounds, 14.7 ms each against a plain round's 8.5, committing 1 token."""
    _looking: bool = False
    _recorded: int = 0
    _memo: tuple = (None, None)
    _plain: int = 0
    _scale: dict = field(default_factory=lambda: {True: deque(maxlen=MEMORY), False: deque(maxlen=8)},
                         repr=False)
    """(measured ms, priced ms, context) of the latest drafted and plain rounds (`timed`): the curve prices
    forwards timed alone, a round pays more (the feature head's catch-up, capture, cache moves,
    more at long contexts), and a gate on prices alone drafted at 600 cached tokens where drafting
    lost to `ar` (reports/context-2026-11-28)."""
    _now: tuple = (None, 0.0)
    _context: int = 0
    _fresh: int = 0
    """Rounds since the context moved other than by a round's tokens (a new prompt)."""
    _ahead: int = 0
    _burst_left: int = 0
    _cold: bool = False
    """The round being run drafts after a plain one (its head caught up on what it skipped, with
    weights and caches the plain rounds evicted), or is one of the first two after a prompt (at
    2,400 cached tokens on an AVX2 Zen 3 they ran 1.6-2.3x their price, steady ones 1.2x)."""

    @classmethod
    def held_open(cls) -> DraftGate:
        """A gate that never closes (its warm-up never ends): every round drafts, whatever the
        rounds timed on the wall say, for traces, comparisons and tests that must not depend on
        the machine's load."""
        return cls(warmup=10 ** 9)

    def fresh(self) -> DraftGate:
        """A gate with these settings and nothing learnt: what a new process starts with."""
        return type(self)(**{f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")})

    def drafts(self, cost, explore: bool = True, context: int | None = None) -> bool:
        """Does the next round draft, at this context's `cost` (`context`: its cached tokens; None:
        the curve's)? `explore` False: no look at the losing kind this round (a round whose time
        is not recorded, prompt rows riding in it)."""
        context = int(cost.context if context is None else context)
        moved = not self._context <= context <= self._context + MOVED
        self._fresh, self._context = 0 if moved else self._fresh + 1, context
        fresh = self.fresh_share > 0 and self._fresh <= 1  # a new prompt's round (0) or the first after it
        if self._ahead > 0 and self._memo[1] is cost and not fresh:
            # a plain round promised by `lookahead` on the same curve: nothing to re-decide (a new
            # curve every 16 cached tokens, or a new request, re-decides)
            self._ahead -= 1
            self._looking, self._plain = False, self._plain + 1
            self._now = (cost, self._memo[4])
            return False
        pays, rate, step, tree = self._priced(cost)
        warm = len(self._near()) >= self.warmup
        self._ahead = 0
        bursting = self._burst_left > 0 and explore and pays
        self._burst_left = self._burst_left - 1 if bursting else 0
        if bursting:
            go = True  # a look's further rounds: measured as drafting runs
        elif not pays:
            go, self._ahead = False, self.max_every  # until the context changes: a new request re-decides
        elif not warm:
            go = True
        elif (drafted := rate / self.scale(True)) > (plain := 1.0 / (step * self.scale(False))):
            go = True
        else:
            # skipping, look again every `explore_every` rounds, up to 8x rarer the further
            # drafting falls behind (a look costs what drafting loses against a plain step)
            gap = min(8.0, (plain / drafted) ** 2) if drafted > 0 else 8.0
            due = self._look_rounds()
            due = min(max(self.explore_every * gap if due is None else due, 1), self.max_every)
            go = explore and self._plain >= due
            fresh_due = due * self.look_share / self.fresh_share if fresh else None
            if not go and fresh and explore and self._fresh == 1 and self._plain >= fresh_due:
                go, self._burst_left = True, self.fresh_burst - 1
            elif go:
                self._burst_left = self.burst - 1
            # a rate that beats plain may open the gate sooner (the curve moves with the context):
            # then the head drafts from what it has; a prompt whose next round may look keeps its features
            keep = fresh and self._fresh == 0 and self._plain + 1 >= fresh_due
            self._ahead = 0 if go or keep else int(due - self._plain - 1)
        self._looking = bursting or (go and warm and self._plain > 0)
        self._cold = go and (self._plain > 0 or self._fresh <= 2)
        self._plain = 0 if go else self._plain + 1
        # priced until record() says what was drafted: a draft step that sized no node
        self._now = (cost, tree if go else step)
        return go

    def lookahead(self) -> int:
        """Plain rounds certain to follow the one `drafts` just skipped, before the next look."""
        return max(self._ahead, 0)

    def _priced(self, cost) -> tuple:
        """(can_pay, rate, a plain step's ms, an empty drafted round's ms) on `cost`, kept while
        the curve (one a 16-token step of context) and the history stay: ~25 curve reads a round
        cost ~2.5% of a plain step at 600 cached tokens."""
        key = (id(cost), self._context // 16, self._recorded)
        if self._memo[0] != key or self._memo[1] is not cost:
            self._memo = (key, cost, can_pay(cost, self.max_depth), self.rate(cost),
                          float(cost.target(1)), tree_ms(cost, 0, [2], 1))
        return self._memo[2:]

    def _look_rounds(self) -> float | None:
        """Plain rounds a look's measured extra cost (each of its `burst` rounds timed as one: its
        time less a plain round's for each token committed, at least one) buys at `look_share`
        (None before both are timed). A look that costs nothing comes after one plain round: at
        2,400 cached tokens on an AVX2 Zen 3 looks bought what plain rounds would, and a floor of
        16 rounds between them left the gate shut where drafting ran 1.22x `ar`."""
        plain = sorted(ms for ms, _ in self._near(self._ms["plain"], 8))
        looks = self._near(self._ms["look"], 4)
        if not looks or not plain:
            return None
        base = plain[len(plain) // 2]
        looks = sorted(ms - max(tokens, 1) * base for ms, tokens, _ in looks)
        return self.burst * max(looks[len(looks) // 2], 0.0) / (self.look_share * base)

    def scale(self, drafted: bool) -> float:
        """Measured over priced time of the latest rounds of that kind, their sums' ratio (1: none
        timed): what those rounds' tokens cost per priced ms, as `rate` sums them. Not a lower
        median: drafted rounds' times spread 2x, and the lower median, kept to drop a round that
        caught the head up on a prompt (now left out as `behind_ms`), opened the gate at 100
        cached tokens on 1 thread where drafted rounds ran at 0.87x plain ones. Drafted rounds are
        the steady ones, drafted after drafted (`timed`), at contexts near this one (`scale_span`);
        before `scale_warm` of them, a drafted round is taken to be as dear beside its price as a
        plain one."""
        seen = self._scale[drafted]
        if drafted:
            seen = self._near(seen, 32)
            if len(seen) < max(self.scale_warm, 1):
                return self.scale(False)
        priced = sum(p for _, p, _ in seen)
        return sum(m for m, _, _ in seen) / priced if priced > 0 else 1.0

    def timed(self, drafted: bool, ms: float, behind_ms: float = 0.0) -> None:
        """The round just run (drafted: the gate let it draft) took `ms` on the wall, `behind_ms`
        of it catching the draft up on the rounds it skipped; a round feeding a prompt is not one
        to time (its caller leaves it out). A look costs all of it; what drafting costs a round,
        once the gate is open, leaves the catch-up out (a look at 600 cached tokens after 64
        skipped rounds spent most of its draft time on it). A drafted round after a plain one
        prices no steady drafting: at 2,400 cached tokens on an AVX2 Zen 3 (2 threads) looks ran
        1.55x their price without their catch-up, steady drafted rounds 1.15x, plain ones 1.11x,
        and looks alone kept the gate shut where sd g2 ran 1.2x `ar`."""
        priced = self._now[1]
        if priced > 0 and ms > 0 and not (drafted and self._cold):
            self._scale[drafted].append((max(ms - behind_ms, 0.0), priced, self._context))
        if ms > 0 and drafted and self._looking:
            self._ms["look"].append((ms, self._past[-1][0] if self._past and self.net_looks else 0, self._context))
        elif ms > 0 and not drafted:
            self._ms["plain"].append((ms, self._context))

    def rate(self, cost) -> float:
        """Tokens per ms the remembered drafted rounds would run at on `cost`."""
        past = self._near()
        ms = sum(tree_ms(cost, n, s, lv) for _, n, s, lv, _ in past)
        return sum(t for t, *_ in past) / ms if ms > 0 else float("inf")

    def _near(self, rounds=None, n: int | None = None) -> list:
        """The latest `n` (default `window`) of `rounds` (default: the drafted rounds' history)
        whose context (their last field) is near the current one (`scale_span`)."""
        return _near(self._past if rounds is None else rounds, self._context, self.scale_span, n or self.window)

    def record(self, tokens: int, nodes: int, draft_sizes: list[int], parents: int) -> None:
        """A drafted round committed `tokens` with a tree of `nodes` (draft steps of
        `draft_sizes` tokens, levels of `parents` parents in all)."""
        self._past.append((tokens, nodes, list(draft_sizes), parents, self._context))
        self._recorded += 1
        if self._now[0] is not None:
            self._now = (self._now[0], tree_ms(self._now[0], nodes, draft_sizes, parents))
