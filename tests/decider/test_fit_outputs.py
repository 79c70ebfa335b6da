"""Where a fit writes: a user's run goes to runs/deciders under the working directory (its own
registry, its report inside the run), never into the project's tracked checkpoints/ or reports/;
only an explicit --export.out names another root (the shipped pair's), and `--decider <root>`
reads that root's latest."""

import json
from pathlib import Path

import pytest
import yaml
from support.decider import fit_config
from support.traces import write_traces

from decoding.decider import policy as D
from training.decider import fit

pytestmark = pytest.mark.xdist_group("test_fit")

ROOT = Path(__file__).resolve().parents[2]
TRACKED = ("checkpoints", "reports", "configs", "data")


def snapshot() -> dict:
    """Every file under the project's tracked folders, with its size and mtime."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns)
            for top in TRACKED for p in sorted((ROOT / top).rglob("*")) if p.is_file()}


def default_paths_config(tmp: Path, traces: Path) -> Path:
    """The fast test fit, with the export section left to its defaults."""
    cfg = yaml.safe_load(fit_config(tmp, traces).read_text())
    del cfg["export"]
    cfg["trainer"]["max_epochs"] = 1
    path = tmp / "fit-defaults.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_user_fit_writes_only_under_the_working_directory(tmp_path, monkeypatch):
    traces = write_traces(tmp_path / "traces", n_prompts=30)
    cfg = default_paths_config(tmp_path, traces)
    monkeypatch.chdir(tmp_path)
    before = snapshot()
    assert D.resolve_decider_dir("runs/deciders") == D.resolve_decider_dir("latest")  # before any run
    assert fit.main(["--config", str(cfg), "--export.run_id", "mine", "--export.promote", "false"]) == 0
    assert snapshot() == before  # nothing in the checkout's tracked folders changed
    runs = tmp_path / "runs" / "deciders"
    reg = json.loads((runs / "registry.json").read_text())
    assert reg["latest"] is None and [r["run_id"] for r in reg["runs"]] == ["mine"]
    assert (runs / "mine" / "summary.md").is_file() and (runs / "mine" / "roc.png").is_file()
    shipped_latest = D.resolve_decider_dir("latest")  # not promoted: the root serves the shipped one
    assert D.resolve_decider_dir("runs/deciders") == shipped_latest
    assert D.resolve_decider_dir("runs/deciders/mine") == Path("runs/deciders/mine")

    # promoting into an explicitly named root (the shipped pair's) is what writes a registry there
    shipped = tmp_path / "shipped"
    assert fit.main(["--config", str(cfg), "--export.run_id", "ours", "--export.out", str(shipped)]) == 0
    assert json.loads((shipped / "registry.json").read_text())["latest"] == "ours"
    assert D.resolve_decider_dir(str(shipped)) == shipped / "ours"
    assert json.loads((runs / "registry.json").read_text()) == reg  # the user root is untouched
    assert snapshot() == before
    monkeypatch.setattr(D, "DECIDERS_DIR", shipped)  # `latest` keeps naming the shipped root's
    assert D.resolve_decider_dir("latest") == shipped / "ours"
