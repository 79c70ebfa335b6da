"""Named strategies, each a few lines on top of the shared proposer / verifier / stop parts."""

from __future__ import annotations

from dataclasses import dataclass

from .engine import SpeculativeEngine
from .feature_draft import FeatureDraft
from .feature_proposer import FeatureProposer
from .proposers import TreeProposer
from .sampling import SamplingConfig
from .stopping import StopPolicy, make_stop_policy
from .stopping import check_threshold
from .tree import MAX_TREE_NODES, fork_k_config, layout_from_k_config, parse_k_config, tree_size

STRATEGIES = ("ar", "sd", "mcsd", "ti-mcsd")
MODES = ("lossless", "longest-branch")


@dataclass
class StrategyConfig:
    strategy: str = "mcsd"
    """ar | sd | mcsd | ti-mcsd."""
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
    (time this machine's forwards once, in the dtype loaded: ~10-30 s on a CPU)."""

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
        return n


def build_engine(target, draft, cfg: StrategyConfig, sampling: SamplingConfig,
                 stop: StopPolicy | None = None) -> SpeculativeEngine:
    if cfg.strategy == "ar":
        return SpeculativeEngine(target, None, sampling, name=cfg.name)
    if draft is None:
        raise ValueError(f"strategy {cfg.strategy} needs a draft model (--draft DIR)")
    lossy = cfg.mode == "longest-branch"
    if isinstance(draft, FeatureDraft):  # an EAGLE-3 head reads the target's hidden states
        proposer = FeatureProposer(draft, target, layout_from_k_config(cfg.k_levels), sampling,
                                   replacement=cfg.replacement, roots_from_target=lossy)
    else:
        proposer = TreeProposer(draft, layout_from_k_config(cfg.k_levels), sampling,
                                replacement=cfg.replacement, roots_from_target=lossy)
    if stop is None and cfg.stop == "decider":
        raise ValueError("--stop decider needs a decider checkpoint (see Session.engine)")
    stop = stop or make_stop_policy(cfg.stop, cfg.confidence_threshold, cfg.confidence_rule)
    return SpeculativeEngine(target, proposer, sampling, stop, cfg.replacement, lossy, cfg.name)
