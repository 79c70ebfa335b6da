"""The serve gate (training/export/gate.py) and its use by training.head.redistill, with vLLM's
half replaced by a fake interpreter (the test seam: `serve_check_python`). The fake answers
the requests as vllm_side.py does (one engine per process, a JSON line per prompt): greedy tokens
from transformers' own `generate` (not specstop's engine) and the accepted counts the test tells
it (vLLM's counter)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from support.head import setup_run, teacher_of
from training.head import redistill as RD
from training.export import gate

FAKE = '''#!{python}
import json, os, sys, torch
from transformers import AutoModelForCausalLM
req = json.load(open(sys.argv[2]))
if os.environ.get("FAKE_VLLM_FAIL"):
    print(json.dumps({{"error": "ValueError: cannot load the draft"}}), flush=True); sys.exit(1)
m = AutoModelForCausalLM.from_pretrained(req["target"], dtype=torch.float32).eval()
acc = json.load(open(os.environ["FAKE_VLLM_ACCEPTED"]))
speculative = bool(req.get("draft") or req.get("model"))
print(json.dumps({{"ready": True, "vllm": "fake", "construct_s": 0.0}}), flush=True)
for i, line in enumerate(sys.stdin):
    ids = json.loads(line)["ids"]
    g = m.generate(torch.tensor([ids]), max_new_tokens=req["max_tokens"], do_sample=False,
                   eos_token_id=req["eos"] or None, pad_token_id=0)
    out = g[0, len(ids):].tolist()
    print(json.dumps({{"outputs": out, "seconds": 1.0, "accepted": acc[i] if speculative else 0,
                      "drafted": 3 * len(out)}}), flush=True)
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    path = tmp_path / "fake-python"
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    return path


def ours_accepted(champ: Path, target: str, rows: list[dict], tokens: int) -> list[int]:
    from decoding import Decoder

    dec = Decoder.load(target, str(champ), dtype="float32", strategy="sd", gamma=3, stop="fixed")
    return [dec.generate(r["ids"], max_new_tokens=tokens).stats["accepted"] for r in rows]


def test_gate_passes_fails_and_skips(tmp_path, damaged_champion, fake, monkeypatch):
    cfg, champ = setup_run(tmp_path, damaged_champion)
    rows = [{"id": f"p{i}", "kind": "general", "ids": [1] + [3 + (5 * i + j) % 60 for j in range(8)]}
            for i in range(3)]
    acc = ours_accepted(champ, cfg.target, rows, 12)
    (tmp_path / "acc.json").write_text(json.dumps(acc))
    monkeypatch.setenv("FAKE_VLLM_ACCEPTED", str(tmp_path / "acc.json"))
    ok = gate.serve_gate(champ, cfg.target, str(fake), rows, 12, log=lambda m: None)
    assert ok["status"] == "passed" and ok["accepted"] == acc, ok
    (tmp_path / "acc.json").write_text(json.dumps([a + 1 for a in acc]))
    bad = gate.serve_gate(champ, cfg.target, str(fake), rows, 12, log=lambda m: None)
    assert bad["status"] == "failed" and "vLLM + head accepted" in bad["reason"]
    assert len(bad["failures"]) == 6  # 3 prompts, each through the eagle3 and the speculators export
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    broken = gate.serve_gate(champ, cfg.target, str(fake), rows, 12, log=lambda m: None)
    assert broken["status"] == "failed" and "cannot load the draft" in broken["reason"]
    assert gate.serve_gate(champ, cfg.target, str(tmp_path / "none"), rows, 12)["status"] == "skipped"
    assert gate.serve_gate(champ, cfg.target, None, rows, 12)["status"] == "skipped"


def test_redistill_keeps_the_champion_when_vllm_would_serve_it_differently(tmp_path, damaged_champion, fake, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")  # vLLM cannot load the challenger
    cfg, champ = setup_run(tmp_path, damaged_champion, serve_check_python=str(fake), serve_check_prompts=2,
                           serve_check_tokens=8)
    before = {p.name: p.read_bytes() for p in champ.iterdir()}
    assert RD.run(cfg, teacher_of(damaged_champion[1]), log=lambda m: None) == RD.EXIT_KEPT
    (dec,) = (tmp_path / "work").glob(f"*/{RD.DECISION}")
    d = json.loads(dec.read_text())
    # the quality gate alone would have promoted it (a damaged champion)
    assert d["challenger_metrics"]["accepted_length"] > d["champion_metrics"]["accepted_length"]
    assert not d["promoted"] and d["serve_check"]["status"] == "failed"
    assert d["reason"].startswith("serve contract broken")
    assert {p.name: p.read_bytes() for p in champ.iterdir()} == before


def test_ratios_pair_prompts_and_bracket_the_point():
    """The serve-check's ours / vLLM ratios: tokens per second over all prompts, paired, with a
    bootstrap interval over prompts that contains the point."""
    from training.export.report import _ratios

    timed = {"bfloat16/specstop ar": {"tokens": [96, 96, 50], "seconds": [2.0, 3.0, 1.0]},
             "bfloat16/vLLM plain": {"tokens": [96, 96, 50], "seconds": [3.0, 3.0, 2.0]}}
    r = _ratios(timed, ["bfloat16", "float32"])
    point, lo, hi = r["bfloat16: specstop ar / vLLM plain"]
    assert point == pytest.approx((242 / 6.0) / (242 / 8.0), abs=1e-3) and lo <= point <= hi
    assert list(r) == ["bfloat16: specstop ar / vLLM plain"]  # pairs without data are left out
