"""Trace collection: labels, resume, sharding, and features identical to inference."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from conftest import noisy_copy, tiny_llama
from decoding.decider import DeciderConfig, DeciderNet, DeciderStop
from decoding.features import node_features
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine
from training import collect as C
from training.corpus import Prompt
from training.replay import CostModel, Round, baseline_table, replay, rounds_of, fixed, oracle
from training.traces import feature_matrix, load_traces


class StubSession:
    def __init__(self, target, draft):
        self.target, self.draft, self.eos_token_id = target, draft, None

    def encode(self, text, chat=True, max_new_tokens=0, tree_depth=0):
        return [3 + (ord(c) % 20) for c in text]


@pytest.fixture(scope="module")
def session():
    target = tiny_llama(0, scale=6)
    return StubSession(target, noisy_copy(target, 0.05))


PROMPTS = [Prompt(f"p{i}", "general", "val", f"prompt number {i} {'x' * i}") for i in range(6)]


def cfg(tmp_path, **kw):
    base = dict(out=str(tmp_path / "traces"), strategy="ti-mcsd", width=3, depth=4,
                max_new_tokens=12, shard_size=2, dtype="float32")
    return C.CollectConfig(**{**base, **kw})


def sorted_rows(table: pa.Table) -> list:
    rows = table.to_pylist()
    return sorted(rows, key=lambda r: (r["prompt_id"], r["round"], r["node"]))


def test_labels_are_consistent(tmp_path, session):
    C.collect(cfg(tmp_path), session, PROMPTS, progress=False)
    m, t = load_traces(tmp_path / "traces")
    assert m["collect"]["width"] == 3 and "target" in m["model_pair"]
    rows = t.to_pylist()
    assert rows and all(0.0 <= r["soft_label"] <= 1.0 for r in rows)
    for r in rows:
        if r["accepted"]:
            assert r["greedy_match"]  # greedy: accepted nodes match argmax p
    by_round = {}
    for r in rows:
        by_round.setdefault((r["prompt_id"], r["round"]), []).append(r)
    for group in by_round.values():
        assert sum(r["accepted"] for r in group) == group[0]["round_accepted"]
        assert max(r["depth"] for r in group) == group[0]["round_depth"] == 4


def test_resume_after_interruption_gives_same_traces(tmp_path, session, monkeypatch):
    full = tmp_path / "full"
    C.collect(cfg(tmp_path, out=str(full)), session, PROMPTS, progress=False)
    calls = {"n": 0}
    real = C.build_engine

    def crashing(*a, **k):
        eng = real(*a, **k)
        gen = eng.generate

        def generate(*a2, **k2):
            calls["n"] += 1
            if calls["n"] == 4:  # dies in the middle of the second shard
                raise KeyboardInterrupt
            return gen(*a2, **k2)
        eng.generate = generate
        return eng

    monkeypatch.setattr(C, "build_engine", crashing)
    part = tmp_path / "part"
    with pytest.raises(KeyboardInterrupt):
        C.collect(cfg(tmp_path, out=str(part)), session, PROMPTS, progress=False)
    monkeypatch.setattr(C, "build_engine", real)
    assert len(load_traces(part)[0]["shards"]) == 1
    C.collect(cfg(tmp_path, out=str(part)), session, PROMPTS, progress=False)
    assert sorted_rows(load_traces(part)[1]) == sorted_rows(load_traces(full)[1])


def test_sharded_collection_merges(tmp_path, session):
    C.collect(cfg(tmp_path, out=str(tmp_path / "one")), session, PROMPTS, progress=False)
    for i in range(2):
        C.collect(cfg(tmp_path, out=str(tmp_path / "two"), shard_index=i, num_shards=2),
                  session, PROMPTS, progress=False)
    assert sorted_rows(load_traces(tmp_path / "two")[1]) == sorted_rows(load_traces(tmp_path / "one")[1])


def test_features_identical_in_collection_and_inference(tmp_path, session):
    C.collect(cfg(tmp_path, max_new_tokens=10), session, PROMPTS[:2], progress=False)
    _, t = load_traces(tmp_path / "traces")
    recorded = feature_matrix(t.filter(pa.compute.equal(t.column("prompt_id"), "p1")))

    seen = []

    class Spy(DeciderStop):
        def should_stop(self, level):
            seen.append(node_features(level))
            return super().should_stop(level)

    dcfg = DeciderConfig(kind="mlp11", threshold=-1.0)  # never stops: same trees as collection
    spy = Spy(DeciderNet(dcfg), dcfg)
    eng = build_engine(session.target, session.draft,
                       StrategyConfig(strategy="ti-mcsd", width=3, depth=4, stop="decider"),
                       SamplingConfig(), stop=spy)
    ids = session.encode(PROMPTS[1].text)
    eng.generate(ids, 10, None, C.prompt_seed(0, "p1"))
    assert np.array_equal(torch.cat(seen).numpy(), recorded)


def test_wrong_schema_is_refused(tmp_path, session):
    C.collect(cfg(tmp_path), session, PROMPTS[:1], progress=False)
    mf = tmp_path / "traces" / "manifest.json"
    mf.write_text(mf.read_text().replace('"schema_version": 1', '"schema_version": 99'))
    with pytest.raises(ValueError, match="schema version"):
        load_traces(tmp_path / "traces")
    with pytest.raises(ValueError, match="not a trace directory"):
        load_traces(tmp_path)


def test_replay_closed_form():
    cost = CostModel(sizes=[1, 64], target_ms=[10.0, 10.0], draft_ms=[1.0, 1.0], overhead_ms=0.0)
    # two rounds of a chain of depth 3: one accepts 3 tokens, one accepts none
    rounds = [Round([1, 1, 1], 3, [np.array([0]), np.array([1]), np.array([2])]),
              Round([1, 1, 1], 0, [np.array([3]), np.array([4]), np.array([5])])]
    r3 = replay(rounds, fixed(3), cost)
    assert r3["tokens_per_round"] == (4 + 1) / 2
    assert r3["tokens_per_s"] == pytest.approx(1000 * 5 / (2 * (3 * 1 + 10)))
    o = replay(rounds, oracle, cost)  # depth 3 then depth 1
    assert o["tokens_per_s"] == pytest.approx(1000 * 5 / ((3 + 10) + (1 + 10)))
    valid = np.ones(6, bool)
    feats = np.zeros((6, 17), np.float32)
    table = baseline_table(rounds, feats, valid, cost)
    assert table["oracle"]["tokens_per_s"] >= max(table[f"fixed-{d}"]["tokens_per_s"] for d in (1, 2, 3))


def test_rounds_of_groups_levels(tmp_path, session):
    C.collect(cfg(tmp_path), session, PROMPTS[:2], progress=False)
    _, t = load_traces(tmp_path / "traces")
    rounds = rounds_of(t)
    depth = t.column("depth").to_numpy()
    for r in rounds:
        assert r.level_sizes == [3, 3, 3, 3]
        for d, rows in enumerate(r.levels, 1):
            assert (depth[rows] == d).all()
