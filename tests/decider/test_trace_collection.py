"""Trace collection: labels, resume, sharding, and features identical to inference."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from support.decider import StubSession
from support.models import noisy_copy, tiny_llama
from decoding.decider.policy import DeciderConfig, DeciderNet, DeciderStop
from decoding.decider.features import node_features
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine
from training.decider import collect as C
from training.corpus.teacher import Prompt
from training.decider.replay import ReplaySet
from training.decider.traces import feature_matrix, load_traces


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
    first = C.collect(cfg(tmp_path, out=str(full)), session, PROMPTS, progress=False)
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
    again = C.collect(cfg(tmp_path, out=str(part)), session, PROMPTS, progress=False)  # nothing left to do
    assert again["new_prompts"] == 0 and again["new_acceptance_rate"] is None
    assert 0 < again["acceptance_rate"] == first["acceptance_rate"] == first["new_acceptance_rate"]


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


def test_replay_set_groups_rounds(tmp_path, session):
    C.collect(cfg(tmp_path), session, PROMPTS[:2], progress=False)
    _, t = load_traces(tmp_path / "traces")
    rs = ReplaySet(t)
    assert len(rs) == len(set(zip(t.column("prompt_id").to_pylist(), t.column("round").to_pylist())))
    # every round is a full 3-wide, 4-deep fork tree; parents sit one level up in the same round
    assert np.bincount(rs.rid).tolist() == [12] * len(rs)
    child = rs.parent_row >= 0
    assert (rs.depth[rs.parent_row[child]] == rs.depth[child] - 1).all()
    assert (rs.rid[rs.parent_row[child]] == rs.rid[child]).all()
    assert (rs.round_accepted[rs.rid] == t.column("round_accepted").to_numpy()).all()


@pytest.mark.parametrize("vocab", [6, 300])
def test_token_rank_matches_a_full_count(vocab):
    """The top-10 shortcut for token_rank equals counting over the whole distribution,
    for tokens inside and outside the top 10, with ties, and for vocabularies under 10."""
    from decoding.decider.features import FEATURE_NAMES
    from decoding.stopping import DraftLevel

    g = torch.Generator().manual_seed(vocab)
    q = torch.softmax(3 * torch.randn(3, vocab, generator=g), -1)
    q[1, :4] = q[1, 4]  # ties
    q = q / q.sum(-1, keepdim=True)
    parent_of = [0, 0, 1, 1, 2, 2]
    toks = [int(q[0].argmax()), int(q[0].argmin()), 0, 4, int(q[2].argsort()[vocab // 2]), 5 % vocab]
    level = DraftLevel(depth=1, nodes=list(range(6)), tokens=toks, valid=[True] * 6,
                       q_token=q[parent_of, toks], parent_q=q, parent_of=parent_of,
                       parent_nodes=[-1] * 6, branch=[0] * 6, path_logq=torch.zeros(6))
    rank = node_features(level)[:, FEATURE_NAMES.index("token_rank")]
    expect = [(q[p] > q[p, t]).sum().item() for p, t in zip(parent_of, toks)]
    assert rank.tolist() == expect


def test_every_position_walk_replays_the_engine_s_own_rounds(tmp_path, session):
    """Traces with a round at every position hold the same text as a normal run; walking them
    with the full tree's policy visits exactly the rounds the engine runs with that tree."""
    from collections import Counter

    from training.decider.replay import fixed

    C.collect(cfg(tmp_path, max_new_tokens=16), session, PROMPTS[:3], progress=False)
    C.collect(cfg(tmp_path, out=str(tmp_path / "walk"), max_new_tokens=16, every_position=True),
              session, PROMPTS[:3], progress=False)
    m, t = load_traces(tmp_path / "walk")
    assert m["collect"]["every_position"] is True
    assert not ReplaySet(load_traces(tmp_path / "traces")[1]).walks  # rounds only where a tree left off
    rs = ReplaySet(t)
    assert rs.walks
    engine = build_engine(session.target, session.draft, StrategyConfig(strategy="ti-mcsd", width=3, depth=4),
                          SamplingConfig())
    lengths = Counter()
    for p in PROMPTS[:3]:
        ids = session.encode(p.text)
        out, st = engine.generate(ids, 16, seed=C.prompt_seed(0, p.id))
        lengths += st.accepted_lengths
        engine.commit_limit = 1  # the same text, one token a round
        one, st1 = engine.generate(ids, 16, seed=C.prompt_seed(0, p.id))
        engine.commit_limit = None
        assert one == out and st1.rounds == len(out) and st.rounds < len(out)
    kept = fixed(4)(rs)
    acc = np.bincount(rs.rid[kept & rs.accepted], minlength=rs.rounds)
    walked = rs.visited(acc)
    assert Counter(acc[walked].tolist()) == lengths  # round by round, as the engine ran them


def test_max_prompts_says_what_it_kept(tmp_path, capsys):
    files = []
    for name, kind in (("chat", "general"), ("code", "code")):
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(f'{{"id": "{name}{i}", "kind": "{kind}", "prompt": "p{i}"}}\n' for i in range(4)))
        files.append(str(f))
    rc = C.main(["--prompt-files", *files, "--max-prompts", "5", "--target", str(tmp_path / "none"),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "--max-prompts 5: kept 4 general from chat, 1 code from code" in err
