"""Per-run statistics, in the metrics these projects report."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RunStats:
    strategy: str
    lossless: bool
    new_tokens: int = 0
    rounds: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    """Tree nodes proposed by the draft model (valid ones)."""
    accepted: int = 0
    """Drafted nodes that were committed."""
    draft_s: float = 0.0
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0
    wall_s: float = 0.0
    accepted_lengths: Counter = field(default_factory=Counter)
    drafted_depths: Counter = field(default_factory=Counter)
    tree_sizes: Counter = field(default_factory=Counter)
    """Nodes verified per round (dynamic trees vary their width as well as their depth)."""
    context: int = 0
    """Tokens in the context at the end (prompt + generated)."""
    trained_window: int | None = None
    """Longest row the draft head was trained on (its checkpoint's marker), if it records one."""

    def add_round(self, tree, path, committed: int, draft_s: float, verify_s: float, book_s: float):
        self.rounds += 1
        self.target_calls += 1
        self.draft_calls += len(tree.levels)
        start = tree.from_draft_start
        self.drafted += sum(tree.valid[start:])
        self.accepted += sum(1 for i in path if i >= start)
        self.new_tokens += committed
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.bookkeeping_s += book_s
        self.accepted_lengths[len(path)] += 1
        self.drafted_depths[tree.layout.max_depth] += 1
        self.tree_sizes[tree.size] += 1

    def add_plain_round(self, seconds: float) -> None:
        """A target call that drafted nothing (a prompt's forward)."""
        self.rounds += 1
        self.target_calls += 1
        self.new_tokens += 1
        self.verify_s += seconds
        self.accepted_lengths[0] += 1
        self.drafted_depths[0] += 1
        self.tree_sizes[0] += 1

    def add_device_round(self, depth: int, size: int, accepted: int, committed: int, seconds: float) -> None:
        """A round run whole on the device (decoding.round): its time is not split by step."""
        self.rounds += 1
        self.target_calls += 1
        self.draft_calls += max(depth - 1, 0)
        self.drafted += size
        self.accepted += accepted
        self.new_tokens += committed
        self.bookkeeping_s += seconds
        self.accepted_lengths[accepted] += 1
        self.drafted_depths[depth] += 1
        self.tree_sizes[size] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def block_efficiency(self) -> float:
        """Mean tokens committed per target forward."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def mean_tree_size(self) -> float:
        return sum(k * v for k, v in self.tree_sizes.items()) / self.rounds if self.rounds else 0.0

    @property
    def past_trained_window(self) -> int:
        """Context positions beyond the head's trained window (its acceptance may fall there;
        the output does not change: the rule is lossless)."""
        return max(0, self.context - self.trained_window) if self.trained_window else 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "lossless": self.lossless,
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "target_calls": self.target_calls,
            "draft_calls": self.draft_calls,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "block_efficiency": round(self.block_efficiency, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "wall_s": round(self.wall_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "bookkeeping_s": round(self.bookkeeping_s, 4),
            "accepted_lengths": dict(sorted(self.accepted_lengths.items())),
            "drafted_depths": dict(sorted(self.drafted_depths.items())),
            "mean_tree_size": round(self.mean_tree_size, 3),
            "context_tokens": self.context,
            "trained_window": self.trained_window,
            "past_trained_window": self.past_trained_window,
        }
