"""decoding.decider.context: the decider's context columns (n-gram lookups, match lengths, continuation
shares, counts), closed form and against a brute-force search over what the engine really
drafted."""

import math

import torch

from support.models import noisy_copy, tiny_llama
from decoding.decider.context import CONTEXT_NAMES, MAX_MATCH, NGRAMS, ContextIndex, Snapshot
from decoding.decider.features import FEATURE_NAMES, node_features
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine


def test_lookups_closed_form():
    ctx = ContextIndex().sync([5, 6, 7, 5, 6])
    # after ... 5, 6: the last 6 (and the last 5, 6) went on with 7; 7, 5, 6 never occurred before
    assert ctx.features((), 7)[:4] == [1.0, 1.0, 0.0, 1.0]
    assert ctx.features((), 9)[:4] == [-1.0, -1.0, 0.0, 0.0]
    # a node below a drafted 7: 7 / 6, 7 / 5, 6, 7 were each followed by 5
    assert ctx.features((7,), 5)[:4] == [1.0, 1.0, 1.0, 1.0]
    assert ctx.features((7, 9), 5)[:4] == [0.0, 0.0, 0.0, 1.0]  # 9 never occurred
    assert ContextIndex().sync([4]).features((), 4)[:4] == [0.0, 0.0, 0.0, 1.0]  # nothing before it


def test_sync_extends_a_request_and_restarts_on_a_new_one():
    ctx = ContextIndex().sync([1, 2, 3])
    assert ctx.features((), 9)[:4] == [0.0, 0.0, 0.0, 0.0]
    assert ctx.sync([1, 2, 3, 1, 2]) is ctx  # the same request, two tokens later
    assert ctx.tokens == [1, 2, 3, 1, 2] and ctx.features((), 3)[:4] == [1.0, 1.0, 0.0, 1.0]
    new = ctx.sync([7, 8])  # another request: a new index, the old one kept for old levels
    assert new is not ctx and new.tokens == [7, 8] and new.features((), 3)[:4] == [0.0, 0.0, 0.0, 0.0]


def test_a_snapshot_answers_as_the_text_was_when_the_level_was_drafted():
    from types import SimpleNamespace

    holder, committed = SimpleNamespace(context=ContextIndex()), [5, 6, 7, 5, 6]
    snap = Snapshot(holder, committed, 5)
    assert holder.context.tokens == []  # nothing indexed until a feature is asked for
    before = snap.features([(), (7,)], [7, 5]).tolist()
    assert holder.context.tokens == committed
    committed += [9, 5, 6, 8]  # later rounds: 5, 6 last went on with 8, and 9 occurs
    assert snap.features([(), (7,)], [7, 5]).tolist() == before  # every column, counts included
    assert [row[:4] for row in before] == [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    assert snap.features([()], [9])[:, :4].tolist() == [[-1.0, -1.0, 0.0, 0.0]]
    ctx = holder.context
    assert ctx.features((), 8)[:4] == [0.0, 0.0, 0.0, 1.0]  # the index itself has moved on: 8 is in it


def test_match_lengths_shares_and_counts_closed_form():
    col = {name: i for i, name in enumerate(CONTEXT_NAMES)}
    ctx = ContextIndex().sync([5, 6, 7, 5, 6, 7, 8, 5, 6, 7])
    f = ctx.features((), 5)  # ... 5 6 7: "5 6 7" went on with 5, then (latest) with 8
    assert f[:4] == [-1.0, -1.0, -1.0, 1.0]
    assert [f[col["match_len"]], f[col["match_len_token"]], f[col["longest_says"]]] == [3.0, 3.0, -1.0]
    assert f[col["continue_share1"]:col["continue_share3"] + 1] == [0.5, 0.5, 0.5]
    assert f[col["log_last_count"]] == math.log1p(2) and f[col["log_token_count"]] == math.log1p(3)
    # below a drafted 5, 6: "5 6 7 5 6" occurred once (then 7): a 5-token match that says 7
    f = ctx.features((5, 6), 7)
    assert [f[col["match_len"]], f[col["match_len_token"]], f[col["longest_says"]]] == [5.0, 5.0, 1.0]
    assert f[col["continue_share1"]] == 1.0 and f[col["log_last_count"]] == math.log1p(3)
    f = ctx.features((9,), 5)  # 9 never occurred: no match, no shares
    assert f[col["match_len"]:col["continue_share3"] + 1] == [0.0, 0.0, 0.0, -1.0, -1.0, -1.0]
    # a match is capped at MAX_MATCH tokens
    rep = [1, 2, 3, 4] * 10
    f = ContextIndex().sync(rep).features((), 1)
    assert [f[col["match_len"]], f[col["match_len_token"]], f[col["longest_says"]]] == [MAX_MATCH, MAX_MATCH, 1.0]


def reference(committed: list[int], prefix: tuple, token: int) -> list[float]:
    """Every context column by brute force over the text."""
    full, c = list(committed) + list(prefix), len(committed)

    def match(i):  # how far the text before committed[i] matches the end of full
        m = 0
        while m < min(MAX_MATCH, i, len(full)) and committed[i - m - 1] == full[-m - 1]:
            m += 1
        return m

    lens = [match(i) for i in range(1, c)]  # continuation committed[i], i = 1 .. c-1
    nxt = committed[1:]
    latest, share = [], []
    for n in NGRAMS:
        hits = [j for j, m in enumerate(lens) if m >= n]
        latest.append(0.0 if not hits else 1.0 if nxt[hits[-1]] == token else -1.0)
        share.append(-1.0 if not hits else sum(nxt[j] == token for j in hits) / len(hits))
    best = max(lens, default=0)
    says = max([m for m, t in zip(lens, nxt) if t == token], default=0)
    longest = 0.0 if not best else 1.0 if nxt[max(j for j, m in enumerate(lens) if m == best)] == token else -1.0
    return latest + [1.0 if token in committed else 0.0, float(best), float(says), longest, *share,
                     math.log1p(sum(m >= 1 for m in lens)), math.log1p(committed.count(token))]


def test_the_engine_s_levels_carry_the_context_of_every_node():
    target = tiny_llama(0, scale=40)
    draft = noisy_copy(target, 0.02)
    eng = build_engine(target, draft, StrategyConfig(strategy="mcsd", k_config="3,2,1"), SamplingConfig())
    cols = [FEATURE_NAMES.index(name) for name in CONTEXT_NAMES]
    checked, nonzero, longer = 0, 0, 0
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
                assert got[j].tolist() == torch.tensor(reference(committed, tuple(prefix), tok)).tolist()
                checked += 1
                nonzero += bool(torch.any(got[j, :3] != 0))
                longer += bool(got[j, CONTEXT_NAMES.index("match_len")] > NGRAMS[-1])
    assert checked > 20 and nonzero > 5 and longer > 2, (checked, nonzero, longer)


def test_a_decider_of_the_older_schema_reads_its_first_columns(tmp_path):
    import pytest

    from decoding.decider.policy import DeciderConfig, DeciderNet, load_decider, save_decider
    from decoding.decider.features import NUM_FEATURES, SCHEMA_COLUMNS
    from decoding.models import ModelError

    for schema in (1, 2):
        old = DeciderConfig(kind="logistic", num_features=SCHEMA_COLUMNS[schema], feature_schema=schema)
        net = DeciderNet(old)
        with torch.no_grad():
            net.net[0].weight.normal_()
        net2, cfg = load_decider(save_decider(tmp_path / f"v{schema}", net, old, {}))
        x = torch.randn(5, NUM_FEATURES)
        assert cfg.feature_schema == schema and torch.allclose(net2(x), net(x[:, :SCHEMA_COLUMNS[schema]]))
    bad = DeciderConfig(kind="logistic", num_features=NUM_FEATURES, feature_schema=1)  # columns != schema
    with pytest.raises(ModelError, match="feature schema 1"):
        load_decider(save_decider(tmp_path / "bad", DeciderNet(bad), bad, {}))
