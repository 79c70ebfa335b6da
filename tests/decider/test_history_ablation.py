"""training.decider.history: the round-history candidate features and their ablation."""

import json

import numpy as np

from support.traces import write_traces
from training.decider.history import main, round_history


def test_round_history_by_hand():
    # prompt a: rounds 0, 1, 2, 3 accepted 2, 0, 4, 1 (several rows per round, shuffled);
    # prompt b: a single round
    pid = np.array(["a", "a", "b", "a", "a", "a", "a"])
    rnd = np.array([1, 0, 0, 3, 2, 2, 1])
    acc = np.array([0, 2, 5, 1, 4, 4, 0])
    h = round_history(pid, rnd, acc)
    expect = {0: [0, 0, 0, 1], 1: [2, 2, 2, 0], 2: [0, 1, 1, 0], 3: [4, 2, 2, 0]}
    for i in range(len(pid)):
        want = [0, 0, 0, 1] if pid[i] == "b" else expect[rnd[i]]
        np.testing.assert_allclose(h[i], want, err_msg=str(i))
    # the mean of the last 3 differs from the mean of all once there are more than 3 rounds
    h = round_history(np.array(["c"] * 5), np.arange(5), np.array([4, 0, 0, 0, 1]))
    np.testing.assert_allclose(h[4], [0, 0, 1, 0])


def test_cli_ablation_on_synthetic_traces(tmp_path, capsys):
    train = write_traces(tmp_path / "train", n_prompts=20)
    test = write_traces(tmp_path / "test", n_prompts=10, prefix="t", seed=7)
    out = tmp_path / "r" / "history.json"
    assert main(["--traces", str(train), "--test", str(test), "--out", str(out)]) == 0
    auc = json.loads(out.read_text())["roc_auc"]
    # the synthetic rule uses the parent's entropy, which q alone misses; rounds are independent,
    # so history adds nothing
    assert auc["decider features"] > auc["q_token alone"] + 0.1
    assert abs(auc["decider features + history"] - auc["decider features"]) < 0.02
    assert main(["--traces", str(tmp_path / "none"), "--test", str(test)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
