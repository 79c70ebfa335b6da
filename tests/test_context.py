"""decoding.context: the n-gram lookups of the decider's schema-2 columns, closed form and
against a brute-force search over what the engine really drafted."""

import torch

from conftest import noisy_copy, tiny_llama
from decoding.context import NGRAMS, ContextIndex, Snapshot
from decoding.features import FEATURE_NAMES, node_features
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine


def test_lookups_closed_form():
    ctx = ContextIndex().sync([5, 6, 7, 5, 6])
    # after ... 5, 6: the last 6 (and the last 5, 6) went on with 7; 7, 5, 6 never occurred before
    assert ctx.features((), 7) == [1.0, 1.0, 0.0, 1.0]
    assert ctx.features((), 9) == [-1.0, -1.0, 0.0, 0.0]
    # a node below a drafted 7: 7 / 6, 7 / 5, 6, 7 were each followed by 5
    assert ctx.features((7,), 5) == [1.0, 1.0, 1.0, 1.0]
    assert ctx.features((7, 9), 5) == [0.0, 0.0, 0.0, 1.0]  # 9 never occurred
    assert ContextIndex().sync([4]).features((), 4) == [0.0, 0.0, 0.0, 1.0]  # nothing before it


def test_sync_extends_a_request_and_restarts_on_a_new_one():
    ctx = ContextIndex().sync([1, 2, 3])
    assert ctx.features((), 9) == [0.0, 0.0, 0.0, 0.0]
    assert ctx.sync([1, 2, 3, 1, 2]) is ctx  # the same request, two tokens later
    assert ctx.tokens == [1, 2, 3, 1, 2] and ctx.features((), 3) == [1.0, 1.0, 0.0, 1.0]
    new = ctx.sync([7, 8])  # another request: a new index, the old one kept for old levels
    assert new is not ctx and new.tokens == [7, 8] and new.features((), 3) == [0.0, 0.0, 0.0, 0.0]


def test_a_snapshot_answers_as_the_text_was_when_the_level_was_drafted():
    ctx = ContextIndex().sync([5, 6, 7, 5, 6])
    snap = Snapshot(ctx, 5)
    before = snap.features([(), (7,)], [7, 5]).tolist()
    ctx.sync([5, 6, 7, 5, 6, 9, 5, 6, 8])  # later rounds: 5, 6 last went on with 8, and 9 occurs
    assert snap.features([(), (7,)], [7, 5]).tolist() == before == [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    assert snap.features([()], [9]).tolist() == [[-1.0, -1.0, 0.0, 0.0]]
    assert ctx.features((), 8) == [0.0, 0.0, 0.0, 1.0]  # the index itself has moved on: 8 is in it


def reference(committed: list[int], prefix: tuple, token: int) -> list[float]:
    full = list(committed) + list(prefix)
    out = []
    for n in NGRAMS:
        tail, nxt = full[-n:], None
        if len(full) >= n:
            for i in range(len(committed) - n):  # occurrence at i..i+n-1, followed by committed[i+n]
                if committed[i:i + n] == tail:
                    nxt = committed[i + n]
        out.append(0.0 if nxt is None else 1.0 if nxt == token else -1.0)
    return out + [1.0 if token in committed else 0.0]


def test_the_engine_s_levels_carry_the_context_of_every_node():
    target = tiny_llama(0, scale=40)
    draft = noisy_copy(target, 0.02)
    eng = build_engine(target, draft, StrategyConfig(strategy="mcsd", k_config="3,2,1"), SamplingConfig())
    cols = [FEATURE_NAMES.index(f"ngram{n}") for n in NGRAMS] + [FEATURE_NAMES.index("in_context")]
    checked, nonzero = 0, 0
    seen = []
    eng.observer = lambda tree, logits, outcome, position: seen.append(tree)
    committed_at = []
    real = eng.proposer.propose

    def spy(committed, *a, **k):
        tree = real(committed, *a, **k)
        committed_at.append((tree, list(committed)))
        return tree

    eng.proposer.propose = spy
    eng.generate([1, 2, 3, 1, 2, 3, 1, 2], 24)
    assert seen
    for tree, committed in committed_at:
        for level in tree.levels:
            got = node_features(level)[:, cols]
            for j, tok in enumerate(level.tokens):
                prefix, p = [], level.parent_nodes[j]
                while p >= 0:
                    prefix.insert(0, tree.tokens[p])
                    p = tree.layout.parents[p]
                assert got[j].tolist() == reference(committed, tuple(prefix), tok)
                checked += 1
                nonzero += bool(torch.any(got[j, :3] != 0))
    assert checked > 20 and nonzero > 5, (checked, nonzero)


def test_a_decider_of_the_older_schema_reads_its_first_columns(tmp_path):
    import pytest

    from decoding.decider import DeciderConfig, DeciderNet, load_decider, save_decider
    from decoding.features import NUM_FEATURES, SCHEMA_COLUMNS
    from decoding.models import ModelError

    old = DeciderConfig(kind="logistic", num_features=SCHEMA_COLUMNS[1], feature_schema=1)
    net = DeciderNet(old)
    with torch.no_grad():
        net.net[0].weight.normal_()
    net2, cfg = load_decider(save_decider(tmp_path / "v1", net, old, {}))
    x = torch.randn(5, NUM_FEATURES)
    assert cfg.feature_schema == 1 and torch.allclose(net2(x), net(x[:, :SCHEMA_COLUMNS[1]]))
    bad = DeciderConfig(kind="logistic", num_features=NUM_FEATURES, feature_schema=1)  # columns != schema
    with pytest.raises(ModelError, match="feature schema 1"):
        load_decider(save_decider(tmp_path / "bad", DeciderNet(bad), bad, {}))
