"""training.head.scaling: validation curves against positions seen, chained across warm starts."""

import json

import pytest

from training.head import scaling


def bench_json(path, steps, agree):
    curve = [{"step": s, "val/agree_1": a, "val/agree_1_general": a - 0.05, "val/agree_1_code": a + 0.1}
             for s, a in zip(steps, agree)]
    path.write_text(json.dumps({"head": "x", "learning_curve": curve}))
    return str(path)


def metrics_csv(path):
    rows = ["epoch,step,train/positions,val/agree_1,val/agree_1_general,val/agree_1_code",
            "0,19,1000.0,,,", "0,39,3000.0,,,", "0,49,,0.61,0.55,0.7", "0,99,,0.63,0.57,0.72"]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_chained_curves_place_each_run_after_the_last(tmp_path):
    a = bench_json(tmp_path / "a.json", [9, 19], [0.4, 0.5])
    b = bench_json(tmp_path / "b.json", [19, 29], [0.5, 0.55])  # a later file of the same run: merged
    c = metrics_csv(tmp_path / "metrics.csv")
    out = tmp_path / "out"
    scaling.main(["--curve", "old", a, b, "--curve", "new", c, "--positions-per-step", "100",
                  "--chain", "--out", str(out)])
    doc = json.loads((out / "scaling.json").read_text())
    old, new = doc["curves"]
    assert [q["step"] for q in old["points"]] == [9, 19, 29]
    assert [q["positions"] for q in old["points"]] == [1000, 2000, 3000]
    assert not old["positions_measured"] and new["positions_measured"]
    assert new["positions_per_step"] == 2000 and new["offset"] == 3000
    assert [q["positions"] for q in new["points"]] == [3000 + 50 * 2000, 3000 + 100 * 2000]
    assert new["points"][1] == {"step": 99, "agree": 0.63, "agree_general": 0.57, "agree_code": 0.72,
                                "positions": 203000}
    assert (out / "scaling.png").stat().st_size > 10_000


def test_a_curve_without_positions_needs_them_given(tmp_path, capsys):
    a = bench_json(tmp_path / "a.json", [9], [0.4])
    with pytest.raises(SystemExit, match="positions-per-step"):
        scaling.main(["--curve", "old", a, "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="no such file"):
        scaling.main(["--curve", "old", str(tmp_path / "none.json"), "--out", str(tmp_path / "o")])
    empty = bench_json(tmp_path / "e.json", [], [])
    with pytest.raises(SystemExit, match="no validation points"):
        scaling.main(["--curve", "old", empty, "--positions-per-step", "1", "--out", str(tmp_path / "o")])
