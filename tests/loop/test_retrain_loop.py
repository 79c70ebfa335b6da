"""The retraining loop end to end, as a user runs it (`make retrain-loop`), on a tiny pair:

1. a first scheduled retrain on seed prompts promotes a decider into a user deciders root;
2. `python -m decoding.serve --stop decider --decider ROOT --log-prompts LOGS` (a real process)
   serves it, and logs the traffic it is sent;
3. `python -m training.retrain --logged LOGS` consumes exactly those files and promotes a
   challenger; a second run finds nothing new (exit 11);
4. the running server reports the new decider in /metrics, without a restart, and serves again.

Lossless throughout: every greedy answer, before and after the swap, equals plain `ar`. Nothing
under the checkout's tracked folders changes: user runs live in the run's own directories."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from decoding import Decoder
from support.decider import write_prompts
from support.models import WORDS, noisy_copy, save_tiny, tiny_llama
from support.serve import free_port
from training.decider import retrain as R

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.xdist_group("server")
NEW_TOKENS = 8
TRAFFIC = [f"w{i % 30} w{(5 * i + 3) % 30} w{(11 * i) % 30}" for i in range(24)]
TRACKED = ("checkpoints", "configs", "data", "reports", "decoding", "training")


def retrain_config(tmp: Path, target: str, draft: str, logged: Path) -> Path:
    """A nightly config for the tiny pair: short traces and fit; the gate promotes any challenger
    (margin -1, AUC tolerance 1, no live check: this test is about the loop, not the judging)."""
    cfg = dict(new_prompts=str(logged), work=str(tmp / "work"), deciders=str(tmp / "deciders"),
               target=target, draft=draft, dtype="float32", strategy="ti-mcsd", width=2, depth=3,
               max_new_tokens=12, chat=False, live_prompts=0, heldout_fraction=0.3, threads=1, min_prompts=8,
               margin=-1.0, auc_tolerance=1.0,
               fit_overrides=["--replay.cost_model", "default", "--trainer.max_epochs", "2",
                              "--trainer.logger", "false", "--threads", "1", "--data.val_fraction", "0.3",
                              "--data.test_fraction", "0.0", "--replay.decider_ms", "0.1",
                              "--replay.baselines", "false"])
    path = tmp / "retrain.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def tracked_state() -> str:
    out = subprocess.run(["git", "status", "--porcelain", "--", *TRACKED], cwd=ROOT, capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else "not a git checkout"


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.read().decode()


def complete(port: int, prompt: str) -> str:
    body = json.dumps({"model": "specstop", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def serving_version(port: int) -> tuple[str, str]:
    """(version, decider) of the specstop_serving_info line of /metrics."""
    line = next(x for x in get(port, "/metrics").splitlines() if x.startswith("specstop_serving_info{"))
    labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))
    return labels["version"].strip('"'), labels["decider"].strip('"')


def logged_rows(folder: Path) -> int:
    """Rows in the files the server has handed over (the open one is hidden until then)."""
    return sum(len(f.read_text().splitlines()) for f in folder.glob("traffic-*.jsonl"))


def wait_for(check, what: str, timeout: float, proc: subprocess.Popen):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"the server exited ({proc.returncode}) while waiting for {what}"
        try:
            got = check()
        except OSError:
            got = None
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_serve_log_retrain_promote_reload(tmp_path):
    before = tracked_state()
    t_model = tiny_llama(0, vocab=len(WORDS), scale=6, max_pos=128)
    target = save_tiny(tmp_path / "target", WORDS, t_model)
    draft = save_tiny(tmp_path / "draft", WORDS, noisy_copy(t_model, 0.05))
    logs, seed = tmp_path / "logged", tmp_path / "seed"
    write_prompts(seed, "seed.jsonl", 20)
    config = retrain_config(tmp_path, target, draft, logs)

    # 1. the first decider, from seed prompts
    assert R.main(["--config", str(config), "--logged", str(seed)]) == R.EXIT_PROMOTED
    first = json.loads((tmp_path / "deciders" / "registry.json").read_text())["latest"]

    # 2. serve it, logging every request (files rotated at 100 bytes: the retrain sees them at once)
    port = free_port()
    cmd = [sys.executable, "-m", "decoding.serve", "--port", str(port), "--target", target, "--draft", draft,
           "--strategy", "ti-mcsd", "--width", "2", "--depth", "3", "--stop", "decider",
           "--decider", str(tmp_path / "deciders"), "--dtype", "float32", "--threads", "1",
           "--reload-interval", "0.2", "--log-prompts", str(logs), "--log-rotate-mb", "0.0001"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for(lambda: json.loads(get(port, "/health"))["status"] == "ok", "the server", 120, proc)
        assert serving_version(port) == ("0", first)
        ar = Decoder.load(target, None, strategy="ar", dtype="float32")
        want = {p: ar.generate(p, NEW_TOKENS).text for p in TRAFFIC}
        for p in TRAFFIC:
            assert complete(port, p) == want[p], p
        wait_for(lambda: logged_rows(logs) == len(TRAFFIC), "the logged files", 30, proc)

        # 3. the scheduled retrain consumes exactly those files, then has nothing to do
        assert R.main(["--config", str(config)]) == R.EXIT_PROMOTED
        second = json.loads((tmp_path / "deciders" / "registry.json").read_text())["latest"]
        assert second != first
        cursor = json.loads((tmp_path / "work" / "cursor.json").read_text())
        names = {e["name"] for e in cursor["consumed"]}
        assert {f.name for f in logs.glob("traffic-*.jsonl")} <= names
        assert R.main(["--config", str(config)]) == R.EXIT_UP_TO_DATE

        # 4. the server picks the promotion up without a restart, and stays lossless
        wait_for(lambda: serving_version(port) == ("1", second), "the reload", 60, proc)
        for p in TRAFFIC[:8]:
            assert complete(port, p) == want[p], p
        assert 'specstop_reloads_total{outcome="failed"} 0.0' in get(port, "/metrics")
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert tracked_state() == before, "a user's loop changed tracked files of the checkout"
