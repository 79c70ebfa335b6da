"""training.decider.signal: each study end to end on synthetic traces whose label signal beyond
q (the parent's entropy, see support/traces.py) is moved out of the features into the studied group,
so only that group can lift the ROC-AUC over q alone."""

import json

import numpy as np
import pyarrow as pa
import pytest

from support.traces import Q_ENTROPY, identity, synth_rows
from decoding.decider.features import FEATURE_NAMES
from training.decider.signal import agreement_history, ancestors, main
from training.decider.traces import KIND, SCHEMA_VERSION
from training.shards import ShardWriter

WIDTH, DEPTH = 3, 4


def _plant(table: pa.Table, study: str, rng) -> pa.Table:
    X = np.array(table.column("features").to_pylist(), np.float32)
    ent = X[:, Q_ENTROPY].copy()
    X[:, Q_ENTROPY] = rng.uniform(0.0, 3.0, len(X))  # the features no longer know it
    if study == "history":  # a fork tree's node has one child: the parent row carries the child's entropy
        child = np.arange(len(X)) + WIDTH
        has = (np.array(table.column("depth").to_pylist()) < DEPTH) & (child < len(X))
        X[has, Q_ENTROPY] = ent[child[has]]
        table = table.set_column(table.schema.get_field_index("position"), "position", table.column("round"))  # a walk
    elif study == "context":
        X[:, FEATURE_NAMES.index("match_len")] = ent
    return table.set_column(table.schema.get_field_index("features"), "features", pa.array(X.tolist(), pa.list_(pa.float32())))


def _traces(path, study, n_prompts, prefix, seed):
    ids = [f"{prefix}{i:03d}" for i in range(n_prompts)]
    with ShardWriter(path, KIND, SCHEMA_VERSION, identity(WIDTH, DEPTH)) as w:
        t = synth_rows(ids, width=WIDTH, depth=DEPTH, hidden=8 if study == "hidden" else 0, seed=seed)
        w.write(_plant(t, study, np.random.default_rng(seed)), ids)
    return path


@pytest.mark.parametrize("study,groups", [
    ("hidden", ["gradient_boosting: features + hidden pca8", "logistic_regression: hidden pca8"]),
    ("history", ["gradient_boosting: features + ancestors", "gradient_boosting: features + ancestors + history"]),
    ("context", ["gradient_boosting: + match lengths, what the longest says", "logistic_regression: + schema 3's choice"]),
])
def test_a_planted_column_lifts_the_auc_over_q(tmp_path, study, groups):
    train = _traces(tmp_path / "train", study, 24, "g-", 0)
    test = _traces(tmp_path / "test", study, 12, "humaneval-", 7)
    out = tmp_path / "r" / f"{study}.json"
    assert main(["--study", study, "--traces", str(train), "--test-traces", str(test), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    auc = {k: v["all"] for k, v in res["auc"].items()}
    assert set(res["auc"]["q_token"]) == {"all", "code"}  # the test prompts are humaneval-*
    base = {"hidden": "gradient_boosting: features", "history": "gradient_boosting: features",
            "context": "gradient_boosting: schema 2 columns"}[study]
    assert auc[base] < auc["q_token"] + 0.05  # without the group the features know no more than q
    for g in groups:
        assert auc[g] > auc["q_token"] + 0.1 and auc[g] > auc[base] + 0.1, (g, auc)


def test_ancestor_and_history_columns_by_hand():
    # one prompt, two rounds at positions 0 and 1: a chain 0 -> 1 and a second root 2
    X = np.zeros((5, len(FEATURE_NAMES)), np.float32)
    X[:, Q_ENTROPY] = [1.0, 3.0, 2.0, 0.5, 1.5]
    X[:, FEATURE_NAMES.index("depth")] = [1, 2, 1, 1, 2]
    X[:, FEATURE_NAMES.index("branch")] = [0, 0, 1, 0, 0]
    pid, rnd = np.array(["a"] * 5), np.array([0, 0, 0, 1, 1])
    node, parent, pos = np.array([0, 1, 2, 0, 1]), np.array([-1, 0, -1, -1, 0]), np.array([0, 0, 0, 1, 1])
    anc = ancestors(X, pid, rnd, node, parent)
    assert np.isnan(anc[[0, 2, 3]]).all()
    np.testing.assert_allclose(anc[1, [0, 3]], [1.0, 2.0])
    np.testing.assert_allclose(anc[4, [0, 3]], [0.5, 1.0])
    h = agreement_history(X, pid, pos, np.array([1, 0, 0, 0, 1]))
    assert np.isnan(h[:3]).all()  # position 0 has no earlier position
    np.testing.assert_allclose(h[3:, [0, 4]], [[1.0, 1.0], [1.0, 1.0]])
    assert np.isnan(h[3:, 1:4]).all()


def test_bad_input_is_one_error_line(tmp_path, capsys):
    plain = _traces(tmp_path / "plain", "context", 3, "g-", 0)
    assert main(["--study", "hidden", "--traces", str(plain), "--test-traces", str(plain)]) == 2
    assert "no hidden state" in capsys.readouterr().err
    assert main(["--study", "context", "--traces", str(tmp_path / "none"), "--test-traces", str(plain)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
