"""Traces of the server's job (training.decider.batched): prompts N at a time through batched rounds,
the joint grow budget over q sizing the trees; each request's rows carry its own prompt and logits."""

import pytest

from decoding.forward.cost import CostCurve
from decoding.growth import GrowPolicy, q_scores
from support.decider import StubSession
from support.models import noisy_copy, tiny_llama
from training.corpus.teacher import Prompt
from training.decider import collect as C
from training.decider.traces import load_traces

COST = CostCurve([1, 8, 16, 64], [10.0, 11.0, 13.0, 30.0], [1.0, 1.1, 1.2, 2.0])


class JointSession(StubSession):
    def grow_policy(self, cfg, decider=None, scorer=None):
        return GrowPolicy(q_scores, COST, max_width=cfg.width, max_nodes=16)


@pytest.fixture(scope="module")
def session():
    target = tiny_llama(0, scale=6)
    return JointSession(target, noisy_copy(target, 0.05))


PROMPTS = [Prompt(f"p{i}", "general", "val", f"prompt number {i} {'y' * (3 * i)}") for i in range(7)]


def collect(tmp_path, session, **kw):
    cfg = C.CollectConfig(**{**dict(out=str(tmp_path / "traces"), strategy="ti-mcsd", width=3, depth=4,
                                     max_new_tokens=12, shard_size=4, dtype="float32", batched=3), **kw})
    C.collect(cfg, session, PROMPTS, progress=False)
    return load_traces(tmp_path / "traces")


def test_each_request_is_labelled_by_its_own_logits(tmp_path, session):
    m, t = collect(tmp_path, session)
    assert m["collect"]["batched"] == 3 and m["collect"]["budget"] == "joint over q"
    rows = t.to_pylist()
    assert {r["prompt_id"] for r in rows} == {p.id for p in PROMPTS}
    # grouped by prompt in the prompts' order, rounds in order within a prompt
    keys = [(int(r["prompt_id"][1:]), r["round"]) for r in rows]
    assert keys == sorted(keys)
    rounds = {}
    for r in rows:
        rounds.setdefault((r["prompt_id"], r["round"]), []).append(r)
    for group in rounds.values():
        assert sum(r["accepted"] for r in group) == group[0]["round_accepted"]
        on_path = {r["node"] for r in group if r["accepted"]} | {-1}
        for r in group:
            # greedy: a node whose parent was accepted is accepted iff it is the target's argmax
            # there, read from the logits the observer got: another request's would disagree
            if r["parent"] in on_path and r["valid"]:
                assert r["accepted"] == r["greedy_match"], r
    # the budget sizes the trees: not every round drafts the full envelope
    assert min(len(g) for g in rounds.values()) < max(len(g) for g in rounds.values())


def test_batched_collection_resumes(tmp_path, session, monkeypatch):
    full = collect(tmp_path / "a", session)[1]
    real = C.batched.run_batched
    calls = {"n": 0}

    def dies_on_the_second_shard(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(C.batched, "run_batched", dies_on_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        collect(tmp_path / "b", session)
    monkeypatch.setattr(C.batched, "run_batched", real)
    assert len(load_traces(tmp_path / "b" / "traces")[0]["shards"]) == 1
    again = collect(tmp_path / "b", session)[1]
    assert again.to_pylist() == full.to_pylist()


def test_batched_needs_the_grow_budget(tmp_path):
    for bad in (dict(strategy="mcsd"), dict(every_position=True), dict(hidden=True)):
        with pytest.raises(ValueError, match="joint grow budget"):
            C.CollectConfig(out=str(tmp_path), batched=2, **bad)
    with pytest.raises(ValueError, match="batched must be"):
        C.CollectConfig(out=str(tmp_path), batched=-1)
