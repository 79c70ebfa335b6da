"""`python -m decoding.bench --quick`: the comparison pipeline end to end on tiny models
(the full benchmark is never run here)."""

import json
from pathlib import Path

import pytest
from synth_traces import write_traces

from decoding.bench import main
from decoding.bench_config import load_config


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    traces = write_traces(root / "traces", n_prompts=6, per_shard=3, width=3, depth=4, pair={})
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
        for r in rows.values():
            if r["kind"] in ("engine", "hf"):
                assert r["status"] == "ok" or r["stop"] == "decider"
            if r["status"] == "ok" and r["kind"] != "bound":
                for key in ("tokens_per_s", "speedup", "block_efficiency", "acceptance_rate", "lossless",
                            "peak_mem_mb", "loglik_per_token", "equal_to_ar", "agreement", "profile"):
                    assert key in r, (r["name"], key)
                t = r["tokens_per_s"]
                assert t["min"] <= t["median"] <= t["max"] and len(t["per_repeat"]) == 2
        # no decider exists for the tiny pair: the rows say so, they are never faked
        assert rows["ti-mcsd+decider(paper)"]["status"].startswith("skipped: no decider")
        assert rows["ti-mcsd longest-branch (LOSSY)"]["lossless"] is False
        if cond["temperature"] == 0:
            for name in ("sd", "mcsd", "ti-mcsd", "ti-mcsd+confidence", "hf-assisted"):
                eq = rows[name]["equal_to_ar"]
                assert eq == {"equal": 2, "n": 2}, name  # fp32: lossless rows reproduce ar
            ag = rows["ti-mcsd longest-branch (LOSSY)"]["agreement"]
            assert 0 <= ag["exact_match"] <= 1 and 0 <= ag["prefix_fraction"] <= 1
            # the oracle bound row appears where the traces' temperature matches (greedy)
            bound = [r for r in cond["rows"] if r["kind"] == "bound"]
            assert len(bound) == 1 and "BOUND" in bound[0]["name"] and bound[0]["reference"] == "ti-mcsd"
        else:
            assert rows["sd"]["equal_to_ar"] is None
            assert not any(r["kind"] == "bound" for r in cond["rows"])


def test_report_files_goals_and_bound(quick):
    out, res = quick
    for f in ("results.json", "results.md", "speedup.png", "accepted_lengths.png", "tree_size.png"):
        assert (out / f).stat().st_size > 0, f
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temp files
    assert res["oracle"]["status"] == "ok" and res["oracle"]["oracle_over_full_depth"] > 0
    goals = {(g["goal"], g["condition"]) for g in res["goals"]}
    assert goals == {(k, c) for k in ("vs_ar", "dynamic_vs_mcsd", "vs_hf_assisted", "dynamic_vs_best_fixed")
                     for c in ("greedy/general", "greedy/code")}
    for g in res["goals"]:
        assert g["verdict"] == "PASS" or g["verdict"].startswith(("SHORT BY", "n/a"))
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


def test_config_rejects_unknown_keys(tmp_path):
    p = tmp_path / "b.yaml"
    p.write_text("repeats: 2\nstrategies:\n  - {name: ar, strategy: ar, gama: 3}\n")
    with pytest.raises(ValueError, match="unknown key.*gama"):
        load_config(p)
    p.write_text("strategies:\n  - {name: sd, strategy: sd}\n")
    with pytest.raises(ValueError, match="start with ar"):
        load_config(p)


def test_shipped_config_is_valid():
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "bench.yaml")
    assert cfg.strategies[0].strategy == "ar" and {s.strategy for s in cfg.strategies} >= {
        "hf-assisted", "hf-prompt-lookup", "sd", "mcsd", "ti-mcsd"}


def test_oracle_bound_from_decider_metrics(tmp_path):
    """Without a trace dir the bound is read from the decider's stored replay (no models)."""
    from decoding.bench_config import OracleConfig
    from decoding.bench_oracle import oracle_bound

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
