"""Decoding with an EAGLE-3 feature head: greedy equality with `ar`, exact sampling, the
draft cache rebuilt from the target's true features, checkpoint kind and target checks."""

import json

import pytest
import torch

from support.head import CASES, GREEDY, N, PROMPTS, SAMPLES, ar_output
from support.models import tiny_llama
from support.engine import random_decider
from support.exact import chi2_pvalue, exact_distribution, speculative_counts
from decoding.drafts.capture import capture_aux
from decoding.drafts.feature import DraftKV
from decoding.drafts.io import draft_kind, load_feature_draft, save_feature_draft
from decoding.models import ModelError, fingerprint, same_model
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: c.name)
def test_greedy_equals_ar(feature_pair, cfg):
    target, draft = feature_pair
    eng = build_engine(target, draft, cfg, GREEDY)
    accepted = 0
    for prompt in PROMPTS:
        out, stats = eng.generate(prompt, N)
        assert out == ar_output(target, prompt)
        assert stats.new_tokens == N and stats.lossless
        accepted += stats.accepted
    assert accepted > 0, "no draft token accepted: the accepted-path bookkeeping went untested"


@pytest.mark.parametrize("rule,threshold", [("specdecpp", 0.5), ("tree", 0.3)])
def test_decider_stop_is_lossless(feature_pair, rule, threshold):
    target, draft = feature_pair
    cfg = StrategyConfig(strategy="ti-mcsd", width=2, depth=4, stop="decider")
    stop = random_decider(rule, threshold, kind="hidden", hidden_size=draft.config.hidden_size)
    eng = build_engine(target, draft, cfg, GREEDY, stop=stop)
    for prompt in PROMPTS:
        assert eng.generate(prompt, N)[0] == ar_output(target, prompt)


def test_longest_branch_runs(feature_pair):
    target, draft = feature_pair
    cfg = StrategyConfig(strategy="ti-mcsd", width=2, depth=3, mode="longest-branch")
    out, stats = build_engine(target, draft, cfg, GREEDY).generate(PROMPTS[0], N)
    assert len(out) == N and not stats.lossless


def test_draft_cache_is_rebuilt_from_true_features(feature_pair):
    """After a run, every committed entry of the head's cache equals a fresh build from the
    target's features of the committed text (no entry computed from the head's own h)."""
    target, draft = feature_pair
    eng = build_engine(target, draft, StrategyConfig(strategy="mcsd", k_config="2,2,1"), GREEDY)
    prompt = PROMPTS[0]
    out, stats = eng.generate(prompt, N)
    assert stats.accepted > 0, "the test needs accepted draft tokens"
    fc = eng.proposer.model
    seq = prompt + out
    with torch.no_grad(), capture_aux(target, draft.config.aux_layers) as cap:
        target(input_ids=torch.tensor([seq]))
    n = fc.length
    assert n >= len(seq) - 5 and len(fc.cache) == n  # the last round (<= 4 tokens) is not read back
    ref = DraftKV()
    with torch.no_grad():
        draft.step(torch.tensor([seq[1: n + 1]]), draft.fuse(cap.aux()[:, :n]), torch.arange(n)[None], ref)
    torch.testing.assert_close(fc.cache.k, ref.k, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fc.cache.v, ref.v, rtol=1e-4, atol=1e-5)


def _drafted_trees(target, draft, sampling, own: bool, grow: bool):
    stop, cfg = None, StrategyConfig(strategy="mcsd", k_config="3,2")
    if grow:  # children sized from the frontier's q (its top tokens found over the head's vocabulary too)
        from decoding.forward.cost import CostCurve
        from decoding.growth import GrowPolicy, q_scores

        cost = CostCurve([1, 5, 16, 45, 64], [36.6, 41.0, 42.0, 55.0, 59.0], [1.5, 1.6, 1.8, 2.5, 3.0])
        stop, cfg = GrowPolicy(q_scores, cost, max_width=3, max_nodes=24), StrategyConfig(strategy="ti-mcsd", width=3, depth=5)
    eng = build_engine(target, draft, cfg, sampling, stop=stop)
    prop, trees = eng.proposer, []
    if not own:  # the head's logits scattered to the target vocabulary, warped and drawn there
        prop.model.own_vocab, prop.vocab_ids = False, None
    real = prop.propose
    prop.propose = lambda *a, **k: trees.append(real(*a, **k)) or trees[-1]
    out = eng.generate(PROMPTS[2], N, seed=0)[0]
    return out, [t for t in trees if t.levels]


@pytest.mark.parametrize("grow", [False, True], ids=["fixed", "grown"])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.8, top_p=0.9)], ids=["greedy", "top-p"])
def test_q_is_drawn_over_the_heads_vocabulary_and_read_over_the_targets(feature_pair, sampling, grow):
    """The proposer warps and draws over the head's own columns: each node's q over the target
    vocabulary is that q scattered there (exactly 0 elsewhere), every candidate a head token with
    q > 0; greedy, the trees are those a target-vocabulary reading drafts (the same candidates, q
    to rounding)."""
    target, draft = feature_pair
    used = draft.used_ids
    out, trees = _drafted_trees(target, draft, sampling, True, grow)
    assert trees, "no round drafted"
    outside = torch.ones(draft.config.vocab_size, dtype=torch.bool)
    outside[used] = False
    for tree in trees:
        assert tree.q.keys() == tree.q_own.keys()
        for par, q in tree.q.items():
            assert not q[outside].any() and torch.equal(q[used], tree.q_own[par])
        for level in tree.levels:
            assert all(q[t] > 0 for t, q in zip(level.tokens, level.parent_q[level.parent_of]))
    if sampling.greedy:
        ref_out, ref = _drafted_trees(target, draft, sampling, False, grow)
        assert out == ref_out and len(trees) == len(ref)
        assert len({t.size for t in trees}) >= (2 if grow else 1)
        for tree, old in zip(trees, ref):
            assert tree.tokens == old.tokens and not old.q_own
            for par in old.q:
                torch.testing.assert_close(tree.q[par], old.q[par], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cfg,sampling", [
    (StrategyConfig(strategy="mcsd", k_config="2,2"), SamplingConfig(temperature=1.0)),
    (StrategyConfig(strategy="ti-mcsd", width=2, depth=2, stop="confidence", confidence_threshold=0.3),
     SamplingConfig(temperature=0.8, top_p=0.9)),
], ids=["mcsd", "ti-mcsd+confidence-top-p"])
def test_sampling_is_exact(tiny_pair, cfg, sampling):
    target, draft = tiny_pair
    eng = build_engine(target, draft, cfg, sampling)
    counts, depths, _ = speculative_counts(eng, SAMPLES)
    assert sum(v for d, v in depths.items() if d >= 1) > 0.3 * SAMPLES
    pvalue = chi2_pvalue(counts, exact_distribution(target, sampling), SAMPLES)
    assert pvalue > 1e-3, f"p={pvalue:.2e}"


def test_sampling_test_catches_a_broken_rule(tiny_pair, monkeypatch):
    from decoding import acceptance

    monkeypatch.setattr(acceptance, "residual", lambda p, q: p)
    target, draft = tiny_pair
    sampling = SamplingConfig(temperature=1.0)
    eng = build_engine(target, draft, StrategyConfig(strategy="mcsd", k_config="2,2"), sampling)
    counts, _, _ = speculative_counts(eng, SAMPLES)
    assert chi2_pvalue(counts, exact_distribution(target, sampling), SAMPLES) < 1e-6


# -- checkpoint ----------------------------------------------------------------------------------
def test_checkpoint_roundtrip_and_refusal(feature_pair, tmp_path):
    target, draft = feature_pair
    out = save_feature_draft(draft, tmp_path / "head", target, {"note": "test"})
    assert draft_kind(out) == "eagle3" and draft_kind(tmp_path) == "model"
    back = load_feature_draft(out, target)
    assert fingerprint(back)["name"] == "head"  # deciders and traces name the pair by folder
    assert same_model(fingerprint(back), fingerprint(draft))
    ids, aux = torch.randint(0, 40, (1, 5)), torch.randn(1, 5, 96)
    with torch.no_grad():
        torch.testing.assert_close(back.unroll(ids, aux, 2)[1][0], draft.unroll(ids, aux, 2)[1][0], rtol=0, atol=0)
    other = tiny_llama(5, vocab=40, layers=4, hidden=32)
    with pytest.raises(ModelError, match="only fits its own target"):
        load_feature_draft(out, other)
    marker = json.loads((out / "specstop_draft.json").read_text())
    (out / "specstop_draft.json").write_text(json.dumps({**marker, "draft_kind": "medusa"}))
    with pytest.raises(ModelError, match="unknown draft_kind"):
        draft_kind(out)


def test_grow_with_a_feature_head_equals_ar_and_varies_the_tree(feature_pair):
    """The cost-aware grown tree works with the feature draft too (every draft kind grows)."""
    from decoding.forward.cost import CostCurve
    from decoding.growth import GrowPolicy, q_scores

    target, draft = feature_pair
    cost = CostCurve([1, 5, 16, 45, 64], [36.6, 41.0, 42.0, 55.0, 59.0], [1.5, 1.6, 1.8, 2.5, 3.0])
    pol = GrowPolicy(q_scores, cost, max_width=3, max_nodes=24)
    eng = build_engine(target, draft, StrategyConfig(strategy="ti-mcsd", width=3, depth=5), GREEDY, stop=pol)
    sizes, accepted = set(), 0
    for prompt in PROMPTS:
        out, stats = eng.generate(prompt, N)
        assert out == ar_output(target, prompt)
        sizes |= set(stats.tree_sizes)
        accepted += stats.accepted
    assert accepted > 0 and len(sizes - {0}) >= 2, sizes


def test_time_forwards_times_a_feature_head(feature_pair):
    """Cost models (training.decider.replay.calibrate, grow's measured curve) can time a feature head."""
    from decoding.forward.cost import time_forwards

    _, draft = feature_pair
    ms = time_forwards(draft, [1, 4, 16], repeats=1, context=12)
    assert len(ms) == 3 and all(m > 0 for m in ms) and ms == sorted(ms)


@pytest.mark.parametrize("gamma", [2, 4])
def test_each_round_drafts_what_training_time_test_predicts(feature_pair, gamma):
    """Serving and training agree on what the head sees. In every `sd` round (greedy) the
    draft's distribution at step j equals `unroll`'s (training-time test, the training loss's
    forward) at that round's position for j = 1 .. accepted + 1, where both read the same
    tokens (steps 2.. from the head's own h); and the round accepts exactly the leading run of
    steps that unroll gets right. A cache, position or feature offset shows up here even when
    it changes no argmax (lossless decoding hides it: greedy equality still holds)."""
    target, draft = feature_pair
    eng = build_engine(target, draft, StrategyConfig(strategy="sd", gamma=gamma), GREEDY)
    rounds = deeper = 0
    for prompt in PROMPTS:
        seen = []
        eng.observer = lambda tree, logits, out, pos, seen=seen: seen.append((pos, len(out.path), dict(tree.q)))
        out, _ = eng.generate(prompt, N)
        seq = torch.tensor([prompt + out])
        T = seq.shape[1]
        with torch.no_grad(), capture_aux(target, draft.config.aux_layers) as cap:
            top1 = target(input_ids=seq).logits.argmax(-1)[0]
            steps = [torch.softmax(draft.to_target(lg[0].float()), -1) for lg, _ in draft.unroll(seq, cap.aux(), gamma)]
        for pos, accepted, q in seen:
            t = len(prompt) + pos - 2  # the round drafts x_{t+2} first: unroll's index t
            if t + gamma + 1 >= T:
                continue  # too near the end for unroll to see every step's label
            rounds += 1
            deeper += accepted >= 2
            for j in range(min(accepted + 1, gamma)):  # node j-1 of the chain holds step j+1's q
                torch.testing.assert_close(q[j - 1], steps[j][t], rtol=1e-4, atol=1e-5,
                                           msg=lambda m, pos=pos, j=j: f"round at {pos}, step {j + 1}: {m}")
            lead = 0
            while lead < gamma and int(steps[lead][t].argmax()) == int(top1[t + 1 + lead]):
                lead += 1
            assert lead == accepted, (pos, lead, accepted)
    assert rounds >= 10 and deeper >= 3, (rounds, deeper)  # steps >= 2 are really compared


def test_hf_assisted_refuses_a_feature_head(feature_pair):
    """HF's assisted generation drives stand-alone models only: a bench row that would hand it
    the (now default) feature head fails with one line naming the way out."""
    from decoding.bench.config import StrategySpec
    from decoding.bench.runs import HFRunner

    target, draft = feature_pair
    with pytest.raises(ModelError, match="stand-alone draft .* feature head.*draft: checkpoints/drafts/"):
        HFRunner(target, draft, StrategySpec("hf-assisted"), GREEDY, None, True)


def test_a_run_past_the_heads_trained_window_is_reported(feature_pair, tmp_path, capsys, monkeypatch):
    """A head records the longest row it was trained on (`data.window`); a run whose context
    outgrows it says by how much (stats, and a note under the CLI's stats line), a run within it
    and a head without a window say nothing."""
    from decoding import generate as cli

    target, draft = feature_pair
    out = save_feature_draft(draft, tmp_path / "head", target, {"data": {"window": 12}})
    head = load_feature_draft(out, target)
    assert head.trained_window == 12
    eng = build_engine(target, head, StrategyConfig(strategy="sd", gamma=2), GREEDY)
    s = eng.generate([1, 2, 3, 4, 5], 20)[1].to_dict()
    assert (s["context_tokens"], s["trained_window"], s["past_trained_window"]) == (25, 12, 13)
    assert eng.generate([1, 2, 3], 5)[1].to_dict()["past_trained_window"] == 0
    bare = load_feature_draft(save_feature_draft(draft, tmp_path / "bare", target), target)
    s = build_engine(target, bare, StrategyConfig(strategy="sd", gamma=2), GREEDY).generate([1, 2, 3], 20)[1]
    assert s.trained_window is None and s.past_trained_window == 0

    class Res:
        text, token_ids, stats = "", [], {**s.to_dict(), "trained_window": 12, "context_tokens": 23,
                                           "past_trained_window": 11}

    class Dec:
        @staticmethod
        def load(*a, **k):
            return Dec

        @staticmethod
        def generate(*a, **k):
            return Res

    monkeypatch.setattr("decoding.api.Decoder", Dec)
    assert cli.main(["--prompt", "hi", "--max-new-tokens", "20"]) == 0
    assert "trained on rows of up to 12 tokens and this context reached 23" in capsys.readouterr().err
