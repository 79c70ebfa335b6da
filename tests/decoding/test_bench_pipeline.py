"""`python -m decoding.bench --quick`: the comparison pipeline end to end on tiny models
(the full benchmark is never run here). The YAML configs' own checks: test_bench_config.py."""

import json
import re
import shutil
from pathlib import Path

import pytest
from support.traces import write_traces

from decoding.bench.cli import main
from decoding.bench.config import load_config
from decoding.bench.quick import QUICK_COST
from training.decider.oracle import main as oracle_main

# one xdist worker runs this module (--dist loadgroup): the quick benchmark (module fixture) runs once
pytestmark = pytest.mark.xdist_group("test_bench")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    traces = write_traces(root / "traces", n_prompts=6, per_shard=3, width=3, depth=4, pair={})
    # the bound is replayed by the training stack beside the traces; the bench reads it
    cost = root / "cost_model.json"
    cost.write_text(json.dumps(QUICK_COST))
    assert oracle_main(["--traces", str(traces), "--cost-model", str(cost)]) == 0
    out = root / "report"
    rc = main(["--quick", "--out", str(out), "--oracle-traces", str(traces)])
    assert rc == 0
    return out, json.loads((out / "results.json").read_text())


def test_results_have_every_row_and_key(quick):
    _, res = quick
    names = {c["name"] for c in res["conditions"]}
    assert names == {"greedy/general", "greedy/code", "T=0.7/general", "T=0.7/code"}
    for cond in res["conditions"]:
        rows = {r["name"]: r for r in cond["rows"]}
        assert {"ar", "hf-assisted", "sd", "mcsd", "ti-mcsd", "ti-mcsd+confidence",
                "ti-mcsd longest-branch (LOSSY)"} <= set(rows)
        assert rows["ar"]["speedup"]["median"] == pytest.approx(1.0)
        assert rows["sd (draft2)"]["draft"].endswith("draft2") and rows["sd"]["draft"] is None
        for r in rows.values():
            if r["kind"] in ("engine", "hf"):
                assert r["status"] == "ok" or r["stop"] == "decider"
            if r["status"] == "ok" and r["kind"] != "bound":
                for key in ("tokens_per_s", "speedup", "block_efficiency", "acceptance_rate", "lossless",
                            "peak_mem_mb", "loglik_per_token", "equal_to_ar", "agreement", "profile"):
                    assert key in r, (r["name"], key)
                t = r["tokens_per_s"]
                assert t["min"] <= t["median"] <= t["max"] and len(t["per_repeat"]) == 2
        # the quick decider (random, for the tiny pair) runs: rows are measured or the run fails
        assert rows["ti-mcsd+decider(paper)"]["status"] == "ok"
        assert rows["ti-mcsd longest-branch (LOSSY)"]["lossless"] is False
        if cond["temperature"] == 0:
            for name in ("sd", "sd (draft2)", "mcsd", "ti-mcsd", "ti-mcsd+confidence", "hf-assisted",
                         "ti-mcsd+confidence(grow)", "ti-mcsd+decider(grow)"):
                eq = rows[name]["equal_to_ar"]  # fp32: lossless rows reproduce ar bit for bit
                assert eq == {"equal": 2, "tie": 0, "mismatch": 0, "n": 2, "differences": []}, name
                assert rows[name]["lossless"] and rows[name]["lossless_evidence"].startswith("greedy")
            lossy = rows["ti-mcsd longest-branch (LOSSY)"]["equal_to_ar"]
            assert lossy["tie"] == 0 and lossy["equal"] + lossy["mismatch"] == 2  # fp32: no tie excuse
            ag = rows["ti-mcsd longest-branch (LOSSY)"]["agreement"]
            assert 0 <= ag["exact_match"] <= 1 and 0 <= ag["prefix_fraction"] <= 1
            # the oracle bound row appears where the traces' temperature matches (greedy)
            bound = [r for r in cond["rows"] if r["kind"] == "bound"]
            assert len(bound) == 1 and "BOUND" in bound[0]["name"] and bound[0]["reference"] == "ti-mcsd"
        else:
            assert rows["sd"]["equal_to_ar"] is None
            assert rows["sd"]["lossless_evidence"] == "the exact-sampling test"
            assert rows["ti-mcsd longest-branch (LOSSY)"]["lossless_evidence"] is None
            assert not any(r["kind"] == "bound" for r in cond["rows"])


def test_report_files_goals_and_bound(quick):
    out, res = quick
    for f in ("results.json", "results.md", "speedup.png", "accepted_lengths.png", "tree_size.png",
              "rate_vs_tree_size.png"):
        assert (out / f).stat().st_size > 0, f
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temp files
    assert res["oracle"]["status"] == "ok" and res["oracle"]["oracle_over_full_depth"] > 0
    goals = {(g["goal"], g["condition"]) for g in res["goals"]}
    assert goals == {(k, c) for k in ("vs_ar", "dynamic_vs_mcsd", "vs_hf_assisted", "dynamic_vs_best_fixed",
                                      "learned_vs_best_fixed", "learned_vs_confidence")
                     for c in ("greedy/general", "greedy/code")}
    for g in res["goals"]:  # decider rows against the fastest fixed shape / confidence row
        if g["goal"].startswith("learned") and g["best"]:
            assert "decider" in g["best"] and ("confidence" in g["reference"]) == (g["goal"] == "learned_vs_confidence")
    for cond in res["conditions"]:  # the grow rows report what they ran with and their tree sizes
        grow = {r["name"]: r for r in cond["rows"] if "(grow)" in r["name"]}
        assert {r["stop_setting"]["scores"] for r in grow.values()} == {"q", "decider"}
        assert "timed on this machine" in grow["ti-mcsd+confidence(grow)"]["stop_setting"]["source"]
        # tiny models: the priced host work may leave a round no tree at all (the gate)
        assert all(0 <= r["mean_tree_size"] <= 12 for r in grow.values())
    for g in res["goals"]:
        assert g["verdict"] == "PASS" or g["verdict"].startswith(("SHORT BY", "n/a", "NOT SHOWN"))
    md = (out / "results.md").read_text()
    assert "## Goals" in md and "BOUND (replay, not measured)" in md and "## Profile" in md
    assert res["sweep"]["points"] and all(p["tree_nodes"] > 0 for p in res["sweep"]["points"])


@pytest.mark.parametrize("args,message", [
    (["--config", "/no/such.yaml"], "config file not found"),
    (["--suite", "engine", "--quick"], "--quick"),
    (["--quick", "--temperatures", "x"], "--temperatures"),
])
def test_bad_input_one_error_line(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and message in err


def test_oracle_bound_from_decider_metrics(tmp_path):
    """Without a trace dir the bound is read from the decider's stored replay (no models)."""
    from decoding.bench.config import OracleConfig
    from decoding.bench.oracle import oracle_bound

    fixed = {f"fixed-{d}": {"tokens_per_s": 30.0 + d} for d in range(1, 5)}
    metrics = {"traces": {"collect": {"strategy": "ti-mcsd", "width": 4, "depth": 4, "temperature": 0.0}},
               "replay": {"test": {**fixed, "best_fixed": "fixed-4", "oracle": {"tokens_per_s": 51.0},
                                   "decider-paper": {"tokens_per_s": 40.0, "oracle_share": 0.4, "threshold": 0.3}},
                          "cost_model": {}}}
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    b = oracle_bound(OracleConfig(), None, str(tmp_path))
    assert b["status"] == "ok" and "BOUND" in b["label"] and b["full_depth"] == "fixed-4"
    assert b["oracle_over_full_depth"] == pytest.approx(51.0 / 34.0)
    assert b["deciders"]["decider-paper"]["oracle_share"] == 0.4
    assert oracle_bound(OracleConfig(), None, str(tmp_path / "none"))["status"].startswith("skipped")


# --- thresholds: each row runs the setting its label claims ----------------------------------

def test_rows_run_their_rules_validated_and_tuned_thresholds(quick):
    """A decider row that names a rule runs at the threshold validated for THAT rule; `tuned`
    confidence rows at the checkpoint's val-tuned ones; a hand-set row at its own value."""
    _, res = quick
    dec = json.loads((Path(res["meta"]["config"]["decider"]) / "config.json").read_text())
    assert dec["rule"] == "tree" and dec["thresholds"]["paper"] != dec["threshold"]
    want = {"ti-mcsd+decider(paper)": ("paper", dec["thresholds"]["paper"]),  # rule overridden
            "ti-mcsd+decider(tree)": ("tree", dec["thresholds"]["tree"]),  # the checkpoint's own rule
            "ti-mcsd+confidence(tuned)": ("level", dec["confidence_thresholds"]["level"]),
            "ti-mcsd+confidence(tree, tuned)": ("tree", dec["confidence_thresholds"]["tree"]),
            "ti-mcsd+confidence": ("level", 0.4)}
    for cond in res["conditions"]:
        rows = {r["name"]: r for r in cond["rows"]}
        for name, (rule, t) in want.items():
            st = rows[name]["stop_setting"]
            assert (st["rule"], st["threshold"]) == (rule, t), (cond["name"], name)
        assert rows["sd"]["stop_setting"] is None


def test_speedup_has_bootstrap_ci_containing_the_estimate(quick):
    out, res = quick
    for cond in res["conditions"]:
        for r in cond["rows"]:
            if r["kind"] == "bound":
                continue
            s = r["speedup"]
            lo, hi = s["ci95"]
            assert lo <= s["median"] <= hi, (cond["name"], r["name"])
            n_rep, n_prompts = res["meta"]["repeats"], cond["n_prompts"]
            assert len(r["per_prompt"]["tokens"]) == n_rep and len(r["per_prompt"]["wall_s"][0]) == n_prompts
            assert sum(r["per_prompt"]["tokens"][0]) == r["new_tokens"]
        ar = next(r for r in cond["rows"] if r["name"] == "ar")
        assert ar["speedup"]["ci95"] == [1.0, 1.0]  # ar against itself, resampled alike
    for g in res["goals"]:
        if g["value"] is not None:
            assert g["ci95"][0] <= g["value"] <= g["ci95"][1]
            assert g["verdict"] != "PASS" or g["ci95"][0] >= g["target"]
    md = (out / "results.md").read_text()
    assert "95% confidence interval" in md and "95% CI [" in md and "Stop thresholds" in md
    assert res["meta"]["ci"]["resamples"] == 2000


def test_ci_on_synthetic_numbers_with_known_answers():
    from decoding.bench.stats import paired_speedup, speedup_ci

    # identical prompts: every resample is the original sample, zero-width interval
    tok, wall = [[10, 10, 10], [10, 10, 10]], [[1.0, 1.0, 1.0], [1.2, 1.2, 1.2]]
    b_wall = [[2.0, 2.0, 2.0], [2.4, 2.4, 2.4]]
    assert speedup_ci(tok, wall, tok, b_wall) == pytest.approx((2.0, 2.0, 2.0))
    # paired by repeat: a load burst that slows both rows in one repeat changes nothing
    slow = [[1.0, 0.5, 2.0], [3.0, 1.5, 6.0]]
    assert speedup_ci([[10, 20, 5]] * 2, slow, [[10, 20, 5]] * 2, [[2 * x for x in r] for r in slow]) == \
        pytest.approx((2.0, 2.0, 2.0))
    # two prompts, a 2x faster on one and equal on the other: resamples {1,1} -> 2x, {2,2} -> 1x
    # (each drawn with probability 1/4 > 2.5%), so the 95% interval is exactly [1, 2]
    a = ([[10, 10]], [[0.5, 1.0]])
    b = ([[10, 10]], [[1.0, 1.0]])
    point, lo, hi = speedup_ci(*a, *b, resamples=2000, seed=3)
    assert point == pytest.approx(20 / 1.5 / 10) and (lo, hi) == pytest.approx((1.0, 2.0))
    assert speedup_ci(*a, *b, seed=3) == speedup_ci(*a, *b, seed=3)  # seeded
    # the median over repeats of per-repeat ratios of summed tokens/s
    assert paired_speedup([[4, 4], [4, 4], [4, 4]], [[1, 1], [1, 1], [1, 1]],
                          [[4, 4], [4, 4], [4, 4]], [[2, 2], [1, 1], [4, 4]]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="same repeats"):
        speedup_ci([[1, 2]], [[1, 1]], [[1]], [[1]])


def test_goal_passes_only_when_the_interval_clears_it():
    from decoding.bench.report import _verdict

    assert _verdict(2.2, 2.05, 2.0) == "PASS"
    assert _verdict(2.2, 1.9, 2.0).startswith("NOT SHOWN")
    assert _verdict(1.8, 1.5, 2.0) == "SHORT BY 10%"
    assert _verdict(float("nan"), float("nan"), 2.0) == "n/a"


# --- rows that cannot run fail the run -----------------------------------------------------

def _strip(quick, tmp_path, key):
    """A copy of the quick decider whose config.json lacks `key` (a checkpoint fitted before it)."""
    _, res = quick
    src = Path(res["meta"]["config"]["decider"])
    dst = tmp_path / "old-decider"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    del cfg[key]
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("key,message", [
    ("thresholds", r"ti-mcsd\+decider\(paper\): decider .* has no validated threshold for the paper rule"),
    ("confidence_thresholds", r"ti-mcsd\+confidence\(tuned\): decider .* no tuned confidence threshold"),
    (None, r"ti-mcsd\+confidence\(tuned\): not a decider checkpoint"),
])
def test_a_row_that_cannot_run_fails_the_run(quick, tmp_path, capsys, key, message):
    dec = _strip(quick, tmp_path, key) if key else str(tmp_path / "missing")
    out = tmp_path / "report"
    assert main(["--quick", "--no-sweep", "--decider", dec, "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: strategy ") and re.search(message, err[-1])
    assert not out.exists()  # nothing half-written


def test_old_checkpoint_keeps_its_own_rules_threshold():
    from decoding.decider.policy import DeciderConfig
    from decoding.models.session import rule_threshold

    old = DeciderConfig(rule="tree", threshold=0.175)
    assert rule_threshold(old, "tree") == 0.175
    with pytest.raises(ValueError, match="no validated threshold for the specdecpp rule"):
        rule_threshold(old, "specdecpp")
    new = DeciderConfig(rule="tree", threshold=0.175, thresholds={"specdecpp": 0.725, "tree": 0.175})
    assert rule_threshold(new, "specdecpp") == 0.725
    with pytest.raises(ValueError, match="thresholds must map"):
        DeciderConfig(thresholds={"greedy": 0.5})


@pytest.mark.parametrize("row", ["{name: d, strategy: ti-mcsd, stop: decider}",
                                 "{name: d, strategy: ti-mcsd, stop: confidence, confidence_threshold: tuned}"])
def test_decider_rows_without_a_decider_are_a_config_error(tmp_path, capsys, row):
    p = tmp_path / "b.yaml"
    p.write_text(f"decider: null\nstrategies:\n  - {{name: ar, strategy: ar}}\n  - {row}\n")
    assert main(["--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: decider is null but row(s) d need a decider")


def test_row_selection_and_no_decider():
    from decoding.bench.cli import _apply_overrides, parser

    path = Path(__file__).resolve().parents[2] / "configs" / "bench_feature.yaml"
    cfg = load_config(path)
    a = parser().parse_args(["--decider", "none", "--row", "sd g4", "--row", "mcsd 4,2,2,1",
                             "--row", "grow(q)"])
    got = _apply_overrides(cfg, a)
    # ar kept first; a grown tree timed on this machine needs no decider
    assert [s.name for s in got.strategies] == ["ar", "sd g4", "mcsd 4,2,2,1", "grow(q)"]
    assert got.decider is None
    with pytest.raises(ValueError, match="need a decider"):  # a decider row without a decider
        _apply_overrides(load_config(path),
                         parser().parse_args(["--decider", "none", "--row", "W4 D8 decider(tree)"]))
    with pytest.raises(ValueError, match="no row named 'sd g9'"):
        _apply_overrides(cfg, parser().parse_args(["--row", "sd g9"]))


def test_named_oracle_traces_that_cannot_be_replayed_are_an_error(tmp_path):
    from decoding.bench.config import OracleConfig
    from decoding.bench.oracle import oracle_bound

    with pytest.raises(ValueError, match="oracle.traces"):
        oracle_bound(OracleConfig(traces=str(tmp_path / "none")), None, None)


def test_traces_without_their_replayed_bound_are_refused_before_the_run(tmp_path, capsys):
    """The bench never replays (that is training code): named traces without oracle.json stop
    the run at once, with the command that writes it."""
    traces = write_traces(tmp_path / "traces", n_prompts=2, per_shard=2, width=3, depth=4, pair={})
    assert main(["--quick", "--out", str(tmp_path / "r"), "--oracle-traces", str(traces)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "python -m training.decider.oracle --traces" in err[0]
    assert not (tmp_path / "r").exists()


def test_oracle_tool_refuses_bad_input_in_one_line(tmp_path, capsys):
    assert oracle_main(["--traces", str(tmp_path / "none"), "--cost-model", str(tmp_path / "c.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# --- the lossless column is measured: a row that differs from ar is reported, not excused ----

def test_a_mismatching_row_is_not_reported_lossless(pair):
    """A row configured lossless whose greedy outputs really differ from ar (here: the lossy
    longest-branch engine's outputs under a lossless label) is marked MISMATCH and loses
    its lossless flag; the same outputs as ar count as equal."""
    from support.models import noisy_copy
    from decoding.bench.config import StrategySpec
    from decoding.bench.report import _table_row
    from decoding.bench.runs import Acc, LogLik, row_of
    from decoding.sampling import SamplingConfig
    from decoding.strategies import StrategyConfig, build_engine

    target, _ = pair
    prompts = [[1, 5, 7, 3], [2], [9, 9, 4, 11]]
    ar_eng = build_engine(target, None, StrategyConfig(strategy="ar"), SamplingConfig())
    lossy = build_engine(target, noisy_copy(target, 0.2), StrategyConfig(
        strategy="ti-mcsd", width=4, depth=4, mode="longest-branch"), SamplingConfig())

    def acc(eng):
        runs = [eng.generate(p, 40) for p in prompts]
        return Acc(tok_s=[10.0], tokens=[[len(o) for o, _ in runs]], wall=[[1.0] * 3],
                   outputs=[o for o, _ in runs], stats=[st.to_dict() for _, st in runs])

    ar = acc(ar_eng)
    spec = StrategySpec(name="ti-mcsd", strategy="ti-mcsd", width=4, depth=4)
    ll = LogLik(target)
    bad = row_of(spec, "runner", acc(lossy), ar, True, prompts, ll, resamples=10)
    eq = bad["equal_to_ar"]
    assert eq["mismatch"] >= 1 and eq["tie"] == 0 and bad["lossless"] is False
    assert bad["configured_lossless"] and all(d["kind"] == "mismatch" for d in eq["differences"])
    assert "**MISMATCH**" in _table_row(bad) and "yes" not in _table_row(bad).split("|")[2]
    good = row_of(spec, "runner", ar, ar, True, prompts, ll, resamples=10)
    assert good["lossless"] and good["equal_to_ar"]["equal"] == 3 and "MISMATCH" not in _table_row(good)


def test_rows_with_their_own_draft_share_the_run_and_are_checked(quick, tmp_path):
    """Two drafts compared in ONE interleaved run (same target, same repeats); a row's own draft
    is checked against the target, and the run's decider refuses a row with another draft."""
    from decoding.bench.compare import run_compare
    from decoding.bench.config import StrategySpec
    from decoding.bench.quick import quick_config

    out, res = quick
    acc = {c["name"]: {r["name"]: r["acceptance_rate"] for r in c["rows"] if r["name"].startswith("sd")}
           for c in res["conditions"]}
    assert any(a["sd"] != a["sd (draft2)"] for a in acc.values()), acc  # really another draft
    md = (out / "results.md").read_text()
    assert "Rows with their own draft / decider" in md and "- sd (draft2): draft " in md
    # the drafts' fastest rows compared per condition, the run's draft as the reference
    assert [d["condition"] for d in res["drafts"]] == [c["name"] for c in res["conditions"]]
    for d in res["drafts"]:
        assert d["best"] == "sd (draft2)" and d["draft"].endswith("draft2")
        assert d["ci95"][0] <= d["value"] <= d["ci95"][1]
    assert "## Drafts compared" in md
    cfg = quick_config(tmp_path / "q")
    d2 = next(s.draft for s in cfg.strategies if s.draft)
    cfg.strategies = [StrategySpec("ar"), StrategySpec("ti-mcsd", name="tree (draft2)", width=3, depth=4,
                                                       stop="decider", draft=d2)]
    with pytest.raises(ValueError, match=r"strategy tree \(draft2\): .*(pair|draft)"):
        run_compare(cfg, "test")
    cfg.strategies[1] = StrategySpec("sd", name="sd (missing)", draft=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"strategy sd \(missing\): "):
        run_compare(cfg, "test")
