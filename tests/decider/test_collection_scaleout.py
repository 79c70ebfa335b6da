"""Collection across processes, and SIGKILL in the middle of a collection."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support.models import WORDS, noisy_copy, save_tiny, tiny_llama
from training.decider.traces import load_traces

ROOT = Path(__file__).resolve().parents[2]

# one xdist worker runs this module (--dist loadgroup): the tiny pair and the reference
# collection are made once
pytestmark = pytest.mark.xdist_group("test_scaleout")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    target = tiny_llama(0, vocab=len(WORDS), scale=6, max_pos=128)
    t = save_tiny(root / "target", WORDS, target)
    d = save_tiny(root / "draft", WORDS, noisy_copy(target, 0.05))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "kind": "general", "prompt": f"w{i % 30} w{(3 * i) % 30} w5"}) + "\n"
                               for i in range(12)))
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


@pytest.fixture(scope="module")
def single(setup):
    """The reference: one process collects every prompt (6 shards of 2)."""
    res = run(collect_cmd(setup, setup[0] / "single"))
    assert res.returncode == 0, res.stderr
    return setup[0] / "single"


@pytest.mark.slow
def test_two_process_collection_merges_to_single_run(setup, single):
    root = setup[0]
    procs = [subprocess.Popen(collect_cmd(setup, root / "multi", "--shard-index", str(i), "--num-shards", "2"),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    assert rows(root / "multi") == rows(single)


# Runs training.decider.collect with the third shard's atomic write stopped between its temp file and
# the rename: the child says PAUSED and sleeps, and the test kills it then (an event, not a
# deadline: the same state on any machine, however fast).
PAUSE_AT_THIRD_SHARD = """
import os, runpy, sys, time
import training.shards as S
real = S.atomic_write
def paused(path, write):
    if path.name == "shard-00002.parquet":
        write(path.with_name(f".{path.name}.tmp-{os.getpid()}"))
        print("PAUSED", flush=True)
        time.sleep(600)
    real(path, write)
S.atomic_write = paused
sys.argv = ["training.decider.collect", *sys.argv[1:]]
runpy.run_module("training.decider.collect", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_sigkill_mid_collection_resumes_without_loss_or_duplicates(setup, single, tmp_path):
    ref, out = single, setup[0] / "killed"
    cmd = collect_cmd(setup, out)
    with open(tmp_path / "stderr", "w") as err:
        p = subprocess.Popen([sys.executable, "-c", PAUSE_AT_THIRD_SHARD, *cmd[3:]], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=err, text=True)
        timer = threading.Timer(300, p.kill)  # a child that never pauses cannot hang the suite
        timer.start()
        try:
            lines = iter(p.stdout.readline, "")
            paused = any(line.strip() == "PAUSED" for line in lines)
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        finally:
            timer.cancel()
    assert paused, (tmp_path / "stderr").read_text()[-2000:]
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) == 2
    assert list(out.glob(".shard-00002.parquet.tmp-*"))  # the kill left a half-written shard
    again = run(collect_cmd(setup, out))
    assert again.returncode == 0, again.stderr
    assert not list(out.glob(".*.tmp-*"))
    assert rows(out) == rows(ref)
    ids = [r["prompt_id"] for r in load_traces(out)[1].select(["prompt_id", "round", "node"]).to_pylist()]
    assert len(ids) == len(rows(ref))


def test_missing_prompt_file_one_error_line(setup, tmp_path):
    root, t, d, _ = setup
    res = run([sys.executable, "-m", "training.collect", "--prompt-files", str(tmp_path / "nope.jsonl"),
               "--out", str(tmp_path / "o"), "--target", t, "--draft", d])
    assert res.returncode != 0 and res.stderr.strip().count("\n") == 0 and "not found" in res.stderr
