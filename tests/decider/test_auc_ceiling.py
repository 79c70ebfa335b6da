"""training.decider.ceiling: the AUC an estimate needs for the grow rule to pay, on synthetic traces."""

import json
from dataclasses import asdict

import pytest

from support.traces import PAIR, write_traces
from training.decider.ceiling import CeilingConfig, ceiling, main, needed_auc
from training.decider.threshold import DEFAULT_COST


def test_needed_auc_interpolates_to_the_goal():
    assert needed_auc([0.8, 0.9, 1.0], [30.0, 34.0, 38.0], 36.0) == pytest.approx(0.95)
    assert needed_auc([0.8, 0.9], [30.0, 34.0], 29.0) == 0.8  # the first estimator already does
    assert needed_auc([0.8, 0.9], [30.0, 34.0], 40.0) is None  # not even the best one does


@pytest.fixture(scope="module")
def decider_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("decider")
    (d / "config.json").write_text(json.dumps({"model_pair": PAIR, "cost_model": asdict(DEFAULT_COST)}))
    (d / "metrics.json").write_text(json.dumps({"classification": {"test": {"decider": {"roc_auc": 0.8}}}}))
    return d


def test_a_better_estimate_grows_faster_trees(tmp_path, decider_dir):
    traces = write_traces(tmp_path / "traces", n_prompts=30)
    res = ceiling(CeilingConfig(traces=str(traces), decider=str(decider_dir), betas=[0.0, 1.0, 5.0]))
    aucs = [r["roc_auc"] for r in res["estimators"]]
    assert aucs == sorted(aucs) and aucs[-1] > 0.99 and res["decider_test_roc_auc"] == 0.8
    for env in ("tree", "chain"):  # the clairvoyant beats q, calibrated
        assert res["estimators"][-1][env] > res["estimators"][0][env]
    assert set(res["needed_auc"]) == {"1.10x best fixed shape", "1.05x grow(q)", "half the node oracle's gain"}
    out = tmp_path / "report"
    assert main(["--traces", str(traces), "--decider", str(decider_dir), "--out", str(out),
                 "--betas", "0", "2"]) == 0
    assert (out / "ceiling.png").read_bytes()[:4] == b"\x89PNG" and json.loads((out / "ceiling.json").read_text())


def test_refuses_sampled_traces_and_another_pair(tmp_path, decider_dir, capsys):
    other = write_traces(tmp_path / "other", n_prompts=3,
                         pair={r: {**v, "config_sha256": "x"} for r, v in PAIR.items()})
    assert main(["--traces", str(other), "--decider", str(decider_dir)]) == 2
    assert "another model pair" in capsys.readouterr().err
    sampled = write_traces(tmp_path / "t07", n_prompts=3)
    m = json.loads((sampled / "manifest.json").read_text())
    m["collect"]["temperature"] = 0.7
    (sampled / "manifest.json").write_text(json.dumps(m))
    assert main(["--traces", str(sampled), "--decider", str(decider_dir)]) == 2
    assert "greedy traces only" in capsys.readouterr().err
