"""training.decider.ceiling: the AUC an estimate needs for the grow rule to pay, on synthetic traces."""

import json
import re
import shlex
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from support.traces import PAIR, write_traces
from training.decider.ceiling import CeilingConfig, ceiling, main, needed_auc
from training.decider.registry import register
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


def readme_command(module: str) -> list[str]:
    """The flags the README's `python -m <module> ...` line passes (it may wrap)."""
    text = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    cmd = re.search(rf"`python -m {re.escape(module)}([^`]*)`", text).group(1)
    return shlex.split(cmd)


def test_the_readme_command_runs_after_the_readmes_collect_and_fit(tmp_path, decider_dir, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = readme_command("training.decider.ceiling")
    assert main(argv) == 2  # nothing collected yet: the error names the flag
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: runs/traces-mine-heldout: no trace manifest") and "--traces" in err
    write_traces(tmp_path / "runs" / "traces-mine-heldout", n_prompts=30)  # the README's held-out collect
    root = tmp_path / "runs" / "deciders"  # the README's fit: its root, the run promoted
    shutil.copytree(decider_dir, root / "run-1")
    register(root, "run-1", {})
    assert main(argv) == 0 and main([]) == 0  # the defaults are the README's paths too
    assert json.loads((tmp_path / "runs" / "ceiling" / "run-1" / "ceiling.json").read_text())["decider"] == str(
        Path("runs/deciders/run-1"))
