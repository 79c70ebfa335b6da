"""decoding.stopping.gate: a round drafts nothing (a plain step, no draft step) where drafting cannot pay,
priced with every cost (verify rows at the current context, draft steps, each level's host work, a
tree round's fixed cost); the text stays ar's, for the single-request engine and the batch one."""

import copy
from dataclasses import replace

import pytest
import torch

from support.head import ar_output
from support.models import noisy_copy, tiny_llama
from decoding.batch.budget import JointGrow
from decoding.batch.scheduler import BatchEngine
from decoding.forward.cost import CostCurve
from decoding.stopping.gate import DraftGate, can_pay, tree_ms
from decoding.growth import GrowPolicy, q_scores
from decoding.sampling import SamplingConfig
from decoding.stopping import Frontier  # noqa: I001
from decoding.strategies import StrategyConfig, build_engine
from decoding.tree import layout_from_k_config

PAYS = CostCurve([1, 16, 64], [10.0, 10.5, 12.0], [0.5, 0.5, 0.6], overhead_ms=0.2, policy_ms=0.1)
"""Rows and steps cheap beside a plain step: a confident draft pays."""
NEVER = CostCurve([1, 2, 16, 64], [10.0, 30.0, 200.0, 800.0], [0.5, 0.5, 0.5, 0.6])
"""A second row costs as much as two plain steps, each further one 12 ms: not even certain
acceptance pays."""
SHORT_ONLY = CostCurve([1, 16, 64], [10.0, 10.5, 12.0], [0.5, 0.5, 0.6], overhead_ms=0.2, policy_ms=0.1,
                       context=8, key_sizes=[1, 2], target_key_ms=[0.0, 0.5], draft_key_ms=[2.0, 2.0])
"""Cheap up to 15 cached tokens; from 16, every row beyond the pending one and every draft step
cost more than drafting can win (read at 16: a step 16.5 ms, a second row 4 ms): depth 0 there."""


def test_a_curve_where_drafting_cannot_pay_drafts_nothing():
    assert can_pay(PAYS, 8) and not can_pay(NEVER, 8)
    assert not can_pay(SHORT_ONLY.at_context(20), 8) and can_pay(SHORT_ONLY.at_context(12), 8)
    gate = DraftGate()
    assert not any(gate.drafts(NEVER) for _ in range(100))  # no exploring a curve that cannot pay
    pol = GrowPolicy(q_scores, NEVER)
    assert not pol.drafts(100)
    assert GrowPolicy(q_scores, PAYS).drafts(100)


def test_every_cost_is_in_the_price_of_a_tree():
    # 2 roots and a child: verify of 4 rows, the anchor's step and the roots', the host work of 3
    # parents (1 on the first level, 2 on the second), the fixed cost
    assert tree_ms(PAYS, 3, [2, 2], 3) == pytest.approx(PAYS.target(4) + 2 * 0.5 + 3 * 0.1 + 0.2)
    assert tree_ms(PAYS, 0, [2], 1) == pytest.approx(PAYS.target(1) + 0.5 + 0.1)  # an empty tree: one row
    assert CostCurve.from_dict(PAYS.to_dict()) == PAYS  # the host work is stored with the curve


def test_the_host_work_is_timed_on_the_proposers_code():
    from decoding.growth import time_host_work

    policy, overhead = time_host_work(64, width=2, depth=2, repeats=1)
    assert policy >= 0.0 and overhead >= 0.0
    policy, overhead = time_host_work(64, width=2, depth=2, repeats=1, own=16)  # a head's own 16 columns
    assert policy >= 0.0 and overhead >= 0.0


def _looks(gate, rounds=200):
    """The rounds (1-based) at which a closed gate drafts to look again."""
    return [i for i in range(1, rounds + 1) if gate.drafts(PAYS)]


def test_the_history_closes_the_gate_and_exploring_reopens_it():
    gate = DraftGate(warmup=2, explore_every=4)
    assert gate.drafts(PAYS) and gate.drafts(PAYS)  # warm-up
    for _ in range(2):
        gate.record(1, 4, [2, 4], 5)  # trees of 4 nodes that committed only their pending token
    # drafting runs at 1 token / 11.53 ms against 1 / 10: a look every 4 x 1.33 rounds
    assert _looks(gate, 14) == [7, 14]
    far = DraftGate(warmup=1, explore_every=4)
    far.record(1, 64, [2] + [64] * 10, 640)  # far behind: looks 8x rarer, no rarer
    assert _looks(far, 70) == [33, 66]
    quiet = DraftGate(warmup=1, explore_every=4)
    quiet.record(1, 64, [2] + [64] * 10, 640)
    assert not any(quiet.drafts(PAYS, explore=False) for _ in range(70))  # rounds not timed: no look
    assert quiet.drafts(PAYS)  # the next timed round looks: the count went on
    good = DraftGate(warmup=1)
    good.record(4, 3, [2, 1, 1], 3)  # a chain of 3, all accepted: 4 tokens in ~12 ms beat 1 in 10
    assert good.drafts(PAYS)


def test_looks_are_spaced_by_what_they_were_measured_to_cost():
    """A look (a drafted round after plain ones, catching the head up first) timed at 20 ms beside
    4 ms plain rounds costs 16 ms: at look_share 0.05 the next comes 16 / (0.05 x 4) = 80 plain
    rounds on, not after the rate gap's 32; max_every caps it."""
    def run(gate, rounds):
        looks = []
        for i in range(1, rounds + 1):
            go = gate.drafts(PAYS)
            gate.timed(go, 20.0 if go else 4.0)
            if go:
                looks.append(i)
        return looks

    far = DraftGate(warmup=1, explore_every=4, look_share=0.05)
    far.record(1, 64, [2] + [64] * 10, 640)  # far behind: the rate gap alone looks every 32nd
    assert run(far, 200) == [33, 114, 195]  # the first look is not timed yet: 32, then 80 apart
    capped = DraftGate(warmup=1, explore_every=4, look_share=0.001, max_every=50)
    capped.record(1, 64, [2] + [64] * 10, 640)
    assert run(capped, 120) == [33, 84]


def test_a_look_costs_its_time_less_what_plain_rounds_would_take_for_its_tokens():
    """A look timed at 20 ms beside 4 ms plain rounds that commits 4 tokens bought what 4 plain
    rounds (16 ms) would have: it costs 4 ms, so at look_share 0.05 the next look may come 4 / (0.05
    x 4) = 20 plain rounds on; one that commits 5 or more costs nothing; one that commits 1 costs
    its whole 16 ms (80 rounds), as every look does with net_looks off."""
    def spacing(tokens, net=True):
        gate = DraftGate(warmup=1, explore_every=4, look_share=0.05, net_looks=net)
        gate.record(1, 64, [2] + [64] * 10, 640)  # far behind: closed
        while not gate.drafts(PAYS):  # plain rounds up to the rate gap's look
            gate.timed(False, 4.0)
        gate.record(tokens, 1, [2], 1)
        gate.timed(True, 20.0)
        return gate._look_rounds()

    assert [spacing(t) for t in (1, 2, 4, 5, 8)] == [80.0, 60.0, 20.0, 0.0, 0.0]
    assert spacing(4, net=False) == 80.0


def test_looks_that_cost_nothing_come_one_plain_round_apart_and_open_the_gate():
    """Looks timed at 12 ms beside 10 ms plain rounds that commit 3 tokens bought what 3 plain
    rounds would: once one is timed, the next comes after a single plain round (not the rate gap's
    spacing), and their tokens soon outweigh a far-behind history: the gate opens."""
    gate, looks = DraftGate(warmup=1, explore_every=4, look_share=0.05), []
    gate.record(1, 64, [2] + [64] * 10, 640)  # far behind: closed, the rate gap's first look at 33
    for i in range(1, 61):
        go = gate.drafts(PAYS)
        if go:
            gate.record(3, 2, [2, 1], 2)
            looks.append(i)
        gate.timed(go, 12.0 if go else float(PAYS.target(1)))
    assert looks[:4] == [33, 35, 37, 39] and looks[-10:] == list(range(51, 61))


def test_a_look_of_several_rounds_is_spaced_by_its_whole_cost_and_can_open_the_gate():
    """burst 3: a closed gate's look drafts 3 rounds in a row; timed at 20 ms each beside 4 ms plain
    rounds, a look costs 3 x 16 ms, so at look_share 0.05 the next comes 240 plain rounds on (a
    lone look's 80, three times). A look whose later rounds commit what drafting gives opens the
    gate: the first round after a gap may undersell it."""
    def run(gate, rounds, tokens=lambda k: 1):
        looks, k = [], 0
        for i in range(1, rounds + 1):
            go = gate.drafts(PAYS)
            if go:
                gate.record(tokens(k), 2, [2, 1], 2)
                k += 1
                looks.append(i)
            gate.timed(go, 20.0 if go else 4.0)
        return looks

    lone, burst = (DraftGate(warmup=1, explore_every=4, look_share=0.05, burst=b) for b in (1, 3))
    for g in (lone, burst):
        g.record(1, 64, [2] + [64] * 10, 640)  # far behind: the rate gap alone looks every 32nd
    assert run(lone, 200) == [33, 114, 195]
    assert run(burst, 320) == [33, 34, 35, 276, 277, 278]

    def first_undersells(burst, rounds=40):
        """Chains of 2 timed as priced; a drafted round right after a plain one commits 1 token
        (1 in ~11.5 ms against 1 in 10: the gate closes), one after a drafted round 3."""
        gate, looks = DraftGate(warmup=1, explore_every=4, burst=burst), []
        gate.record(1, 2, [2, 1], 2)
        gate.record(1, 2, [2, 1], 2)
        for i in range(1, rounds + 1):
            go = gate.drafts(PAYS)
            if go:
                gate.record(3 if looks and looks[-1] == i - 1 else 1, 2, [2, 1], 2)
                looks.append(i)
            gate.timed(go, 11.5 if go else 10.0)
        return looks

    lone = first_undersells(1)
    assert len(lone) <= 6 and all(b - a > 1 for a, b in zip(lone, lone[1:]))  # lone looks: stays shut
    opened = first_undersells(3)
    assert opened[0] == lone[0] and opened[1:3] == [opened[0] + 1, opened[0] + 2]
    assert opened[2:] == list(range(opened[2], 41))  # the burst showed 3 tokens a round: open


def test_rounds_timed_dearer_than_priced_close_the_gate():
    """The curve prices forwards timed alone; a round that pays more on the wall (the head's
    catch-up, captures, cache moves) closes the gate where its price alone would keep it open."""
    def chain_rounds(gate, drafted_ms, plain_ms, n=8, behind=0.0):
        for _ in range(n):
            if gate.drafts(PAYS):
                gate.record(3, 2, [2, 1], 2)  # a chain of 2, both accepted: 3 tokens
                gate.timed(True, drafted_ms, behind)
            else:
                gate.timed(False, plain_ms)
    priced = tree_ms(PAYS, 2, [2, 1], 2)  # ~11.4 ms for 3 tokens against 10 ms for 1
    honest, slow = DraftGate(warmup=2), DraftGate(warmup=2)
    chain_rounds(honest, priced, PAYS.target(1))
    chain_rounds(slow, 4 * priced, PAYS.target(1))  # 3 tokens in 45 ms: slower than plain steps
    assert honest.drafts(PAYS) and honest.scale(True) == pytest.approx(1.0)
    assert slow.scale(True) == pytest.approx(4.0) and not slow.drafts(PAYS)
    behind = DraftGate(warmup=2)  # 4x the price, 3/4 of it catching the head up: a look's cost,
    chain_rounds(behind, 4 * priced, PAYS.target(1), n=2)  # not what drafting costs a round
    behind._scale[True].clear()
    behind.drafts(PAYS)
    behind.record(3, 2, [2, 1], 2)
    behind.timed(True, 4 * priced, 3 * priced)
    assert behind.scale(True) == pytest.approx(1.0)
    once = DraftGate(warmup=2)  # one round far dearer (the head caught up on a prompt): left out
    chain_rounds(once, 20 * priced, PAYS.target(1), n=1, behind=19 * priced)
    chain_rounds(once, priced, PAYS.target(1), n=1)
    assert once.scale(True) == pytest.approx(1.0) and once.drafts(PAYS)


def test_a_look_after_plain_rounds_prices_no_steady_drafting():
    """A look drafts cold (its head restarted, weights the plain rounds evicted): timed at 3x its
    price, it leaves the drafted rounds' scale to the plain rounds' (here 1.2x their price);
    drafted rounds in a row set it."""
    priced = tree_ms(PAYS, 2, [2, 1], 2)
    gate, looks = DraftGate(warmup=1, explore_every=4, look_share=0.05), 0
    gate.record(1, 64, [2] + [64] * 10, 640)  # far behind: shut, a look every 32nd round
    for _ in range(100):
        go = gate.drafts(PAYS)
        if go:
            gate.record(1, 2, [2, 1], 2)
            looks += 1
        gate.timed(go, 3 * priced if go else 1.2 * float(PAYS.target(1)))
    assert looks >= 2 and gate.scale(False) == pytest.approx(1.2) and gate.scale(True) == pytest.approx(1.2)
    steady = DraftGate(warmup=6)
    for i in range(6):  # the warm-up drafts round after round: the first two after the prompt
        assert steady.scale(True) == pytest.approx(1.0)  # price nothing, 4 (`scale_warm`) set the scale
        assert steady.drafts(PAYS)
        steady.record(3, 2, [2, 1], 2)
        steady.timed(True, 9 * priced if i < 2 else 2 * priced)
    assert steady.scale(True) == pytest.approx(2.0)
    steady.drafts(PAYS, context=100)  # a new prompt (the context jumped): its first two rounds price nothing
    steady.timed(True, 9 * priced)
    assert steady.drafts(PAYS, context=101) and steady.scale(True) == pytest.approx(2.0)


def _drafted(gate, cost, drafted_ms, rounds=40):
    """Rounds of chains of 2 (3 tokens) on `cost`, drafted ones timed at `drafted_ms`, plain ones
    at their price: how many drafted."""
    n = 0
    for _ in range(rounds):
        go = gate.drafts(cost)
        if go:
            gate.record(3, 2, [2, 1], 2)
            n += 1
        gate.timed(go, drafted_ms if go else float(cost.target(1)))
    return n


def test_drafted_rounds_price_drafting_only_near_their_own_context():
    """Drafting that lost at 600 cached tokens (3x its price) does not keep the gate shut at 2,400,
    where it pays (1.1x): there the plain rounds' scale prices it until 4 drafted rounds in a row
    measure their own. Where it loses there too, those rounds close the gate again. (Every round
    here is timed; the engine leaves the prompt's out.)"""
    priced = tree_ms(PAYS, 2, [2, 1], 2)
    short, long_ = replace(PAYS, context=600), replace(PAYS, context=2400)
    scoped, one_scope = DraftGate(), DraftGate(scale_span=float("inf"))
    for gate in (scoped, one_scope):
        # the prompt's round and the two after it (their time prices nothing), 4 timed: then shut
        assert _drafted(gate, short, 3 * priced) <= 8
        assert gate.scale(True) == pytest.approx(3.0) and not gate.drafts(short)
    assert _drafted(scoped, long_, 1.1 * priced) >= 38 and scoped.scale(True) == pytest.approx(1.1)
    assert _drafted(one_scope, long_, 1.1 * priced) <= 2  # priced by 600's rounds: shut
    loses = DraftGate()
    _drafted(loses, short, 3 * priced)
    # 3 after the prompt (not timed), 4 timed, and a look: none timed at 2,400 yet, the rate gap spaces it
    assert _drafted(loses, long_, 3 * priced) == 8
    assert not loses.drafts(long_) and loses.drafts(short, context=550) is False


def test_a_context_keeps_its_history_and_its_looks_cost_while_another_drafts():
    """Drafting that loses at 1,200 cached tokens (1 token in 30 ms beside 10 ms plain rounds) shuts
    the gate there after its warm-up. 60 rounds drafted at 100 cached tokens, where it pays, push
    none of that out: back at 1,200 there is no second warm-up, and looks come as 1,200's own
    measured cost spaces them: (30 - 10) / (0.05 x 10) = 40 plain rounds apart."""
    def drafted(gate, cost, tokens, ms, rounds):
        out = []
        for i in range(1, rounds + 1):
            go = gate.drafts(cost)
            if go:
                gate.record(tokens, 2, [2, 1], 2)
                out.append(i)
            gate.timed(go, ms if go else float(cost.target(1)))
        return out

    gate = DraftGate(explore_every=4, look_share=0.05)
    short, long_ = replace(PAYS, context=100), replace(PAYS, context=1200)
    # 4 rounds of warm-up, a look spaced by the rate gap, then by its measured cost
    assert drafted(gate, long_, 1, 30.0, 100) == [1, 2, 3, 4, 11, 52, 93]
    assert len(drafted(gate, short, 3, 12.0, 60)) == 60
    assert drafted(gate, long_, 1, 30.0, 100) == [41, 82]


def _frontier(q) -> Frontier:
    return Frontier(depth=1, nodes=[-1], q=torch.tensor([q]), path_logq=[0.0], valid=[True], size=0)


def test_a_tree_rounds_fixed_and_level_costs_can_make_the_first_level_empty():
    q = [0.1] * 4  # 4 nodes add 0.4 tokens: 1.4 in 10.5 ms beats 1 in 10.5 (the step is paid)
    assert sum(GrowPolicy(q_scores, CostCurve([1, 64], [10.0, 10.5], [0.5, 0.5]), max_width=4).widths(_frontier(q))) > 0
    dear = CostCurve([1, 64], [10.0, 10.5], [0.5, 0.5], overhead_ms=6.0)  # a tree round's host work
    assert GrowPolicy(q_scores, dear, max_width=4).widths(_frontier(q)) == [0]
    slow = CostCurve([1, 64], [10.0, 10.5], [0.5, 0.5], policy_ms=30.0)  # a level's host work
    assert not can_pay(slow, 8) and not GrowPolicy(q_scores, slow).drafts(100)


def test_a_long_context_with_dear_rows_drafts_nothing():
    assert GrowPolicy(q_scores, SHORT_ONLY).drafts(12)
    assert not GrowPolicy(q_scores, SHORT_ONLY).drafts(40)


def _mixed(stats_list):
    """Rounds with a tree and rounds without one, beyond a head's first (prompt) round."""
    sizes = sum((s.tree_sizes for s in stats_list), start=type(stats_list[0].tree_sizes)())
    return sizes[0] > 2 * len(stats_list) and sum(v for k, v in sizes.items() if k > 0) > 0, sizes


def _grow(curve):
    return GrowPolicy(q_scores, curve, max_width=3, max_nodes=12)


PROMPTS = [[1, 2, 3], [5, 9], [7, 7, 7, 1]]
N = 30


@pytest.fixture(scope="module")
def model_pair():
    target = tiny_llama(0, scale=40)
    return target, noisy_copy(target, 0.005)


@pytest.mark.parametrize("pair", ["model_pair", "feature_pair"])
def test_greedy_equals_ar_with_plain_and_drafted_rounds(pair, request):
    target, draft = request.getfixturevalue(pair)
    cfg = StrategyConfig(strategy="ti-mcsd", width=3, depth=4, stop="confidence", confidence_rule="grow",
                         max_nodes=12)
    stats = []
    for prompt in PROMPTS:
        eng = build_engine(target, draft, cfg, SamplingConfig(), stop=_grow(SHORT_ONLY))
        got, st = eng.generate(prompt, N)
        assert got == ar_output(target, prompt, N)
        stats.append(st)
    ok, sizes = _mixed(stats)
    assert ok and sum(s.accepted for s in stats) > 0, sizes


@pytest.mark.parametrize("pair", ["model_pair", "feature_pair"])
@pytest.mark.parametrize("mode", ["own", "joint"])
def test_batched_greedy_equals_ar_with_plain_and_drafted_rounds(pair, mode, request):
    target, draft = request.getfixturevalue(pair)
    layout = layout_from_k_config((3, 1, 1, 1))
    stats = []
    for prompt in PROMPTS:  # one request at a time: the round's gate is the policy's (or the budget's)
        eng = BatchEngine(target, draft, layout, stop=lambda: copy.deepcopy(_grow(SHORT_ONLY))) if mode == "own" \
            else BatchEngine(target, draft, layout, budget=JointGrow(q_scores, SHORT_ONLY, max_width=3, max_nodes=12))
        r = eng.add(prompt, N)
        eng.run()
        assert r.out == ar_output(target, prompt, N)
        stats.append(r.stats)
    ok, sizes = _mixed(stats)
    assert ok and sum(s.accepted for s in stats) > 0, sizes


def test_the_gate_says_how_many_plain_rounds_come_before_its_look():
    """After each skipped round, lookahead() is at most the plain rounds before the next look
    (exactly that, give or take the round a fractional spacing rounds up), and 0 while drafting."""
    gate = DraftGate(warmup=1, explore_every=4)
    gate.record(1, 64, [2] + [64] * 10, 640)  # far behind: a look every 33rd round
    went, ahead = [], []
    for _ in range(70):
        went.append(gate.drafts(PAYS))
        ahead.append(gate.lookahead())
    looks = [i for i, go in enumerate(went) if go]
    assert looks == [32, 65]
    for i, a in enumerate(ahead[:66]):
        nxt = next(j for j in looks if j >= i)
        assert a == (0 if i == nxt else nxt - i - 1)
    assert DraftGate().lookahead() == 0
    never = DraftGate()
    never.drafts(NEVER)
    assert never.lookahead() == never.max_every  # a curve that cannot pay: until the context moves


class _EveryNth(GrowPolicy):
    """Drafts every `period`-th round and says so ahead (lookahead), as a closed gate does."""

    def __init__(self, period, *a, **kw):
        super().__init__(*a, **kw)
        self.period, self.i = period, -1

    def drafts(self, context):
        self.i += 1
        self._round = {}
        return self.i % self.period == self.period - 1

    def lookahead(self):
        return self.period - 2 - self.i % self.period


def test_a_feature_head_skips_features_far_from_a_draft_and_drafts_again(feature_pair, monkeypatch):
    """Plain rounds far from the next draft capture no target features (a gap); the FEATURE_LEAD
    rounds before it do, the head drafts from them (accepted nodes), and the text stays ar's."""
    from decoding.drafts import feature_proposer as fp

    target, draft = feature_pair
    monkeypatch.setattr(fp, "FEATURE_LEAD", 2)
    captures = []
    real = fp.capture_aux
    monkeypatch.setattr(fp, "capture_aux", lambda *a: captures.append(1) or real(*a))
    cfg = StrategyConfig(strategy="ti-mcsd", width=3, depth=4, stop="confidence", confidence_rule="grow",
                         max_nodes=12)
    accepted, rounds = 0, 0
    for prompt in PROMPTS:
        pol = _EveryNth(6, q_scores, PAYS, max_width=3, max_nodes=12)
        eng = build_engine(target, draft, cfg, SamplingConfig(), stop=pol)
        behind = []
        pol.timed = lambda drafted, ms, b=0.0, seen=behind: seen.append(b) if drafted else None
        got, st = eng.generate(prompt, 60)
        assert max(behind) > 0  # the look after a gap caught the head up on 2 entries
        assert got == ar_output(target, prompt, 60)
        accepted, rounds = accepted + st.accepted, rounds + st.rounds
    # of every 6 rounds: 3 gaps, 2 captured plain rounds and the drafted one
    assert accepted > 0 and len(captures) < 0.6 * rounds, (accepted, len(captures), rounds)


def test_sampling_stays_exact_with_feature_gaps(tiny_pair, monkeypatch):
    """Rounds that capture no features (a gap), rounds that capture, and drafted rounds after
    them, in every phase across requests: the sampled continuations keep the target's law."""
    from support.exact import SAMPLES, T1, chi2_pvalue, exact_distribution, speculative_counts
    from decoding.drafts import feature_proposer as fp

    target, draft = tiny_pair
    monkeypatch.setattr(fp, "FEATURE_LEAD", 1)
    cfg = StrategyConfig(strategy="ti-mcsd", width=2, depth=2, stop="confidence", confidence_rule="grow",
                         max_nodes=4)
    pol = _EveryNth(3, q_scores, PAYS, max_width=2, max_nodes=4)  # gap, capture, draft, in turn
    eng = build_engine(target, draft, cfg, T1, stop=pol)
    counts, depths, _ = speculative_counts(eng, SAMPLES)
    assert sum(v for d, v in depths.items() if d >= 1) > 0.05 * SAMPLES
    pvalue = chi2_pvalue(counts, exact_distribution(target, T1), SAMPLES)
    assert pvalue > 1e-3, f"p={pvalue:.2e}"
