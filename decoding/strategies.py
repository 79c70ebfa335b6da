"""Named strategies, each a few lines on top of the shared proposer / verifier / stop parts."""

from __future__ import annotations

from decoding.engine import SpeculativeEngine
from decoding.drafts.feature import FeatureDraft
from decoding.drafts.feature_proposer import FeatureProposer
from decoding.tree_proposer import TreeProposer
from decoding.options import MODES, STRATEGIES, SamplingConfig, StrategyConfig  # noqa: F401 (re-exported)
from decoding.stopping import StopPolicy, make_stop_policy
from decoding.tree import layout_from_k_config

def build_engine(target, draft, cfg: StrategyConfig, sampling: SamplingConfig,
                 stop: StopPolicy | None = None) -> SpeculativeEngine:
    if cfg.round == "device":
        return device_engine(target, draft, cfg, sampling)
    if cfg.strategy == "ar":
        return SpeculativeEngine(target, None, sampling, name=cfg.name)
    if draft is None:
        raise ValueError(f"strategy {cfg.strategy} needs a draft model (--draft DIR)")
    lossy = cfg.mode == "longest-branch"
    if isinstance(draft, FeatureDraft):  # an EAGLE-3 head reads the target's hidden states
        proposer = FeatureProposer(draft, target, layout_from_k_config(cfg.k_levels), sampling,
                                   replacement=cfg.replacement, roots_from_target=lossy, window=cfg.head_window)
    else:
        proposer = TreeProposer(draft, layout_from_k_config(cfg.k_levels), sampling,
                                replacement=cfg.replacement, roots_from_target=lossy)
    if stop is None and cfg.stop == "decider":
        raise ValueError("--stop decider needs a decider checkpoint (see Session.engine)")
    stop = stop or make_stop_policy(cfg.stop, cfg.confidence_threshold, cfg.confidence_rule)
    return SpeculativeEngine(target, proposer, sampling, stop, cfg.replacement, lossy, cfg.name)


def device_engine(target, draft, cfg: StrategyConfig, sampling: SamplingConfig):
    """The round of `cfg`'s fixed tree run whole on the device (decoding.round), a feature head drafting."""
    from decoding.round.engine import RoundEngine
    from decoding.round.shape import shape_for

    forward = getattr(target, "_specstop_forward", "eager")
    if forward not in ("eager", "static", "graph"):
        raise ValueError(f"the device round runs transformers' modules over a static cache: --forward static "
                         f"(or graph on CUDA), not {forward}")
    if cfg.strategy != "ar" and not isinstance(draft, FeatureDraft):
        raise ValueError("the device round drafts with a feature head (an EAGLE-3 head directory as --draft)")
    return RoundEngine(target, draft if cfg.strategy != "ar" else None, shape_for(cfg.strategy, cfg.k_levels),
                       sampling, cfg.name, lookahead=cfg.lookahead)
