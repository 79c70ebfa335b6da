"""Scheduled retraining: promotion, idempotence, lock, and failure handling."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from support.decider import write_prompts
from support.models import WORDS, noisy_copy, save_tiny, tiny_llama
from training.decider import retrain as R
from training.decider.traces import load_traces

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rt")
    target = tiny_llama(0, vocab=len(WORDS), scale=6, max_pos=128)
    return save_tiny(root / "target", WORDS, target), save_tiny(root / "draft", WORDS, noisy_copy(target, 0.05))


def make_cfg(tmp_path, models, **kw) -> dict:
    t, d = models
    base = dict(new_prompts=str(tmp_path / "logged"), work=str(tmp_path / "work"),
                deciders=str(tmp_path / "deciders"), target=t, draft=d, dtype="float32", width=2,
                depth=3, max_new_tokens=16, chat=False, live_prompts=1, heldout_fraction=0.3, threads=1, min_prompts=8,
                fit_overrides=["--replay.cost_model", "default", "--trainer.max_epochs", "2",
                               "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path / "fit"),
                               "--threads", "1", "--data.val_fraction", "0.3", "--data.test_fraction", "0.0",
                               "--replay.decider_ms", "0.1", "--replay.baselines", "false"])
    return {**base, **kw}


def registry_bytes(tmp_path):
    return (tmp_path / "deciders" / "registry.json").read_bytes()


def test_promote_then_idempotent_then_kept(tmp_path, models):
    write_prompts(tmp_path / "logged", "day1.jsonl", 20)
    cfg = R.RetrainConfig(**make_cfg(tmp_path, models))
    logs = []
    assert R.run(cfg, log=logs.append) == R.EXIT_PROMOTED
    reg = json.loads(registry_bytes(tmp_path))
    assert reg["latest"].startswith("retrain-")
    run_dirs = sorted(p.name for p in (tmp_path / "work").iterdir() if p.is_dir())
    decision = json.loads((tmp_path / "work" / run_dirs[0] / "decision.json").read_text())
    assert decision["promoted"] and decision["reason"] == "no champion yet"
    before = registry_bytes(tmp_path)
    # same inputs: nothing to do, nothing changes
    assert R.run(cfg, log=logs.append) == R.EXIT_UP_TO_DATE
    assert registry_bytes(tmp_path) == before
    assert sorted(p.name for p in (tmp_path / "work").iterdir() if p.is_dir()) == run_dirs
    # new traffic, but an unreachable margin: the champion stays
    write_prompts(tmp_path / "logged", "day2.jsonl", 12, offset=5)
    cfg2 = R.RetrainConfig(**make_cfg(tmp_path, models, margin=10.0))
    assert R.run(cfg2, log=logs.append) == R.EXIT_KEPT
    reg2 = json.loads(registry_bytes(tmp_path))
    assert reg2["latest"] == reg["latest"] and len(reg2["runs"]) == 2
    new_dir = next(p for p in (tmp_path / "work").iterdir() if p.is_dir() and p.name not in run_dirs)
    d2 = json.loads((new_dir / "decision.json").read_text())
    assert not d2["promoted"] and d2["champion_metrics"]["tokens_per_s"] > 0 and "live_tokens_per_s" in d2["challenger_metrics"]


def test_lock_refuses_a_second_run(tmp_path, models):
    import fcntl

    write_prompts(tmp_path / "logged", "a.jsonl", 8)
    (tmp_path / "work").mkdir()
    with open(tmp_path / "work" / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        assert R.run(R.RetrainConfig(**make_cfg(tmp_path, models)), log=lambda m: None) == R.EXIT_LOCKED


def test_bad_inputs_one_error_line(tmp_path, models, capsys):
    cfg = make_cfg(tmp_path, models)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert R.main(["--config", str(path)]) == R.EXIT_BAD_INPUT  # no logged directory yet
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: logged prompts directory not found")


def test_corrupt_champion_and_full_disk_leave_registry_untouched(tmp_path, models, capsys, monkeypatch):
    write_prompts(tmp_path / "logged", "day1.jsonl", 20)
    cfg = make_cfg(tmp_path, models)
    assert R.run(R.RetrainConfig(**cfg), log=lambda m: None) == R.EXIT_PROMOTED
    before = registry_bytes(tmp_path)
    write_prompts(tmp_path / "logged", "day2.jsonl", 12, offset=3)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))

    import safetensors.torch

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert R.main(["--config", str(path)]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert registry_bytes(tmp_path) == before
    monkeypatch.undo()
    champ = json.loads(before)["latest"]
    weights = tmp_path / "deciders" / champ / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])  # truncated checkpoint
    assert R.main(["--config", str(path)]) == R.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "corrupt decider weights" in err
    assert registry_bytes(tmp_path) == before


def test_sigkill_mid_retrain_resumes(tmp_path, models):
    write_prompts(tmp_path / "logged", "day1.jsonl", 24)
    cfgs = {}
    for name in ("ref", "killed"):
        c = make_cfg(tmp_path, models, work=str(tmp_path / name / "work"), deciders=str(tmp_path / name / "dec"))
        cfgs[name] = tmp_path / f"{name}.yaml"
        cfgs[name].write_text(yaml.safe_dump(c))
    cmd = lambda n: [sys.executable, "-m", "training.retrain", "--config", str(cfgs[n])]  # noqa: E731
    assert subprocess.run(cmd("ref"), cwd=ROOT, capture_output=True, timeout=600).returncode == R.EXIT_PROMOTED
    p = subprocess.Popen(cmd("killed"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline:
        mf = list((tmp_path / "killed" / "work").glob("*/traces_train/manifest.json"))
        if mf and len(json.loads(mf[0].read_text())["shards"]) >= 1:
            break
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    again = subprocess.run(cmd("killed"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == R.EXIT_PROMOTED, again.stderr
    for part in ("traces_train", "traces_heldout"):
        key = lambda r: (r["prompt_id"], r["round"], r["node"])  # noqa: E731
        a = sorted(load_traces(next((tmp_path / "ref" / "work").glob(f"*/{part}")))[1].to_pylist(), key=key)
        b = sorted(load_traces(next((tmp_path / "killed" / "work").glob(f"*/{part}")))[1].to_pylist(), key=key)
        assert a == b
