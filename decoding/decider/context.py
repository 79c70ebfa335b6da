"""What the text so far says about a drafted token: the signal prompt-lookup decoding reads.

For a node drafted after the committed tokens and its ancestors (its "query": the text up to
it), with occurrences counted in the committed tokens only:

- schema 2: for n = 1, 2, 3, does the most recent earlier occurrence of the query's last n
  tokens continue with the node's token (+1), with another token (-1), or not occur (0); does
  the token occur in the committed text at all.
- schema 3: how long the longest earlier match of the query is (up to MAX_MATCH tokens, as
  prompt-lookup decoding matches), the longest one that continues with the token, and what
  the latest longest match says (+1 / -1 / 0); for n = 1, 2, 3, the share of the occurrences
  of the last n tokens that continue with the token (-1: none); how often the last token and
  the drafted token occur (log1p counts).

Text repeats itself (code above all), and the draft's q does not fully know it: on the default
pair's held-out greedy traces the schema-2 columns take a decider from node ROC-AUC 0.786 to
0.813 (`reports/decider/20261126-064054-0ff3ae/summary.md`); the schema-3 ablation that chose
the longer columns is `reports/decider/context3/` (`python -m training.decider.signal --study
context` re-checks them).

Lossless: it reads only the committed tokens and the draft's own tokens. One index per request,
extended when a feature is asked for (O(new tokens)); a level keeps a Snapshot (the request's
tokens and how many were committed when it was drafted) and its features are computed only when
asked for (a decider, trace collection), exactly as they were then.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass

import torch

NGRAMS = (1, 2, 3)
MAX_MATCH = 16
"""Longest match measured (prompt-lookup decoding's own n-grams are shorter)."""
MAX_SCANNED = 64
"""Latest occurrences of the last NGRAMS[-1] tokens that a match length is extended from (a
bound on the work per node in very repetitive text)."""
CONTEXT_NAMES = (
    [f"ngram{n}" for n in NGRAMS] + ["in_context"]  # schema 2
    + ["match_len", "match_len_token", "longest_says"]  # schema 3
    + [f"continue_share{n}" for n in NGRAMS] + ["log_last_count", "log_token_count"]
)
SCHEMA_CONTEXT = {1: 0, 2: 4, 3: len(CONTEXT_NAMES)}
"""Context columns of each decider feature schema (a prefix of CONTEXT_NAMES)."""


class _Follows:
    """Every occurrence of one n-gram: where its continuation is and what it is, in order."""

    __slots__ = ("at", "next")

    def __init__(self):
        self.at: list[int] = []
        self.next: list[int] = []


_NONE = _Follows()


class ContextIndex:
    """n-gram -> every (position, token) that followed it, over the committed tokens."""

    def __init__(self):
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], _Follows] = {}
        self.where: dict[int, list[int]] = {}  # token -> its positions

    def sync(self, committed) -> ContextIndex:
        """This index extended to `committed`, or a new one for a new request (levels drafted
        before keep the old one)."""
        n = len(self.tokens)
        if len(committed) < n or list(committed[:n]) != self.tokens:
            return ContextIndex().sync(committed)
        for i in range(n, len(committed)):
            t = int(committed[i])
            self.tokens.append(t)
            self.where.setdefault(t, []).append(i)
            for k in NGRAMS:  # the k-gram that ends just before position i is followed by t
                if i - k >= 0:
                    f = self.follows.setdefault(tuple(self.tokens[i - k:i]), _Follows())
                    f.at.append(i)
                    f.next.append(t)
        return self

    def features(self, prefix: tuple[int, ...], token: int, upto: int | None = None) -> list[float]:
        """The CONTEXT_NAMES columns for `token` drafted after the first `upto` committed tokens
        (default: all) and `prefix` (its ancestors' tokens, anchor side first)."""
        upto = len(self.tokens) if upto is None else upto
        need = MAX_MATCH - len(prefix)
        query = self.tokens[max(0, upto - need):upto] + list(prefix[-MAX_MATCH:])
        latest, share, match, says, longest_says = [], [], 0, 0, 0.0
        last_count = 0
        for k in NGRAMS:
            f = self.follows.get(tuple(query[-k:]), _NONE) if len(query) >= k else _NONE
            cut = bisect_left(f.at, upto)  # occurrences whose continuation is committed
            if k == 1:
                last_count = cut
            if not cut:
                latest.append(0.0)
                share.append(-1.0)
                continue
            nxt = f.next[:cut]
            latest.append(1.0 if nxt[-1] == token else -1.0)
            share.append(nxt.count(token) / cut)
            match, longest_says = k, latest[-1]
            if token in nxt:
                says = k
            if k == NGRAMS[-1]:  # extend the longest n-grams' matches further back
                match, longest_says, says = self._extend(f, cut, query, token, says)
        seen = bisect_left(self.where.get(token, ()), upto)
        return latest + [1.0 if seen else 0.0] + [
            float(match), float(says), longest_says,
            *share, math.log1p(last_count), math.log1p(seen)]

    def _extend(self, f: _Follows, cut: int, query: list[int], token: int, says: int):
        """(longest match, longest match continuing with `token`, +1/-1 from the latest
        longest match) over the latest MAX_SCANNED occurrences of the query's last n-gram."""
        best, best_says, say_len = 0, 0.0, says
        toks = self.tokens
        for j in range(cut - 1, max(-1, cut - 1 - MAX_SCANNED), -1):
            i, m = f.at[j], NGRAMS[-1]
            while m < len(query) and m < MAX_MATCH and i - m - 1 >= 0 and toks[i - m - 1] == query[-m - 1]:
                m += 1
            if m > best:  # scanning newest first: the first of a length is its latest
                best, best_says = m, 1.0 if f.next[j] == token else -1.0
            if f.next[j] == token:
                say_len = max(say_len, m)
        return best, best_says, say_len


@dataclass(frozen=True)
class Snapshot:
    """The committed text as a level saw it: features of its nodes, computed on demand. The index
    is extended only when a feature is asked for: a policy that reads none (q's grow rule) pays
    nothing, where indexing a prompt of 2,400 tokens at a look, the draft's first round after
    skipped ones, took longer than the round's own draft steps."""

    holder: object
    """What keeps the request's ContextIndex (`.context`, replaced for a new request)."""
    committed: list
    """The request's committed tokens (a list that only grows while the request runs)."""
    upto: int

    @property
    def index(self) -> ContextIndex:
        self.holder.context = self.holder.context.sync(self.committed)
        return self.holder.context

    def features(self, prefixes, tokens) -> torch.Tensor:
        """[k, len(CONTEXT_NAMES)] features of k nodes (ancestors' tokens, token), on the host."""
        index = self.index
        return torch.tensor([index.features(p, t, self.upto) for p, t in zip(prefixes, tokens)],
                            dtype=torch.float32, device="cpu").reshape(len(tokens), len(CONTEXT_NAMES))
