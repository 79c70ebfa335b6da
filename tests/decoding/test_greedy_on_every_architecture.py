"""Architecture matrix: on tiny random models of each architecture (tests/support/models.py), every
strategy and stop rule reproduces plain greedy decoding (HF's own `generate`, fp32) token for
token, sliding windows shorter than the prompt included."""

from dataclasses import replace

import pytest
import torch

from support.arch_matrix import CASES, N, PROMPTS, models, reference
from support.models import ARCHS, WINDOW
from decoding import kv_cache as cache_mod
from decoding.models.arch import attention_plan
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine

GREEDY = SamplingConfig()
WINDOWED = [a for a in ARCHS if a.endswith("+window")]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_ar_equals_hf_generate(arch):
    """Our plain decoding (one growing cache, the window in the mask) is HF's own: sliding
    layers there keep only the last window - 1 tokens, so a prompt longer than the window
    checks that the two agree on what a window means."""
    target, _ = models(arch)
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    for prompt in PROMPTS:
        assert ar.generate(prompt, N)[0] == reference(arch, tuple(prompt))
    assert (attention_plan(target).window is not None) == arch.endswith("+window")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_strategy_equals_ar(arch, case):
    target, draft = models(arch)
    cfg, make_stop = CASES[case]
    eng = build_engine(target, draft, cfg, GREEDY, stop=make_stop(draft) if make_stop else None)
    accepted = 0
    for prompt in PROMPTS:
        out, stats = eng.generate(prompt, N)
        assert out == reference(arch, tuple(prompt)), f"{arch} / {cfg.name}"
        assert stats.lossless and stats.new_tokens == N
        accepted += stats.accepted
    assert accepted > 0  # drafts were kept: the rollback kept tree nodes, not only the bonus token


@pytest.mark.parametrize("arch", WINDOWED)
def test_the_window_bites(arch, monkeypatch):
    """Without the window (a window longer than any context) the same engine leaves HF's output: the prompts are long
    enough for the window to change what the model says (so the tests above can fail)."""
    monkeypatch.setattr(cache_mod, "attention_plan", lambda m: replace(attention_plan(m), window=10**9))
    target, draft = models(arch)
    assert max(map(len, PROMPTS)) > WINDOW + 1
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    assert any(ar.generate(p, N)[0] != reference(arch, tuple(p)) for p in PROMPTS)


@pytest.mark.parametrize("arch", ["mistral+window", "gemma3+window"])
def test_rollback_leaves_the_cache_plain_decoding_leaves(arch):
    """After a speculative run, each layer holds what HF's own cache holds for the committed
    tokens: all of them in a full layer, the last window - 1 in a sliding one."""
    target, draft = models(arch)
    prompt = PROMPTS[0]
    eng = build_engine(target, draft, StrategyConfig(strategy="mcsd", k_config="2,2,1"), GREEDY)
    out, stats = eng.generate(prompt, N)
    assert stats.accepted > 0
    with torch.no_grad():  # the cache may hold a few accepted tokens past N (of the last round)
        longer = target.generate(torch.tensor([prompt]), max_new_tokens=N + 8, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0].tolist()
    assert longer[len(prompt):][:N] == out
    held = longer[:eng.target.length]  # committed tokens in the cache (the newest is pending)
    assert len(prompt) + N - 1 <= len(held) < len(longer)
    with torch.no_grad():
        hf = target(torch.tensor([held]), use_cache=True).past_key_values
    plan = attention_plan(target)
    for i, (ours, theirs) in enumerate(zip(eng.target.cache.layers, hf.layers)):
        assert ours.keys.shape[-2] == (WINDOW - 1 if i in plan.sliding else len(held))
        assert ours.keys.shape == theirs.keys.shape
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-4, rtol=1e-4)
