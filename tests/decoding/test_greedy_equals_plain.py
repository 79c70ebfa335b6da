"""Greedy equality: every lossless strategy reproduces plain greedy decoding token for token."""

import copy
from collections import Counter

import pytest
import torch

from support.engine import random_decider, with_forward
from support.models import noisy_copy, tiny_llama
from decoding.bench.agreement import check_greedy
from decoding.forward.packed import FORWARDS, set_forward
from decoding.sampling import SamplingConfig
from decoding.stopping import DraftConfidence
from decoding.strategies import StrategyConfig, build_engine

GREEDY = SamplingConfig()
PROMPTS = [[1, 5, 7, 3], [2], [9, 9, 9, 4, 4, 4, 11, 30, 17]]
N = 40

LOSSLESS = [
    StrategyConfig(strategy="sd", gamma=1),
    StrategyConfig(strategy="sd", gamma=4),
    StrategyConfig(strategy="mcsd", k_config="4,2,2,1"),
    StrategyConfig(strategy="mcsd", k_config="2,1,3"),
    StrategyConfig(strategy="mcsd", k_config="1,1,1,1,1,1,1,1"),
    StrategyConfig(strategy="ti-mcsd", width=1, depth=3),
    StrategyConfig(strategy="ti-mcsd", width=3, depth=5),
    StrategyConfig(strategy="ti-mcsd", width=4, depth=6, stop="confidence"),
    StrategyConfig(strategy="mcsd", k_config="3,2,2", stop="confidence", confidence_threshold=0.9),
]


def reference(target, prompt, n=N):
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=FORWARDS)
def forward_pair(pair, request):
    return with_forward(pair, request.param)


@pytest.mark.parametrize("cfg", LOSSLESS, ids=lambda c: c.name)
def test_greedy_equals_ar(pair, forward_pair, cfg):
    """On every forward (eager, the reference, and packed), against HF's generate on the eager
    model: the fast path changes no token."""
    target, draft = forward_pair
    eng = build_engine(target, draft, cfg, GREEDY)
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    for prompt in PROMPTS:
        ref = reference(pair[0], prompt)
        assert ar.generate(prompt, N)[0] == ref
        out, stats = eng.generate(prompt, N)
        assert out == ref
        assert stats.lossless and stats.new_tokens == N
        assert stats.block_efficiency >= 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ar_matches_hf_generate_across_dtypes(dtype):
    """Bit for bit in fp32; in bf16 HF's kernels may break a near-tie the other way (which
    ones depends on the CPU), so a difference must be a genuine tie of the target's logits."""
    target = tiny_llama(3, scale=6).to(getattr(torch, dtype))
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    out, ref = ar.generate([4, 2], 30)[0], reference(target, [4, 2], 30)
    if dtype == "float32":
        assert out == ref
    else:
        assert check_greedy(target, [4, 2], ref, out, dtype).kind in ("equal", "tie")


def test_draft_equal_to_target_is_always_accepted(pair):
    target, _ = pair
    eng = build_engine(target, target, StrategyConfig(strategy="sd", gamma=4), GREEDY)
    out, stats = eng.generate([1, 2, 3], 25)
    assert out == reference(target, [1, 2, 3], 25)
    assert stats.acceptance_rate == 1.0
    assert stats.target_calls == 5  # 5 tokens per round: 4 drafted + 1 bonus


def test_unrelated_draft_is_still_exact():
    target = tiny_llama(0, scale=6)
    draft = tiny_llama(42, layers=1, scale=6)  # independent weights: rarely accepted
    eng = build_engine(target, draft, StrategyConfig(strategy="mcsd", k_config="2,2"), GREEDY)
    out, stats = eng.generate([1, 2, 3], N)
    assert out == reference(target, [1, 2, 3])
    assert stats.acceptance_rate < 0.5


def test_longest_branch_is_flagged_lossy_and_differs(pair):
    target, _ = pair
    draft = noisy_copy(target, 0.2)
    cfg = StrategyConfig(strategy="ti-mcsd", width=4, depth=4, mode="longest-branch")
    eng = build_engine(target, draft, cfg, GREEDY)
    assert "LOSSY" in cfg.name
    outs = [eng.generate(p, N) for p in PROMPTS]
    assert all(not s.lossless for _, s in outs)
    assert any(o != reference(target, p) for (o, _), p in zip(outs, PROMPTS))


def test_eos_stops_generation(pair):
    target, draft = pair
    ref = reference(target, [1, 5, 7, 3])
    eos = ref[10]
    cut = ref[: ref.index(eos) + 1]
    for cfg in (StrategyConfig(strategy="ar"), StrategyConfig(strategy="mcsd")):
        out, stats = build_engine(target, draft, cfg, GREEDY).generate([1, 5, 7, 3], N, eos_token_id=eos)
        assert out == cut and stats.new_tokens == len(cut)


def test_confidence_policy_shortens_drafts(pair):
    target, draft = pair
    cfg = StrategyConfig(strategy="ti-mcsd", width=2, depth=6)
    full = build_engine(target, draft, cfg, GREEDY).generate([1, 2], N)[1]
    short = build_engine(target, draft, cfg, GREEDY, stop=DraftConfidence(0.999)).generate([1, 2], N)[1]
    assert max(short.drafted_depths) < 6 <= max(full.drafted_depths)


@pytest.mark.parametrize("rule,threshold", [("paper", 0.5), ("specdecpp", 0.5), ("tree", 0.3)])
@pytest.mark.parametrize("kind", ["logistic", "hidden", "hybrid"])
def test_decider_stop_is_lossless(pair, rule, threshold, kind):
    target, draft = pair
    cfg = StrategyConfig(strategy="ti-mcsd", width=3, depth=6, stop="decider")
    depths = Counter()
    for prompt in PROMPTS:
        stop = random_decider(rule, threshold, kind=kind, hidden_size=draft.config.hidden_size)
        out, stats = build_engine(target, draft, cfg, GREEDY, stop=stop).generate(prompt, N)
        assert out == reference(target, prompt)
        depths.update(stats.drafted_depths)
    assert len(depths) >= 2  # the decider really varied the draft depth

@pytest.mark.parametrize("stop", ["decider-tree", "confidence-tree"])
def test_dynamic_tree_is_lossless_and_prunes(pair, stop):
    """Per-node expansion: trees that are not whole levels of the k-config, same output."""
    target, draft = pair
    cfg = StrategyConfig(strategy="ti-mcsd", width=3, depth=6, stop="decider")
    sizes = Counter()
    for prompt in PROMPTS:
        policy = (random_decider("tree", 0.3) if stop == "decider-tree"
                  else DraftConfidence(0.002, rule="tree"))
        out, stats = build_engine(target, draft, cfg, GREEDY, stop=policy).generate(prompt, N)
        assert out == reference(target, prompt)
        sizes.update(stats.tree_sizes)
    assert any(s % 3 for s in sizes)  # some rounds extended only some branches
    assert len(sizes) >= 2  # and the shape varied from round to round


def test_dynamic_tree_layout_is_the_drafted_subtree(pair):
    """Extend only the first branch: the verified tree is one chain plus the other roots."""
    from decoding.tree_proposer import TreeProposer
    from decoding.stopping import StopPolicy
    from decoding.tree import layout_from_k_config

    class FirstBranch(StopPolicy):
        def expand(self, level):
            return [b == 0 and level.depth == 1 or level.depth > 1 for b in level.branch]

    target, draft = pair
    prop = TreeProposer(draft, layout_from_k_config((3, 1, 1)), GREEDY)
    tree = prop.propose([1, 2, 3], FirstBranch(), None)
    assert tree.layout.parents == (-1, -1, -1, 0, 3)
    assert tree.size == len(tree.tokens) == 5 and [lv.depth for lv in tree.levels] == [1, 2, 3]
    assert tree.layout.mask[4].tolist() == [True, False, False, True, True]
    # the chain below branch 0 is what the draft alone would draft greedily from its root
    full = TreeProposer(draft, layout_from_k_config((1, 1, 1)), GREEDY).propose([1, 2, 3], StopPolicy(), None)
    assert [tree.tokens[i] for i in (0, 3, 4)] == full.tokens


@pytest.mark.parametrize("cfg", LOSSLESS, ids=lambda c: c.name)
def test_bf16_speculation_equals_bf16_ar_bit_for_bit(pair, cfg):
    """With AMX, the lean forward's kernels are batch-invariant (a verify row of up to 65 tokens
    equals the 1-token step bit for bit), so in bf16 too every lossless strategy whose trees stay
    within 64 nodes (all of these: the 4,2,2,1 tree has 44) reproduces bf16 `ar` token for token:
    no near-tie allowance."""
    from decoding.forward import kernels

    if not kernels.amx() or not kernels.batch_invariant():
        pytest.skip(f"batch-invariant bf16 needs AMX and the kernels: {kernels.describe()}")
    target, draft = (copy.deepcopy(m).to(torch.bfloat16) for m in pair)
    for m in (target, draft):
        assert set_forward(m, "lean") == "lean"
    eng = build_engine(target, draft, cfg, GREEDY)
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    for prompt in PROMPTS:
        assert eng.generate(prompt, N)[0] == ar.generate(prompt, N)[0]
