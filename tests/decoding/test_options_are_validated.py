"""Options are validated before any model loads: one clear ValueError each."""

import math

import pytest

from decoding.decider.policy import DeciderConfig
from decoding.sampling import MIN_TEMPERATURE, SamplingConfig, warp
from decoding.strategies import StrategyConfig
from decoding.tree import MAX_TREE_NODES, k_config_parents, tree_size


def test_tree_size_is_counted_without_building():
    assert tree_size((4, 2, 2, 1)) == 4 + 8 + 16 + 16 == len(k_config_parents("4,2,2,1"))
    assert tree_size((MAX_TREE_NODES,)) == MAX_TREE_NODES
    with pytest.raises(ValueError, match=f"more than {MAX_TREE_NODES} nodes"):
        k_config_parents("16,16,16,16")  # 69,904 nodes: refused before the loop


@pytest.mark.parametrize("kw, message", [
    (dict(strategy="mcsd", k_config="16,16,16,16"), "more than 1024 nodes"),
    (dict(strategy="ti-mcsd", width=64, depth=17), "W=64 D=17 has 1088 nodes"),
    (dict(strategy="ti-mcsd", width=0), "width >= 1"),
    (dict(strategy="ti-mcsd", depth=0), "depth >= 1"),
    (dict(strategy="sd", gamma=2000), "more than 1024 nodes"),
    (dict(strategy="mcsd", k_config="4,x"), "bad k-config"),
    (dict(stop="confidence", confidence_threshold=math.nan), "confidence threshold must be a finite"),
    (dict(stop="confidence", confidence_threshold=math.inf), "confidence threshold must be a finite"),
])
def test_strategy_config_refuses(kw, message):
    with pytest.raises(ValueError, match=message):
        StrategyConfig(**kw)


def test_only_the_active_strategys_tree_is_capped():
    assert StrategyConfig(strategy="ti-mcsd", k_config="16,16,16,16").k_levels == (4, 1, 1, 1, 1, 1)


@pytest.mark.parametrize("t", [math.nan, math.inf, -math.inf, -1.0, 1e-45, MIN_TEMPERATURE / 2])
def test_temperature_refused(t):
    with pytest.raises(ValueError, match="temperature must be 0"):
        SamplingConfig(t)


def test_smallest_temperature_gives_finite_probabilities():
    import torch

    logits = torch.tensor([300.0, -300.0, 0.0, 299.9])  # far beyond what a real LM gives
    p = warp(logits, SamplingConfig(MIN_TEMPERATURE))
    assert torch.isfinite(p).all() and abs(float(p.sum()) - 1) < 1e-6


@pytest.mark.parametrize("p", [math.nan, 0.0, 1.5, -0.1, math.inf])
def test_top_p_refused(p):
    with pytest.raises(ValueError, match="top-p"):
        SamplingConfig(1.0, p)


@pytest.mark.parametrize("t", [math.nan, math.inf])
def test_decider_threshold_refused(t):
    with pytest.raises(ValueError, match="decider threshold must be a finite"):
        DeciderConfig(threshold=t)
