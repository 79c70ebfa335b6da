"""training.decider.fit: synthetic traces with a known label rule -> trained, exported, registered decider."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from support.decider import fit_config
from support.traces import PAIR, write_traces

from decoding.decider import policy as D
from decoding.decider.features import NUM_FEATURES
from training.decider import fit
from training.decider import registry
from training.decider.datamodule import TraceDataModule, prompt_split
from training.decider.module import DeciderModule
from training.decider.metrics import classification, ece
from training.shards import ShardWriter
from training.decider.traces import KIND, SCHEMA, SCHEMA_VERSION

# one xdist worker runs this module (--dist loadgroup): the fitted decider (module fixture) is trained once
pytestmark = pytest.mark.xdist_group("test_fit")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return write_traces(tmp_path_factory.mktemp("traces") / "t", n_prompts=60)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, traces):
    tmp = tmp_path_factory.mktemp("fit")
    assert fit.main(["--config", str(fit_config(tmp, traces)), "--export.run_id", "run-a"]) == 0
    return tmp, tmp / "deciders" / "run-a"


def test_split_is_by_prompt_and_deterministic(traces):
    dm = TraceDataModule(traces=str(traces))
    sp = dm.load()
    sets = {k: set(v.prompts) for k, v in sp.items()}
    assert all(sets.values())
    assert not (sets["train"] & sets["val"] or sets["train"] & sets["test"] or sets["val"] & sets["test"])
    assert len(set().union(*sets.values())) == 60
    for name, s in sp.items():  # every row of a prompt follows it
        assert set(s.table.column("prompt_id").to_pylist()) == sets[name]
        assert all(prompt_split(p, 0, 0.15, 0.15) == name for p in s.prompts)
    assert sum(s.table.num_rows for s in sp.values()) == 60 * 8 * 12
    again = TraceDataModule(traces=str(traces)).load()
    assert {k: v.prompts for k, v in again.items()} == {k: v.prompts for k, v in sp.items()}
    assert dm.eval_target == "greedy_match"  # greedy traces


def test_fit_learns_known_rule_and_exports(fitted, traces):
    _, run = fitted
    m = json.loads((run / "metrics.json").read_text())
    auc = {k: v["roc_auc"] for k, v in m["classification"]["test"].items()}
    # the label depends on the parent's entropy as well as on q (support/traces.py): q alone is
    # ~0.72, so every learned scorer must find the entropy signal to clear 0.9
    assert auc["confidence_q_token"] < 0.8
    for scorer in ("decider", "logistic_regression", "hist_gradient_boosting"):
        assert auc[scorer] > 0.9 and auc[scorer] > auc["confidence_q_token"] + 0.1, scorer
    rep = m["replay"]["test"]
    for key in ("fixed-1", "fixed-4", "confidence", "oracle", "decider-paper", "decider-specdecpp"):
        assert rep[key]["tokens_per_s"] > 0
    assert rep["oracle"]["tokens_per_s"] >= rep[rep["best_fixed"]]["tokens_per_s"]
    assert "oracle_share" in rep["decider-paper"] and m["replay"]["chosen"]["rule"] in D.RULES
    # the grow rule replayed over q and over each scorer. Along a chain, where these synthetic
    # rounds are plain (their siblings' q are independent draws, not one distribution's), the
    # decider's better estimates must grow a faster chain than q's
    grow = m["replay"]["chosen"]["grow"]
    for env in ("tree", "chain"):
        assert rep[f"grow-q-{env}"]["tokens_per_s"] > 0 and rep[f"grow-logistic_regression-{env}"]["tokens_per_s"] > 0
    assert grow["chain"]["decider_vs_q"] > 1.05
    for png in ("roc.png", "calibration.png"):
        assert (run / png).read_bytes()[:4] == b"\x89PNG"
    # config.json carries what inference needs
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model_pair"] == PAIR and cfg["threshold"] == m["replay"]["chosen"]["threshold"]
    assert cfg["cost_model"]["target_ms"] and cfg["label"] == "hard" and cfg["kind"] == "mlp"


def test_export_load_round_trip_gives_identical_scores(fitted, traces, monkeypatch):
    tmp, run = fitted
    m = json.loads((run / "metrics.json").read_text())
    net, cfg = D.load_decider(run)
    test = TraceDataModule(traces=str(traces)).load()["test"]
    keep = test.valid & (test.target >= 0)
    p = fit.score(net, test)[keep]
    again = classification(test.target[keep], p)
    stored = m["classification"]["test"]["decider"]
    for k in ("roc_auc", "brier", "ece"):  # the exported weights score exactly as evaluated
        assert again[k] == pytest.approx(stored[k], abs=1e-12)
    monkeypatch.setattr(D, "DECIDERS_DIR", tmp / "deciders")
    net2, cfg2 = D.load_decider("latest")
    assert cfg2 == cfg
    x = torch.from_numpy(test.features[:64])
    assert torch.equal(net(x), net2(x))


def test_registry_is_atomic_and_latest_resolves(tmp_path, fitted, monkeypatch):
    _, run = fitted
    root = tmp_path / "deciders"
    for i in range(8):
        (root / f"r{i}").mkdir(parents=True)
        for f in ("config.json", "model.safetensors"):
            (root / f"r{i}" / f).write_bytes((run / f).read_bytes())
    threads = [threading.Thread(target=registry.register, args=(root, f"r{i}", {"i": i}))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reg = registry.read_registry(root)
    assert sorted(r["run_id"] for r in reg["runs"]) == [f"r{i}" for i in range(8)]  # none lost
    registry.register(root, "r3", {"i": 33}, promote=False)
    assert len(registry.read_registry(root)["runs"]) == 8
    registry.register(root, "r5", {"i": 5})
    before = (root / "registry.json").read_text()

    def crash(*a):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        registry.register(root, "r6", {"i": 6})
    monkeypatch.undo()
    assert (root / "registry.json").read_text() == before  # a failed update leaves it intact
    assert not list(root.glob(".*.tmp-*"))
    monkeypatch.setattr(D, "DECIDERS_DIR", root)
    assert D.resolve_decider_dir("latest") == root / "r5"
    D.load_decider("latest")
    with pytest.raises(ValueError, match="not an exported decider"):
        registry.register(root, "missing", {})
    (root / "registry.json").write_text("{oops")
    with pytest.raises(ValueError, match="corrupt registry"):
        registry.read_registry(root)


@pytest.mark.parametrize("kind", ["hidden", "hybrid"])
def test_hidden_kind_soft_labels_and_balancing(tmp_path, kind):
    tr = write_traces(tmp_path / "th", n_prompts=40, hidden=8)
    cfg = fit_config(tmp_path, tr, model={"kind": kind, "lr": 0.003},
                 data={"label": "soft", "balance": "pos_weight"},
                 trainer={"max_epochs": 4}, replay={"baselines": False, "rule": "paper"})
    assert fit.main(["--config", str(cfg), "--export.run_id", "h"]) == 0
    run = tmp_path / "deciders" / "h"
    m = json.loads((run / "metrics.json").read_text())
    auc = m["classification"]["test"]
    # the hidden state carries (q, entropy, noise): the net must combine the first two
    assert auc["decider"]["roc_auc"] > 0.9 and auc["decider"]["roc_auc"] > auc["confidence_q_token"]["roc_auc"] + 0.1
    assert m["replay"]["chosen"]["rule"] == "paper" and "logistic_regression-paper" not in m["replay"]["test"]
    _, cfg = D.load_decider(run)
    assert cfg.kind == kind and cfg.hidden_size == 8 and cfg.label == "soft"


def test_balancing_is_undone_at_export():
    class DM:
        label, balance, hidden_size = "hard", "pos_weight", 0

        def train_inputs(self):
            return torch.randn(100, NUM_FEATURES), None

        def prior_ratio(self):
            return 3.0
    mod = DeciderModule(kind="logistic")
    mod.build(DM())
    assert mod.pos_weight == 3.0
    b = float(mod.net.net[-1].bias.detach())
    net = mod.calibrated_net()
    assert float(net.net[-1].bias.detach()) == pytest.approx(b - np.log(3.0))
    assert float(mod.calibrated_net().net[-1].bias.detach()) == pytest.approx(b - np.log(3.0))  # once


def test_ece_and_metrics_known_values():
    y = np.array([0, 0, 1, 1.0])
    assert ece(y, np.array([0.0, 0.0, 1.0, 1.0])) == 0.0
    assert ece(y, np.full(4, 0.5)) == pytest.approx(0.0)  # one bin, 0.5 vs 0.5
    assert ece(np.ones(4), np.full(4, 0.25)) == pytest.approx(0.75)
    c = classification(y, np.array([0.1, 0.2, 0.8, 0.9]))
    assert c["roc_auc"] == 1.0 and c["brier"] == pytest.approx(0.025)


def test_cost_model_sources(tmp_path, monkeypatch, pair):
    from dataclasses import asdict

    from decoding.models import fingerprint
    from decoding.models.session import Session
    from training.decider import threshold as T
    from training.decider.threshold import DEFAULT_COST, ReplayConfig, load_cost, policy_ms

    assert load_cost(ReplayConfig(cost_model="default"), {}) is DEFAULT_COST
    p = tmp_path / "cost.json"
    p.write_text(json.dumps({**asdict(DEFAULT_COST), "overhead_ms": 1.5}))
    assert load_cost(ReplayConfig(cost_model=str(p)), {}).overhead_ms == 1.5
    with pytest.raises(ValueError, match="cannot read a CostModel"):
        load_cost(ReplayConfig(cost_model=str(tmp_path / "none.json")), {})
    target, draft = pair
    stub = type("S", (), {"target": target, "draft": draft})
    monkeypatch.setattr(Session, "open", classmethod(lambda cls, *a, **k: stub))
    with pytest.raises(ValueError, match="not the target the traces were recorded with"):
        load_cost(ReplayConfig(cost_model="measure"), PAIR)
    # the real calibrate is tested in test_trace_replay.py: here only which models it is given
    monkeypatch.setattr(T, "calibrate", lambda t, d, collect=None: ("timed", t, d))
    assert load_cost(ReplayConfig(cost_model="measure"),
                     {"target": fingerprint(target), "draft": fingerprint(draft)}) == ("timed", target, draft)
    for kind in ("mlp", "hidden", "hybrid"):
        net = D.DeciderNet(D.DeciderConfig(kind=kind, hidden_size=8))
        assert policy_ms(net, vocab=64, width=3, repeats=3) > 0


def _bad_schema(path: Path):
    """A trace directory whose shard lacks the `hidden` column."""
    schema = pa.schema([f for f in SCHEMA if f.name != "hidden"])
    cols = {f.name: pa.array([], f.type) for f in schema}
    ident = {"feature_schema": 1, "feature_names": [], "model_pair": PAIR, "collect": {}}
    with ShardWriter(path, KIND, SCHEMA_VERSION, ident) as w:
        w.write(pa.table(cols, schema=schema), ["p0"])
    return path


@pytest.mark.parametrize("case, message", [
    ("missing", "trace directory not found"),
    ("schema", "schema or row count differs"),
    ("feature_schema", "feature schema 99"),
    ("empty_split", "split is empty"),
    ("hidden", "no draft hidden states"),
])
def test_bad_input_is_one_clear_error(tmp_path, capsys, case, message):
    traces = {"missing": lambda: tmp_path / "nope",
              "schema": lambda: _bad_schema(tmp_path / "bad"),
              "feature_schema": lambda: write_traces(tmp_path / "fs", 4, feature_schema=99),
              "empty_split": lambda: write_traces(tmp_path / "few", 2),
              "hidden": lambda: write_traces(tmp_path / "nh", 10)}[case]()
    args = ["--config", str(fit_config(tmp_path, traces))]
    if case == "hidden":
        args += ["--model.kind", "hidden"]
    assert fit.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]
    assert not (tmp_path / "deciders").exists()


def test_held_out_test_traces_must_not_share_prompts(tmp_path, traces, capsys):
    held = write_traces(tmp_path / "held", 12, prefix="h", seed=7)
    dm = TraceDataModule(traces=str(traces), test_traces=str(held))
    sp = dm.load()
    assert set(sp["test"].prompts) == {f"h{i:03d}" for i in range(12)}
    assert len(sp["train"].prompts) + len(sp["val"].prompts) == 60
    with pytest.raises(ValueError, match="must be held out"):
        TraceDataModule(traces=str(traces), test_traces=str(traces)).load()


@pytest.mark.slow
def test_ddp_two_processes_gives_equivalent_result(tmp_path, traces, fitted):
    cfg = fit_config(tmp_path, traces)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "training.fit", "--config", str(cfg), "--export.run_id", "ddp",
                          "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads((tmp_path / "deciders" / "ddp" / "metrics.json").read_text())
    single = json.loads((fitted[1] / "metrics.json").read_text())
    assert m["training"]["world_size"] == 2
    auc, ref = (x["classification"]["test"]["decider"]["roc_auc"] for x in (m, single))
    assert auc > 0.9 and abs(auc - ref) < 0.03
    reg = registry.read_registry(tmp_path / "deciders")
    assert [r["run_id"] for r in reg["runs"]] == ["ddp"] and reg["latest"] == "ddp"  # rank 0 only
    assert json.loads((tmp_path / "deciders" / "ddp" / "config.json").read_text())["model_pair"] == PAIR


def test_checkpoint_records_every_rules_val_threshold(fitted):
    """Each rule keeps ITS validated threshold (a row that overrides the rule must not run it at
    another rule's), and the confidence baselines' val-tuned thresholds travel with it."""
    from decoding.models.session import rule_threshold

    _, run = fitted
    val = json.loads((run / "metrics.json").read_text())["replay"]["val"]
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["thresholds"] == {r: val[f"decider-{r}"]["threshold"] for r in D.THRESHOLD_RULES}
    assert cfg["thresholds"][cfg["rule"]] == cfg["threshold"]
    assert cfg["confidence_thresholds"] == {"level": val["confidence"]["threshold"],
                                            "tree": val["confidence-tree"]["threshold"]}
    _, dcfg = D.load_decider(run)
    for r in D.THRESHOLD_RULES:
        assert rule_threshold(dcfg, r) == val[f"decider-{r}"]["threshold"]


def test_feature_ablation_finds_the_group_that_carries_the_signal(fitted):
    """The synthetic label depends on q and on the parent's entropy (in the paper's group):
    that group alone beats q alone, and removing it costs ROC-AUC."""
    tmp, run = fitted
    ab = json.loads((run / "metrics.json").read_text())["feature_ablation"]
    paper = next(k for k in ab if k.startswith("paper"))
    assert ab["all"]["roc_auc"] > 0.9
    assert ab[paper]["without"] < ab["all"]["roc_auc"] - 0.1
    assert ab["q_token"]["alone"] < ab["all"]["roc_auc"] - 0.1
    assert "Which features carry signal" in (tmp / "deciders" / "run-a" / "summary.md").read_text()


def test_label_accepted_trains_only_where_verification_reached(traces):
    """label accepted: P(node on the path | parent on the path), so only nodes whose parent was
    accepted (or the anchor's children) carry a label; the others were never tried."""
    sp = TraceDataModule(traces=str(traces), label="accepted").load()["train"]
    t = sp.table
    acc = t.column("accepted").to_numpy(zero_copy_only=False)
    parent = t.column("parent").to_numpy()
    on_path = {(p, r, n) for p, r, n, a in zip(t.column("prompt_id").to_pylist(), t.column("round").to_pylist(),
                                               t.column("node").to_pylist(), acc) if a}
    reached = np.array([par < 0 or (p, r, par) in on_path for p, r, par in
                        zip(t.column("prompt_id").to_pylist(), t.column("round").to_pylist(), parent)])
    assert np.array_equal(sp.rows, np.flatnonzero(sp.valid & reached))
    assert 0 < len(sp.rows) < len(np.flatnonzero(sp.valid))  # deeper nodes of failed chains drop out
    assert np.array_equal(sp.label[sp.rows], acc[sp.rows].astype(np.float32))
    hard = TraceDataModule(traces=str(traces), label="hard").load()["train"]
    assert np.array_equal(hard.rows, np.flatnonzero(hard.valid))  # the other labels keep every valid node
    with pytest.raises(ValueError, match="data.label"):
        TraceDataModule(traces=str(traces), label="path").load()
