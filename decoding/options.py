"""The decoding options and their checks, in plain Python: no torch, no transformers.

The CLIs check every option value against these before importing the heavy libraries, so a
bad value is refused in a fraction of a second rather than after seconds of imports. The
modules that use them (sampling, stopping, tree, strategies, decider) re-export them. The draft
tree's shapes (k-configs, the fork tree, the node cap) are checked in decoding.drafts.tree_shapes,
imported here. The flags generate and serve share (add_strategy_args) are declared here too.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import KW_ONLY, dataclass

from decoding.drafts.tree_shapes import MAX_TREE_NODES, fork_k_config, parse_k_config, tree_size

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
HEAD_WINDOW = 256
"""Committed positions a feature head attends back by default (StrategyOptions.head_window)."""
GATES = ("request", "context")
"""Draft gates of the grow rules (StrategyOptions.gate)."""


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
    gate: str = "request"
    """grow rules only: whether a round drafts at all, decided from each request's own drafted
    rounds on the wall (request: decoding.stopping.prompt_gate) or from every request's near the
    current context, priced on the cost curve (context: decoding.stopping.gate)."""
    head_window: int = HEAD_WINDOW
    """A feature (EAGLE-3) head attends to the newest this many committed positions (0: all): after
    plain rounds it catches up on these alone, and past the window it was trained on a nearer view
    drafts better (docs/feature-head.md, "Window")."""
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
        if self.gate not in GATES:
            raise ValueError(f"unknown gate {self.gate!r}; choose {' or '.join(GATES)}")
        if self.head_window < 0:
            raise ValueError(f"head_window must be >= 0 (0: the whole context; got {self.head_window})")
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
        grows = self.stop == "decider" or (self.stop == "confidence" and self.confidence_rule == "grow")
        if self.gate != "request" and grows and self.strategy != "ar":
            n += f"+gate-{self.gate}"
        if self.head_window != HEAD_WINDOW and self.strategy != "ar":
            n += f"+window{self.head_window or 'all'}"
        return n + ("+device" if self.round == "device" else "") + (f"+ahead{self.lookahead}" if self.lookahead > 1 else "")





# ---- command-line flags ----
class Flag:
    """One command-line option as every command that takes it declares it: its spelling, type,
    choices, registry default and help. `unset` says what a default of None means (shown in the
    help). A command changes only the default (`add_option(..., default=)`), whether the flag is
    required, whether it takes several values, and (dtype-like flags) a subset of the choices."""

    def __init__(self, help: str, *, type=None, choices=None, default=None, unset: str | None = None,
                 action: str | None = None, flag: str | None = None):
        self.help, self.type, self.choices, self.default = help, type, choices, default
        self.unset, self.action, self.flag = unset, action, flag


_FORWARD_HELP = (
    "how the models compute: lean (Llama-family layers as a few fused ops over prepacked weights, "
    "decoding.forward.lean; packed for other layers), packed (oneDNN-prepacked linears, "
    "decoding.forward.packed), eager (as loaded, the reference), static (eager over a preallocated KV "
    "cache in bucketed sizes) or graph (static, captured as CUDA graphs: CUDA only, decoding.forward.static)")

FLAGS: dict[str, Flag] = {
    # ---- the models ----
    "target": Flag("the target model: an HF-format directory or a GGUF file",
                   unset="the embedded SmolLM2-135M-Instruct"),
    "draft": Flag("the draft: a feature-head or stand-alone draft directory", unset="the shipped one"),
    "head": Flag("the feature head our rows draft with (a directory)", unset="the shipped one"),
    "decider": Flag("decider checkpoint: a run directory, a deciders root holding registry.json "
                    "(its latest, e.g. runs/deciders), or 'latest' (the shipped pair's: "
                    "checkpoints/deciders)", unset="latest"),
    "dtype": Flag("the models' dtype: the one they load and compute in, or the one a command that writes "
                  "weights writes; auto: bfloat16 on CUDA, a CPU with AMX, or one with AVX512-BF16 and the "
                  "packed forward, float32 elsewhere (measured faster there)",
                  choices=("auto", "float32", "bfloat16", "float16")),
    "kv_dtype": Flag("store the target's KV cache as float16 (a float32 target on the lean forward: half the "
                     "bytes its attention reads and a request's cache takes, llama.cpp's default KV type; "
                     "the math stays float32)", choices=("float32", "float16")),
    "device": Flag("torch device: cpu or cuda", default="cpu"),
    "forward": Flag(_FORWARD_HELP, choices=ALL_FORWARDS,
                    unset="$SPECSTOP_FORWARD, else the fastest measured here"),
    "threads": Flag("torch CPU threads (on a busy machine fewer threads than cores avoids oversubscription, "
                    "which can slow decoding many times over)", type=int, unset="torch's"),
    # ---- generation ----
    "prompt": Flag("prompt text"),
    "temperature": Flag("sampling temperature: 0 is greedy", type=float, default=0.0),
    "top_p": Flag("nucleus sampling: keep the smallest set of tokens whose mass reaches top-p",
                  type=float, default=1.0),
    "seed": Flag("random seed", type=int, default=0),
    "max_new_tokens": Flag("most new tokens per prompt (generation stops earlier at end of text)", type=int),
    "new_tokens": Flag("new tokens each timed generation produces", type=int),
    # ---- what a run reads and writes ----
    "config": Flag("YAML file of the command's settings (flags given override its values)"),
    "out": Flag("where the command writes its results (a directory, or a file for a command whose result "
                "is one JSON)"),
    "name": Flag("name of what the command writes inside its output folder"),
    "prompts": Flag("held-out prompts per prompt set (general, code)", type=int),
    "prompts_file": Flag("JSONL prompt file(s)"),
    "corpus": Flag("corpus directory of target-written text"),
    "traces": Flag("trace directory (training.decider.collect)"),
    "ckpt": Flag("Lightning checkpoint of a training run"),
    "metrics_csv": Flag("the run's metrics.csv (learning curve)"),
    "eval_cache": Flag("cache of the tokenized evaluation corpus", default=".cache/eval_corpus"),
    "root": Flag("cache directory"),
    "val_percent": Flag("percent of the rows held out for validation", type=float, default=5.0),
    "size": Flag("draft vocabulary size (output ids kept)", type=int),
    "k": Flag("top-k target logits kept per position", type=int),
    "max_tokens": Flag("padded tokens per prefill batch", type=int),
    # ---- measuring ----
    "repeats": Flag("runs of each measurement (the median is reported)", type=int),
    "quick": Flag("a smoke run: tiny sizes, seconds", action="store_true"),
    "clients": Flag("concurrent clients (comma-separated or repeated)", type=int),
    "suite": Flag(
        "compare (default): every strategy and peer; engine: ar vs model.generate; dtype: ar and the default "
        "configuration in float32 and bfloat16, interleaved (the config's pair, prompts, repeats); forward: one "
        "target forward per size, eager vs packed, in --dtypes, interleaved, with a profile; cli: "
        "`decoding.generate` end to end (fresh processes), defaults vs ar, --prompts per kind, --new-tokens; "
        "llama: llama.cpp's llama-server vs our ar and defaults on the same GGUF (--target FILE.gguf, default "
        "the embedded one), --prompts per kind, --new-tokens, --threads; context: the defaults vs ar and fixed shapes, "
        "prompts padded to --contexts tokens; gpu: see --suite gpu --help; serve: our server vs llama-server -np N under "
        "--clients; serve-load: the server under a hostile crowd (--clients, --prompts each, --duration)",
        choices=("compare", "engine", "dtype", "forward", "cli", "llama", "gpu", "serve", "serve-load", "context")),
    "llama_server": Flag("the llama-server binary", unset="$LLAMA_SERVER, else the one `make llama-cpp` builds"),
    "cost_model": Flag("the replay's cost model: measure (time the pair's forwards here), decider (the one "
                       "saved with the decider), default, or a CostModel JSON file", default="measure"),
    # ---- how a round drafts (StrategyOptions and the decider's), (*): see generate --help ----
    "strategy": Flag("(*) ar when no draft is available", choices=STRATEGIES),
    "gamma": Flag("sd: chain length (*)", type=int),
    "k_config": Flag("mcsd: children per level, e.g. 4,2,2,1 (*)"),
    "width": Flag("ti-mcsd: branches W (*)", type=int),
    "depth": Flag("ti-mcsd: maximum depth D (*)", type=int),
    "mode": Flag("ti-mcsd: lossless (default) or the paper's longest-branch rule, which is LOSSY: its output "
                 "differs from the target's", choices=MODES, default="lossless"),
    "replacement": Flag("draw sibling candidates with replacement", action="store_true"),
    "stop": Flag("stop policy that ends drafting each round (*)", choices=("fixed", "confidence", "decider")),
    "confidence_threshold": Flag("(*)", type=float),
    "confidence_rule": Flag(
        "(*) level: HF's rule (stop once no node of a level has q >= threshold); tree: extend each node while "
        "its path's draft probability is >= threshold; grow: size the tree from q and the cost model stored "
        "with --decider (no threshold; a pair without its own decider times this machine's once and stores it)",
        choices=CONFIDENCE_RULES),
    "decider_rule": Flag(
        "paper: continue while any new node scores above the threshold; specdecpp: stop once P(a drafted token "
        "is rejected) exceeds it; tree: extend each node whose predicted path acceptance is >= the threshold; "
        "grow: size the tree (children per node, depth) from the scores and the checkpoint's cost model "
        "(default: the checkpoint's, or (*))", choices=RULES),
    "grow_cost": Flag("grow rules: the cost model stored with --decider, or measure: this machine's forwards, "
                      "timed on the first load (seconds) and stored for later ones (*)",
                      choices=("decider", "measure")),
    "max_nodes": Flag("grow rules: cap on draft tree nodes (default 64; --width caps children per node, "
                      "--depth the levels)", type=int),
    "round": Flag("host (default): every policy, Python between a round's steps; device: the fixed tree's whole "
                  "round as one tensor program (one CUDA graph replay and one host read a round on CUDA; a "
                  "feature head, --stop fixed)", choices=ROUNDS),
    "gate": Flag("grow rules: whether a round drafts at all, from each request's own drafted rounds timed on the "
                 "wall (request, default) or from every request's near the current context (context)",
                 choices=GATES),
    "head_window": Flag(f"a feature head attends to the newest N committed positions (default {HEAD_WINDOW}; "
                        "0: all)", type=int),
    "lookahead": Flag("--round device: rounds queued on the device ahead of the host's read (default 1; 2 "
                      "overlaps the read's wait with the next round on CUDA)", type=int),
    "decider_threshold": Flag("override the threshold chosen at fit time by trace replay", type=float),
}

STRATEGY_FLAGS = ("strategy", "gamma", "k_config", "width", "depth", "mode", "replacement", "stop",
                  "confidence_threshold", "confidence_rule", "decider", "decider_rule", "grow_cost",
                  "max_nodes", "gate", "head_window", "round", "lookahead", "decider_threshold")
"""One flag per StrategyOptions field and the decider's (generate and serve)."""


def flag_of(name: str) -> str:
    return FLAGS[name].flag or "--" + name.replace("_", "-")


class _Several(argparse.Action):
    """Several values, repeated (--x a --x b), space- (--x a b) or comma-separated (--x a,b); given
    values replace the default rather than extend it."""

    def __init__(self, *args, convert=str, **kwargs):
        self.convert = convert
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.dest, None)
        got = [] if given is self.default or given is None else list(given)
        try:
            got += [self.convert(v) for s in values for v in str(s).split(",") if v]
        except ValueError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        setattr(namespace, self.dest, got)


_KEEP = object()


def add_option(ap, name: str, *, default=_KEEP, unset: str | None = None, required: bool = False,
               several: bool = False, only: tuple | None = None):
    """Declare the shared option `name` (a FLAGS key) on the parser `ap`. Only the default (and, for a
    default of None, `unset`: what it means here), whether it is required, whether it takes several
    values and a subset of its choices (`only`) may differ between commands; the spelling, type and
    help are the registry's."""
    f = FLAGS[name]
    value = f.default if default is _KEEP else default
    kw: dict = {"dest": name, "help": f.help}
    if f.action:
        kw["action"] = f.action
    else:
        if f.choices is not None or only is not None:
            if only is not None and not set(only) <= set(f.choices or ()):
                raise ValueError(f"{flag_of(name)}: {only} is not a subset of {f.choices}")
            kw["choices"] = tuple(only or f.choices)
        if several:
            kw |= {"action": _Several, "nargs": "+", "convert": f.type or str}
        elif f.type is not None:
            kw["type"] = f.type
        if required:
            kw["required"] = True
        else:
            kw["default"] = value
            if value is None and (unset or f.unset):
                kw["help"] += f" (default: {unset or f.unset})"
            elif value is not None:
                kw["help"] += " (default: %(default)s)"
    ap.add_argument(flag_of(name), **kw)


def add_options(ap, *names: str) -> None:
    """Declare several shared options with their registry defaults."""
    for name in names:
        add_option(ap, name)


def add_strategy_args(ap) -> None:
    """One flag per StrategyOptions field (and the decider's), shared by generate and serve;
    `decoding.defaults.strategy_options` reads them back by the fields' names."""
    add_options(ap, *STRATEGY_FLAGS)
