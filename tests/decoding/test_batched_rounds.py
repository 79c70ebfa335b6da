"""Batched speculative rounds (decoding.batch): several requests verified in ONE target forward
change no request's greedy output, and a request that leaves frees its own cache and nothing else.
That the lean forward gives each request's rows the bits of its batch-1 rows:
test_batched_stacked_rows.py."""

import copy
import gc
import weakref

import pytest
import torch

from decoding.batch.budget import JointGrow, merged_order
from decoding.batch.scheduler import BatchEngine
from decoding.forward.cost import CostCurve
from decoding.forward.packed import set_forward
from decoding.growth import q_scores
from decoding.options import fork_k_config
from decoding.sampling import SamplingConfig
from decoding.stopping import DraftConfidence
from decoding.strategies import StrategyConfig, build_engine
from decoding.tree import layout_from_k_config
from support.models import noisy_copy

GREEDY = SamplingConfig()
PROMPTS = [[1, 5, 7, 3], [2], [9, 9, 9, 4, 4, 4, 11, 30, 17], [6, 2, 8, 1, 12, 3, 3]]
JOIN = [0, 1, 3, 4]  # the round at which request i joins
N = 24
COST = CostCurve([1, 8, 16, 64], [10.0, 11.0, 13.0, 30.0], [1.0, 1.1, 1.2, 2.0])
"""A synthetic cost curve: rows nearly free up to 16, dearer above (the shape measured on CPUs).
The tiny pair is conftest's `pair`: a sharp random Llama and a noisy copy of it as the draft."""


@pytest.fixture(scope="module", params=["eager", "packed", "lean"])
def forward_pair(pair, request):
    """The pair on the reference forward (eager), on packed linears (the reference layer body
    over them) and on the lean layers."""
    if request.param == "eager":
        return pair
    out = tuple(copy.deepcopy(m) for m in pair)
    for m in out:
        assert set_forward(m, request.param) == request.param
    return out


def run_batched(engine, prompts, joins, n=N):
    """Requests join at their rounds; every output once all have finished."""
    reqs: dict[int, object] = {}
    while len(reqs) < len(prompts) or engine.active:
        for i, (p, j) in enumerate(zip(prompts, joins)):
            if i not in reqs and engine.rounds >= j:
                reqs[i] = engine.add(p, n)
        engine.step()
    return [reqs[i] for i in range(len(prompts))]


LAYOUT = layout_from_k_config(fork_k_config(3, 4))


def engines(target, draft):
    """name -> a fresh BatchEngine: independent fixed trees, independent confidence-stopped trees,
    the joint budget over q and over a decider (a random one reading the draft's hidden state: its
    scores swing from round to round), plain batched decoding."""
    from support.engine import random_decider

    decider = random_decider("tree", 0.0, kind="hybrid", hidden_size=target.config.hidden_size)
    return {
        "fixed": BatchEngine(target, draft, LAYOUT),
        "confidence": BatchEngine(target, draft, LAYOUT, stop=lambda: DraftConfidence(0.5)),
        "joint": BatchEngine(target, draft, LAYOUT, budget=JointGrow(q_scores, COST, max_width=3)),
        "joint-decider": BatchEngine(target, draft, LAYOUT, budget=JointGrow(
            decider.scores, COST, max_width=3, label="decider", needs_hidden=True)),
        "ar": BatchEngine(target, None),
    }


@pytest.mark.parametrize("clients", [1, 2, 4])
@pytest.mark.parametrize("kind", ["fixed", "confidence", "joint", "joint-decider", "ar"])
def test_greedy_equals_batch1_and_ar(forward_pair, clients, kind):
    """1, 2, 4 requests of different prompt lengths joining at different rounds: each request's
    output equals plain `ar` greedy and its batch-1 engine's (decoding.engine) token for token."""
    target, draft = forward_pair
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    one = build_engine(target, draft, StrategyConfig(strategy="ti-mcsd", width=3, depth=4), GREEDY)
    prompts, joins = PROMPTS[:clients], JOIN[:clients]
    reqs = run_batched(engines(target, draft)[kind], prompts, joins)
    for p, r in zip(prompts, reqs):
        want = ar.generate(p, N)[0]
        assert r.out == want
        if kind == "fixed":  # the same trees as batch-1: the same rounds
            out, stats = one.generate(p, N)
            assert out == want and r.stats.accepted_lengths == stats.accepted_lengths
        assert r.stats.new_tokens == N and r.cache is None  # done: left, its cache dropped


def test_joint_budget_shares_rows_and_speculates(pair):
    """The joint budget drafts (some rounds accept draft tokens) and never verifies more rows than
    its cap; every round's forward carries every active request."""
    target, draft = pair
    eng = BatchEngine(target, draft, LAYOUT, budget=JointGrow(q_scores, COST, max_width=3, max_rows=20))
    reqs = run_batched(eng, PROMPTS, [0, 0, 0, 0])
    assert all(r.stats.accepted > 0 for r in reqs)
    assert max(list(eng.verify_rows)[1:]) <= 20 and min(list(eng.verify_rows)[1:]) >= 4


def test_merged_order_keeps_each_request_s_prefix():
    keys = [[0.9, 0.5, 0.1], [0.7, 0.7, 0.0]]
    order = merged_order(keys, [[0, 1, 2], [0, 1, 0]], [[0, 0, 0], [0, 0, 1]], room=[2, 5])
    assert order == [(0, 0), (1, 0), (1, 1), (0, 1)]  # request 0 capped at 2; worthless left out


def test_the_joint_budget_spends_rows_where_they_pay():
    """Two requests' first levels: a confident q (0.9 on one token) and a flat one (0.125 on 8);
    with rows at 2 ms each the confident request gets its one child, the flat one none."""
    from decoding.stopping import Frontier

    steep = CostCurve([1, 64], [12.0, 138.0], [1.0, 1.0])
    q_a = torch.zeros(1, 32)
    q_a[0, :3] = torch.tensor([0.9, 0.05, 0.05])
    q_b = torch.zeros(1, 32)
    q_b[0, :8] = 0.125
    fr = [Frontier(depth=1, nodes=[-1], q=q, path_logq=[0.0], valid=[True], size=0) for q in (q_a, q_b)]
    budget = JointGrow(q_scores, steep, max_width=4)
    budget.begin([1, 1], [True, True])
    assert budget.widths(fr) == [[1], [0]]
    cheap = JointGrow(q_scores, COST, max_width=4)  # rows nearly free: the flat request's pay too
    cheap.begin([1, 1], [True, True])
    a, b = cheap.widths(fr)
    assert a[0] >= 1 and b[0] >= 1


def test_round_cost_grows_past_the_curve():
    """Read at a round's total rows, the curve keeps its last slope past its largest size."""
    from decoding.batch.budget import RoundCost

    rc = RoundCost(CostCurve([1, 32, 64], [10.0, 12.0, 20.0], [1.0, 1.0, 1.0]))
    assert rc.target(64) == 20.0 and rc.target(96) == pytest.approx(28.0) and rc.target(8) < 12.0


def test_leaving_frees_only_its_own_cache(pair):
    """A request removed mid-run: its KV cache is freed (no reference left), the others' caches
    are not touched (same tensors, same values) and they finish with ar's output."""
    target, draft = pair
    eng = BatchEngine(target, draft, LAYOUT)
    reqs = [eng.add(p, N) for p in PROMPTS[:3]]
    eng.step()
    eng.step()
    gone = weakref.ref(reqs[1].cache.cache)
    keys = weakref.ref(reqs[1].cache.cache.layers[0].keys)
    before = [[(lay.keys.clone(), lay.values.clone(), lay.keys.data_ptr()) for lay in r.cache.cache.layers]
              for r in (reqs[0], reqs[2])]
    eng.remove(reqs[1])
    gc.collect()
    assert gone() is None and keys() is None and reqs[1] not in eng.active
    for r, b in zip((reqs[0], reqs[2]), before):
        for lay, (k, v, ptr) in zip(r.cache.cache.layers, b):
            assert lay.keys.data_ptr() == ptr and torch.equal(lay.keys, k) and torch.equal(lay.values, v)
    eng.run()
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    assert reqs[0].out == ar.generate(PROMPTS[0], N)[0] and reqs[2].out == ar.generate(PROMPTS[2], N)[0]
    assert len(reqs[1].out) < N


def test_eos_and_max_tokens_end_a_request_alone(pair):
    """One request stops at its EOS, another at its max_new_tokens; the third runs on."""
    target, draft = pair
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    ref = ar.generate(PROMPTS[0], N)[0]
    eng = BatchEngine(target, draft, LAYOUT)
    a = eng.add(PROMPTS[0], N, eos_token_id=ref[5])
    b = eng.add(PROMPTS[1], 3)
    c = eng.add(PROMPTS[2], N)
    eng.run()
    assert a.out == ref[: ref.index(ref[5]) + 1]
    assert len(b.out) == 3 and len(c.out) == N


@pytest.fixture(scope="module")
def head_pair():
    from support.head import fit_head
    from support.models import tiny_llama

    target = tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6)
    return target, fit_head(target)


@pytest.mark.parametrize("kind", ["eager", "lean"])
def test_a_feature_head_reads_its_own_rows_of_the_stacked_forward(head_pair, kind):
    """An EAGLE-3 head reads the target's features of ITS request's rows from the stacked verify
    (Segment.capture): with the batch-1 engine's trees, each request accepts exactly what it
    accepts alone (a mix-up of rows would keep the output, lossless, but not the acceptance), and
    the joint budget keeps the output too."""
    target, head = head_pair
    if kind == "lean":
        target = copy.deepcopy(target)
        assert set_forward(target, "lean") == "lean"
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    one = build_engine(target, head, StrategyConfig(strategy="ti-mcsd", width=3, depth=4), GREEDY)
    prompts = [[1, 5, 7], [2, 8], [9, 9, 4, 4, 11, 30, 17]]
    for budget in (None, JointGrow(q_scores, COST, max_width=3)):
        reqs = run_batched(BatchEngine(target, head, LAYOUT, budget=budget), prompts, [0, 1, 3])
        for p, r in zip(prompts, reqs):
            assert r.out == ar.generate(p, N)[0]
            assert r.stats.accepted > 0
            if budget is None:
                assert r.stats.accepted_lengths == one.generate(p, N)[1].accepted_lengths


@pytest.mark.parametrize("arch,kind", [("qwen3", "eager"), ("qwen3", "lean"), ("qwen2+window", "lean"),
                                       ("mistral+window", "eager"), ("gemma3+window", "eager")])
def test_other_families_stack_or_go_one_by_one(arch, kind):
    """Qwen3 (per-head q/k norms) stacks on both layer bodies; a sliding window is fed one
    request at a time (forward.stackable says why). Either way each output equals ar's."""
    from decoding.batch.forward import stackable
    from support.models import tiny

    target = tiny(arch, 0, scale=6)
    draft = noisy_copy(target, 0.003)
    if kind == "lean":
        for m in (target, draft):
            set_forward(m, "lean")
    assert (stackable(target) is None) == (arch == "qwen3")
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    reqs = run_batched(BatchEngine(target, draft, LAYOUT), PROMPTS[:3], JOIN[:3], n=16)
    assert [r.out for r in reqs] == [ar.generate(p, 16)[0] for p in PROMPTS[:3]]
    assert sum(r.stats.accepted for r in reqs) > 0


def test_a_consumer_that_fails_ends_only_its_request(pair):
    """on_tokens raising (a client gone mid-stream) ends that request with the error kept and its
    caches dropped; the round's other requests commit as usual and finish with ar's output."""
    target, draft = pair
    seen = []

    def gone(tokens):
        seen.append(tokens)
        if len(seen) == 2:
            raise ConnectionError("client left")

    eng = BatchEngine(target, draft, LAYOUT)
    a = eng.add(PROMPTS[0], N)
    b = eng.add(PROMPTS[1], N, on_tokens=gone)
    c = eng.add(PROMPTS[2], N)
    eng.run()
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    assert isinstance(b.error, ConnectionError) and b.cache is None and len(seen) == 2
    assert a.out == ar.generate(PROMPTS[0], N)[0] and c.out == ar.generate(PROMPTS[2], N)[0]


def test_one_request_under_the_joint_budget_grows_growth_s_trees(pair):
    """With one request (a one-token prompt: one pending row, as growth.py assumes) the joint
    rule IS the grow rule: round by round the same trees as GrowPolicy's on the batch-1 engine."""
    from decoding.stopping.gate import DraftGate
    from decoding.growth import GrowPolicy

    target, draft = pair
    cost = CostCurve([1, 8, 16, 64], [10.0, 11.0, 14.0, 40.0], [0.3, 0.3, 0.4, 0.5])
    score = lambda level: 0.5 + 0.5 * q_scores(level)  # above q: trees of several shapes
    always = lambda: DraftGate.held_open()  # every round drafts: the trees' sizing is compared
    one = build_engine(target, draft, StrategyConfig(strategy="ti-mcsd", width=3, depth=4), GREEDY,
                       stop=GrowPolicy(score, cost, max_width=3, gate=always()))
    solo_trees = []
    one.observer = lambda tree, logits, out, pos: solo_trees.append(tree.layout.parents)
    one.generate([2], N)
    eng = BatchEngine(target, draft, LAYOUT, budget=JointGrow(score, cost, max_width=3, gate=always()))
    trees = []
    propose = eng._propose
    eng._propose = lambda reqs: [trees.append(t.layout.parents) or t for t in propose(reqs)]
    run_batched(eng, [[2]], [0])
    assert [t for t in trees if t] == solo_trees and len(set(solo_trees)) >= 3


class _NeverDrafts:
    """A measured choice that always says plain, and counts what it was asked."""

    def __init__(self):
        self.asked = []

    def drafts(self, n, explore=True):
        self.asked.append(n)
        return False

    def record(self, *a):
        pass

    def lookahead(self):
        return 0


def test_one_request_drafts_every_round_whatever_the_measured_choice(pair):
    """Alone, a request drafts as the batch-1 engine does (its rounds are not the measured choice's
    to make); with another beside it the choice decides."""
    target, draft = pair
    m = _NeverDrafts()
    eng = BatchEngine(target, draft, LAYOUT, budget=JointGrow(q_scores, COST, max_width=3), measured=m)
    alone = eng.add(PROMPTS[0], 8)
    while eng.active:
        eng.step()
    assert m.asked == [] and alone.stats.drafted > 0
    reqs = [eng.add(p, 8) for p in PROMPTS[:2]]
    eng.step()
    assert m.asked == [2] and all(r.stats.drafted == 0 for r in reqs)


def test_measured_rounds_stay_lossless_and_the_head_drafts_after_plain_rounds(head_pair):
    """A joint budget whose rounds are sometimes plain (no tree): each output equals ar's, and a
    feature head that skipped rounds still drafts (its features were taken in)."""
    from decoding.batch.measured import MeasuredChoice

    target, head = head_pair
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    prompts = [[1, 5, 7], [2, 8], [9, 9, 4, 4, 11, 30, 17]]
    m = MeasuredChoice(warmup=2, explore_every=3)
    eng = BatchEngine(target, head, LAYOUT, budget=JointGrow(q_scores, COST, max_width=3), measured=m)
    reqs = run_batched(eng, prompts, [0, 1, 3])
    for p, r in zip(prompts, reqs):
        assert r.out == ar.generate(p, N)[0]
    assert sum(r.stats.accepted for r in reqs) > 0
    assert any(k[1] for k in m.timed) and any(not k[1] for k in m.timed)


class _EveryNth:
    """A measured choice that drafts every `period`-th round and says so ahead (lookahead)."""

    def __init__(self, period):
        self.period, self.i = period, -1

    def drafts(self, n, explore=True):
        self.i += 1
        return self.i % self.period == self.period - 1

    def lookahead(self):
        return self.period - 2 - self.i % self.period

    def record(self, *a):
        pass


def test_plain_rounds_far_from_a_look_capture_no_features(head_pair, monkeypatch):
    """Batched plain rounds far from the next drafted one capture no target features (a gap);
    the FEATURE_LEAD rounds before it do, the heads draft from them (accepted nodes), and each
    output stays ar's."""
    from decoding.drafts import feature_proposer as fp

    target, head = head_pair
    monkeypatch.setattr(fp, "FEATURE_LEAD", 2)
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    prompts = [[1, 5, 7], [2, 8], [9, 9, 4, 4, 11, 30, 17]]
    eng = BatchEngine(target, head, LAYOUT, budget=JointGrow(q_scores, COST, max_width=3), measured=_EveryNth(6))
    seen = []
    capture = eng._capture
    eng._capture = lambda r: seen.append(bool(capture(r))) or capture(r)
    reqs = run_batched(eng, prompts, [0, 0, 0], n=40)
    for p, r in zip(prompts, reqs):
        assert r.out == ar.generate(p, 40)[0]
    assert sum(r.stats.accepted for r in reqs) > 0
    assert 0.3 < seen.count(False) / len(seen) < 0.7, seen  # of every 6 rounds, 3 gaps
