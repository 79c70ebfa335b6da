"""Collection across processes, and SIGKILL in the middle of a collection."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import noisy_copy, tiny_llama
from test_cli import WORDS, save_tiny
from training.traces import load_traces

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    target = tiny_llama(0, vocab=len(WORDS), scale=6, max_pos=128)
    t = save_tiny(root / "target", WORDS, target)
    d = save_tiny(root / "draft", WORDS, noisy_copy(target, 0.05))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "kind": "general", "prompt": f"w{i % 30} w{(3 * i) % 30} w5"}) + "\n"
                               for i in range(24)))
    return root, t, d, prompts


def collect_cmd(setup, out, *extra):
    root, t, d, prompts = setup
    return [sys.executable, "-m", "training.collect", "--prompt-files", str(prompts), "--out", str(out),
            "--target", t, "--draft", d, "--dtype", "float32", "--chat", "false", "--width", "2",
            "--depth", "3", "--max-new-tokens", "16", "--shard-size", "2", "--threads", "1", *extra]


def rows(path):
    t = load_traces(path)[1].to_pylist()
    return sorted(t, key=lambda r: (r["prompt_id"], r["round"], r["node"]))


def run(cmd):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_two_process_collection_merges_to_single_run(setup):
    root = setup[0]
    single = run(collect_cmd(setup, root / "single"))
    assert single.returncode == 0, single.stderr
    procs = [subprocess.Popen(collect_cmd(setup, root / "multi", "--shard-index", str(i), "--num-shards", "2"),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    assert rows(root / "multi") == rows(root / "single")


def test_sigkill_mid_collection_resumes_without_loss_or_duplicates(setup):
    root = setup[0]
    ref = root / "single-ref"
    assert run(collect_cmd(setup, ref)).returncode == 0
    out = root / "killed"
    p = subprocess.Popen(collect_cmd(setup, out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    manifest = out / "manifest.json"
    deadline = time.time() + 120
    while time.time() < deadline:  # kill once some but not all shards are written
        if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 2:
            break
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    done = len(json.loads(manifest.read_text())["shards"])
    assert 2 <= done < 12
    again = run(collect_cmd(setup, out))
    assert again.returncode == 0, again.stderr
    assert rows(out) == rows(ref)
    ids = [r["prompt_id"] for r in load_traces(out)[1].select(["prompt_id", "round", "node"]).to_pylist()]
    assert len(ids) == len(rows(ref))


def test_missing_prompt_file_one_error_line(setup, tmp_path):
    root, t, d, _ = setup
    res = run([sys.executable, "-m", "training.collect", "--prompt-files", str(tmp_path / "nope.jsonl"),
               "--out", str(tmp_path / "o"), "--target", t, "--draft", d])
    assert res.returncode != 0 and res.stderr.strip().count("\n") == 0 and "not found" in res.stderr
