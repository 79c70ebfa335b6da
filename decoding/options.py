"""The decoding options and their checks, in plain Python: no torch, no transformers.

The CLIs check every option value against these before importing the heavy libraries, so a
bad value is refused in a fraction of a second rather than after seconds of imports. The
modules that use them (sampling, stopping, tree, strategies, decider) re-export them. The flags
generate and serve share (add_strategy_args) are declared here too.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import KW_ONLY, dataclass

DEFAULT_TARGET = "smollm2"
"""Name of the embedded target (SmolLM2-135M-Instruct, converted once by decoding.models)."""


# ---- sampling ----
MIN_TEMPERATURE = 1e-4
"""Below this, logits / temperature can overflow float32 (nan probabilities); such a
temperature is greedy in all but name: use 0."""


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    """0 means greedy decoding; > 0 samples from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose mass reaches top_p."""

    def __post_init__(self):
        t = self.temperature
        if not math.isfinite(t) or t < 0 or 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} "
                             f"(got {t}; smaller values overflow logits / temperature)")
        if not 0 < self.top_p <= 1:  # also refuses nan
            raise ValueError(f"top-p must be in (0, 1] (got {self.top_p})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0



# ---- stop rules ----
GROW = "grow"
"""The cost-aware growth rule (decoding.growth): sizes the tree from the cost curve, no threshold."""
CONFIDENCE_RULES = ("level", "tree", GROW)


def check_threshold(name: str, value) -> float:
    """A stop threshold must be a finite number (nan would silently never / always stop)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number (got {value!r})") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number (got {value})")
    return v


THRESHOLD_RULES = ("paper", "specdecpp", "tree")
"""Rules with a threshold (chosen by replaying traces: training.decider.threshold)."""
RULES = (*THRESHOLD_RULES, GROW)


# ---- tree shapes ----
MAX_TREE_NODES = 1024
"""Largest draft tree: its mask is size^2 and it is built in Python; far past any tree that
pays off (a 64-node tree already costs a CPU target more than one step does)."""


def tree_size(k_levels) -> int:
    """Nodes of a k-config tree (sum over levels of the product of widths so far); raises
    ValueError past MAX_TREE_NODES without building anything."""
    size = level = 0
    for k in k_levels:
        level = k if level == 0 else level * k
        size += level
        if size > MAX_TREE_NODES:
            widths = ",".join(map(str, k_levels))
            raise ValueError(f"draft tree {widths} has more than {MAX_TREE_NODES} nodes "
                             f"(the cap is MAX_TREE_NODES): use fewer or narrower levels")
    return size


def parse_k_config(text: str | list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """'4,2,2,1' -> (4, 2, 2, 1); every entry must be a positive integer."""
    if isinstance(text, str):
        parts = [s for s in text.replace(" ", "").split(",") if s]
        try:
            ks = tuple(int(s) for s in parts)
        except ValueError:
            raise ValueError(f"bad k-config {text!r}: expected comma-separated integers like 4,2,2,1") from None
    else:
        ks = tuple(int(k) for k in text)
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"bad k-config {text!r}: needs at least one level and every width >= 1")
    return ks


def fork_k_config(width: int, depth: int) -> tuple[int, ...]:
    """The target-initialized fork tree: `width` branches, each a chain of `depth` tokens."""
    if width < 1 or depth < 1:
        raise ValueError(f"fork tree needs width >= 1 and depth >= 1 (got {width}, {depth})")
    if width * depth > MAX_TREE_NODES:
        raise ValueError(f"fork tree W={width} D={depth} has {width * depth} nodes, more than "
                         f"MAX_TREE_NODES = {MAX_TREE_NODES}: use a smaller width or depth")
    return (width,) + (1,) * (depth - 1)



# ---- strategies ----
FORWARDS = ("eager", "packed", "lean", "static")
"""How the models compute (decoding.forward.packed): eager, transformers' modules as loaded (the
reference); packed, oneDNN-prepacked linears; lean, packed plus each Llama-family decoder layer as
a few fused ops (decoding.forward.lean); static, the eager modules over a preallocated KV cache in
bucketed sizes (decoding.forward.static). Here so the CLI checks it before importing torch."""
CUDA_FORWARDS = ("graph",)
"""Forwards that need a CUDA device: graph, the static forward captured as CUDA graphs."""
ALL_FORWARDS = (*FORWARDS, *CUDA_FORWARDS)
STRATEGIES = ("ar", "sd", "mcsd", "ti-mcsd")
ROUNDS = ("host", "device")
"""Where a round runs: host (the engine's steps with Python between them, every policy) or device
(decoding.round: one fixed-shape tensor program a round, a CUDA graph replay on CUDA)."""
MODES = ("lossless", "longest-branch")


@dataclass
class StrategyOptions:
    """How a round drafts and when it stops: the ONE declaration of these options, shared by
    the engine (StrategyConfig), the defaults file (decoding.defaults.Defaults), the benchmark's
    rows (decoding.bench.config.StrategySpec) and the API's keywords. Only `strategy` may be
    given by position."""

    strategy: str = "ar"
    """ar | sd | mcsd | ti-mcsd."""
    _: KW_ONLY
    gamma: int = 4
    """Chain length of `sd`."""
    k_config: str = "4,2,2,1"
    """Children per node at each level of the `mcsd` tree."""
    width: int = 4
    """Branches of the `ti-mcsd` fork tree."""
    depth: int = 6
    """Maximum chain depth of the `ti-mcsd` fork tree (the stop policy may end it sooner)."""
    mode: str = "lossless"
    """`ti-mcsd` only: lossless (default) or the paper's longest-branch rule, which is LOSSY."""
    replacement: bool = False
    """Draw sibling candidates with replacement (default: without, as MCSD)."""
    stop: str = "fixed"
    """fixed | confidence | decider."""
    confidence_threshold: float = 0.4
    """Draft-probability threshold of the `confidence` stop policy."""
    confidence_rule: str = "level"
    """`confidence` only: level (HF's rule, whole levels), tree (per-node path probability) or
    grow (the cost-aware tree of decoding.growth)."""
    max_nodes: int = 64
    """grow rules only: cap on the draft tree's nodes (width caps children per node, depth levels)."""
    grow_cost: str = "decider"
    """grow rules only: decider (the cost model stored with the decider checkpoint) or measure
    (time this machine's forwards once, in the dtype loaded: seconds on a CPU, stored)."""
    round: str = "host"
    """host or device (ROUNDS): device runs each round's fixed tree (fixed stop, a feature head,
    without replacement) as one tensor program, captured whole on CUDA (decoding.round)."""
    lookahead: int = 1
    """device round only: rounds queued on the device ahead of the host's read of the tokens (2: the
    read's wait overlaps the next round's replay on CUDA; the next round is sized for the most the
    previous one can commit)."""


@dataclass
class StrategyConfig(StrategyOptions):
    """StrategyOptions checked (every value, before any model loads) for the engine."""

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose from {', '.join(STRATEGIES)}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose lossless or longest-branch")
        if self.mode != "lossless" and self.strategy != "ti-mcsd":
            raise ValueError("the longest-branch mode belongs to ti-mcsd only")
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1 (got {self.gamma})")
        self.k_config = ",".join(map(str, parse_k_config(self.k_config)))
        tree_size(self.k_levels)  # width / depth / k-config / gamma: fail before any model loads
        check_threshold("confidence threshold", self.confidence_threshold)
        if self.grow_cost not in ("decider", "measure"):
            raise ValueError(f"grow_cost must be decider or measure (got {self.grow_cost!r})")
        if not 1 <= self.lookahead <= 4:
            raise ValueError(f"lookahead must be in 1..4 (got {self.lookahead})")
        if self.round not in ROUNDS:
            raise ValueError(f"unknown round {self.round!r}; choose host or device")
        if self.round == "device" and (self.stop != "fixed" or self.replacement or self.mode != "lossless"):
            raise ValueError("the device round drafts a fixed tree: --stop fixed, without --replacement, lossless")
        if not 1 <= self.max_nodes <= MAX_TREE_NODES:
            raise ValueError(f"max_nodes must be in 1..{MAX_TREE_NODES} (got {self.max_nodes})")

    @property
    def k_levels(self) -> tuple[int, ...]:
        return {
            "ar": (),
            "sd": (1,) * self.gamma,
            "mcsd": parse_k_config(self.k_config),
            # lossless: the fork hangs below the exactly-sampled next token, W draft
            # candidates then chains; longest-branch: W target roots then draft chains.
            "ti-mcsd": fork_k_config(self.width, self.depth),
        }[self.strategy]

    @property
    def name(self) -> str:
        n = {"ar": "ar", "sd": f"sd[g={self.gamma}]", "mcsd": f"mcsd[{self.k_config}]",
             "ti-mcsd": f"ti-mcsd[W={self.width},D={self.depth}]"}[self.strategy]
        if self.stop != "fixed" and self.strategy != "ar":
            rule = self.confidence_rule if self.stop == "confidence" and self.confidence_rule != "level" else ""
            n += f"+{self.stop}" + (f"({rule})" if rule else "")
        if self.mode == "longest-branch":
            n += "+longest-branch(LOSSY)"
        return n + ("+device" if self.round == "device" else "") + (f"+ahead{self.lookahead}" if self.lookahead > 1 else "")


# ---- the flags generate and serve share ----
def add_strategy_args(ap: argparse.ArgumentParser) -> None:
    """One flag per StrategyOptions field (and the decider's), shared by generate and serve;
    `decoding.defaults.strategy_options` reads them back by the fields' names."""
    ap.add_argument("--strategy", choices=STRATEGIES, default=None,
                    help="(*) ar when no draft is available")
    ap.add_argument("--gamma", type=int, default=None, help="sd: chain length (*)")
    ap.add_argument("--k-config", default=None, help="mcsd: children per level, e.g. 4,2,2,1 (*)")
    ap.add_argument("--width", type=int, default=None, help="ti-mcsd: branches W (*)")
    ap.add_argument("--depth", type=int, default=None, help="ti-mcsd: maximum depth D (*)")
    ap.add_argument("--mode", choices=MODES, default="lossless",
                    help="ti-mcsd: lossless (default) or the paper's longest-branch rule, which is "
                         "LOSSY: its output differs from the target's")
    ap.add_argument("--replacement", action="store_true", help="draw sibling candidates with replacement")
    ap.add_argument("--stop", choices=("fixed", "confidence", "decider"), default=None,
                    help="stop policy that ends drafting each round (*)")
    ap.add_argument("--confidence-threshold", type=float, default=None, help="(*)")
    ap.add_argument("--confidence-rule", choices=CONFIDENCE_RULES, default=None,
                    help="(*) level: HF's rule (stop once no node of a level has q >= threshold); tree: extend "
                         "each node while its path's draft probability is >= threshold; grow: size the tree "
                         "from q and the cost model stored with --decider (no threshold; a pair without "
                         "its own decider times this machine's once and stores it)")
    ap.add_argument("--decider", default=None,
                    help="decider checkpoint dir, or 'latest' (the default) from checkpoints/deciders/registry.json")
    ap.add_argument("--decider-rule", choices=RULES, default=None,
                    help="paper: continue while any new node scores above the threshold; specdecpp: stop "
                         "once P(a drafted token is rejected) exceeds it; tree: extend each node whose "
                         "predicted path acceptance is >= the threshold; grow: size the tree (children per node, "
                         "depth) from the scores and the checkpoint's cost model (default: the checkpoint's, or (*))")
    ap.add_argument("--grow-cost", choices=("decider", "measure"), default=None,
                    help="grow rules: the cost model stored with --decider, or measure: this machine's "
                         "forwards, timed on the first load (seconds) and stored for later ones (*)")
    ap.add_argument("--max-nodes", type=int, default=None,
                    help="grow rules: cap on draft tree nodes (default 64; --width caps children per node, "
                         "--depth the levels)")
    ap.add_argument("--round", choices=ROUNDS, default=None,
                    help="host (default): every policy, Python between a round's steps; device: the fixed tree's "
                         "whole round as one tensor program (one CUDA graph replay and one host read a round on "
                         "CUDA; a feature head, --stop fixed)")
    ap.add_argument("--lookahead", type=int, default=None,
                    help="--round device: rounds queued on the device ahead of the host's read (default 1; 2 overlaps "
                         "the read's wait with the next round on CUDA)")
    ap.add_argument("--decider-threshold", type=float, default=None,
                    help="override the threshold chosen at fit time by trace replay")
