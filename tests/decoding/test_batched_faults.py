"""Per-request fault isolation in batched rounds: a fault in one request's draft, verify, accept or
commit, injected at a round in the middle, ends that request alone (it leaves with its error and its
caches); the other three finish, greedy with exactly the text they write alone, sampled with their
whole budget."""

import pytest

from decoding.batch import scheduler as S
from decoding.batch.budget import JointGrow
from decoding.batch.prefill import ChunkSizer
from decoding.batch.scheduler import BatchEngine
from decoding.forward.cost import CostCurve
from decoding.growth import q_scores
from decoding.options import fork_k_config
from decoding.run_stats import RunStats
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine
from decoding.tree import layout_from_k_config
from decoding.tree_proposer import TreeProposer

PROMPTS = [[1, 5, 7, 3], [2, 4], [9, 9, 9, 4, 4, 4, 11], [6, 2, 8, 1, 12]]
BAD = 2  # the request the fault hits
N = 20
FAULT_ROUND = 3
LAYOUT = layout_from_k_config(fork_k_config(2, 3))
COST = CostCurve([1, 8, 16, 64], [10.0, 11.0, 13.0, 30.0], [1.0, 1.1, 1.2, 2.0])


def _is_bad(committed) -> bool:
    return list(committed[:len(PROMPTS[BAD])]) == PROMPTS[BAD]


def inject(monkeypatch, phase: str, engine: BatchEngine) -> None:
    """From round FAULT_ROUND on, the bad request's `phase` raises (every time: a fault of its own)."""
    late = lambda: engine.rounds >= FAULT_ROUND  # noqa: E731

    def boom():
        raise RuntimeError(f"injected {phase} fault")

    if phase == "draft":
        propose, drafting = TreeProposer.propose, S.Drafting

        def faulty(self, committed, *a, **k):
            if late() and _is_bad(committed):
                boom()
            return propose(self, committed, *a, **k)
        monkeypatch.setattr(TreeProposer, "propose", faulty)
        monkeypatch.setattr(S, "Drafting", lambda proposer, committed, *a: boom() if late() and _is_bad(committed)
                            else drafting(proposer, committed, *a))
    elif phase == "verify":
        verify = S.verify_many
        monkeypatch.setattr(S, "verify_many", lambda target, segs: boom() if late() and any(
            _is_bad(s.committed) for s in segs) else verify(target, segs))
    elif phase == "accept":
        decide = S.decide

        def faulty_decide(tree, logits, sampling, replacement, gen):
            if late() and gen is engine.bad.gen:
                boom()
            return decide(tree, logits, sampling, replacement, gen)
        monkeypatch.setattr(S, "decide", faulty_decide)
    else:  # commit: after the cache moved and the output grew, before the round is recorded
        add_round = RunStats.add_round

        def faulty_add(self, *a):
            if late() and self is engine.bad.stats:
                boom()
            return add_round(self, *a)
        monkeypatch.setattr(RunStats, "add_round", faulty_add)


def alone(pair, prompt, sampling):
    target, draft = pair
    eng = build_engine(target, draft, StrategyConfig("ti-mcsd", width=2, depth=3), sampling)
    return eng.generate(prompt, N)[0]


@pytest.mark.parametrize("budget", ["independent", "joint"])
@pytest.mark.parametrize("phase", ["draft", "verify", "accept", "commit"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "sampled"])
def test_a_fault_ends_its_request_alone(pair, monkeypatch, phase, budget, sampling):
    target, draft = pair
    engine = BatchEngine(target, draft, LAYOUT,
                         budget=JointGrow(q_scores, COST, max_width=2) if budget == "joint" else None)
    reqs = [engine.add(p, N, sampling, seed=i) for i, p in enumerate(PROMPTS)]
    engine.bad = reqs[BAD]
    inject(monkeypatch, phase, engine)
    while engine.active:
        engine.step()
    bad = reqs[BAD]
    assert engine.failed == [bad] and f"injected {phase} fault" in str(bad.error)
    assert bad.cache is None and bad.proposer is None  # its caches went with it
    for i, r in enumerate(reqs):
        if i == BAD:
            continue
        assert r.error is None and len(r.out) == N
        if sampling.greedy:
            assert r.out == alone(pair, PROMPTS[i], sampling)


@pytest.mark.parametrize("chunk", ["fixed", "auto"])
@pytest.mark.parametrize("phase", ["verify", "commit"])
def test_a_fault_ends_its_request_alone_when_prompts_go_in_chunks(pair, monkeypatch, phase, chunk):
    """Rebuilt requests longer than a chunk (the bad one among them) refill alone before their own
    round, so the bad one fails there instead of tripping every later round and rebuilding all
    (auto: the most a request alone takes is 3 tokens)."""
    target, draft = pair
    engine = BatchEngine(target, draft, LAYOUT, chunk=3 if chunk == "fixed" else
                         ChunkSizer(lo=1, first=2, hi=3, probe_every=2, whole=0))
    reqs = [engine.add(p, N, SamplingConfig(), seed=i) for i, p in enumerate(PROMPTS)]
    engine.bad = reqs[BAD]
    inject(monkeypatch, phase, engine)
    for _ in range(10 * N):
        if not engine.active:
            break
        engine.step()
    assert engine.active == [] and engine.failed == [reqs[BAD]]
    for i, r in enumerate(reqs):
        if i != BAD:
            assert r.error is None and r.out == alone(pair, PROMPTS[i], SamplingConfig())


def test_a_request_that_ended_in_the_round_that_raised_stays_ended(pair, monkeypatch):
    """Plain rounds (one token each): request 0 meets its end-of-sequence token in the round the bad
    request's commit raises in, before that commit; it leaves then, and is not run on past it."""
    target, _ = pair
    solo = BatchEngine(target)
    ref = solo.add(PROMPTS[0], N)
    solo.run()
    eos = ref.out[FAULT_ROUND]  # committed in the round that raises
    assert eos not in ref.out[:FAULT_ROUND]
    engine = BatchEngine(target)
    reqs = [engine.add(p, N, eos_token_id=eos if i == 0 else None, seed=i) for i, p in enumerate(PROMPTS)]
    engine.bad = reqs[BAD]
    inject(monkeypatch, "commit", engine)
    finished = []
    while engine.active:
        finished += engine.step()
    assert reqs[0].out == ref.out[:FAULT_ROUND + 1] and reqs[0] in finished
    assert engine.failed == [reqs[BAD]]


def test_a_fault_leaves_no_cache_behind_without_a_garbage_collection(pair, monkeypatch):
    """The failed request's error keeps no frame of the rounds that raised (those frames hold every
    request's old caches, which a cycle through the request would keep until a full collection)."""
    import gc
    import weakref

    target, draft = pair
    engine = BatchEngine(target, draft, LAYOUT)
    reqs = [engine.add(p, N, SamplingConfig(), seed=i) for i, p in enumerate(PROMPTS)]
    engine.bad = reqs[BAD]
    inject(monkeypatch, "commit", engine)
    gc.collect()
    gc.disable()
    try:
        while engine.rounds < FAULT_ROUND:
            engine.step()
        caches = [weakref.ref(r.cache) for r in reqs]
        while engine.active:
            engine.step()
        bad, engine.failed = engine.failed[0], []
        assert "injected commit fault" in str(bad.error)
        del reqs, bad
        assert [c() for c in caches] == [None] * len(caches)
    finally:
        gc.enable()
