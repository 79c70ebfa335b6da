"""training.head.promote on a tiny random target: a head whose paired step-1 interval clears 0
replaces the champion in one swap with its lineage recorded; one that does not, evidence for
another head or baseline, and a head of another target leave the champion as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.head import make_head, make_head_target
from support.models import noisy_copy

from decoding.drafts.io import load_feature_draft, save_feature_draft
from decoding.models import fingerprint, load_model
from training.head import promote as P
from training.head.redistill import dir_sha

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("promote")
    target = make_head_target(root / "target")
    champion = make_head(target, root / "champion", damaged=False)
    t = load_model(target)
    save_feature_draft(noisy_copy(load_feature_draft(champion, t), 0.05, seed=3), root / "challenger", t,
                       {"dtype": "float32"})
    other = make_head(make_head_target(root / "other-target", seed=1), root / "other-head", damaged=False)
    return target, champion, root / "challenger", other


def evidence(tmp: Path, head: Path, champion: Path, low: float) -> Path:
    """A greedy paired evaluation as training.bench.head writes it (the keys the gate reads)."""
    base = tmp / "baseline.json"
    base.write_text(json.dumps({"head": str(champion), "continuations": "greedy"}))
    paired = {"baseline": str(base), "agree_step1": [low + 0.03, low, low + 0.06]}
    out = tmp / "eval.json"
    out.write_text(json.dumps({"head": str(head), "continuations": "greedy", "teacher_forced": {
        "general": {"vs_baseline": paired}, "code": {"vs_baseline": {**paired, "agree_step1": [0.04, 0.01, 0.07]}}}}))
    return out


def site(tmp_path, made):
    import shutil

    target, champion, challenger, other = made
    shipped = tmp_path / "drafts" / "head"
    shutil.copytree(champion, shipped)
    return target, shipped, challenger, other


def test_a_head_that_clears_the_gate_replaces_the_champion_with_its_lineage(tmp_path, made):
    target, shipped, challenger, _ = site(tmp_path, made)
    old_fp = fingerprint(load_feature_draft(shipped, load_model(target)))
    ev = evidence(tmp_path, challenger, shipped, low=0.01)
    assert P.promote(challenger, shipped, ev, str(target), log=lambda m: None) == P.EXIT_PROMOTED
    assert (shipped / "model.safetensors").read_bytes() == (challenger / "model.safetensors").read_bytes()
    marker = json.loads((shipped / "specstop_draft.json").read_text())
    assert marker["redistilled_from"] == json.loads(json.dumps(old_fp))  # training.retrain reads this
    assert [p.name for p in shipped.parent.iterdir()] == ["head"]  # no temporary copy left
    assert P.promote(challenger, shipped, ev, str(target), log=lambda m: None) == P.EXIT_UP_TO_DATE
    assert json.loads((shipped / "specstop_draft.json").read_text()) == marker  # the lineage kept


@pytest.mark.parametrize("case", ["interval", "other evidence", "other baseline", "other target"])
def test_the_champion_is_untouched_unless_the_gate_passes(tmp_path, made, case):
    target, shipped, challenger, other = site(tmp_path, made)
    before, lines = dir_sha(shipped), []
    head = other if case == "other target" else challenger
    ev = evidence(tmp_path, challenger if case != "other evidence" else other,
                  shipped if case != "other baseline" else challenger, low=-0.01 if case == "interval" else 0.01)
    rc = P.promote(head, shipped, ev, str(target), log=lines.append)
    assert rc == (P.EXIT_KEPT if case == "interval" else P.EXIT_BAD_INPUT)
    assert dir_sha(shipped) == before and len(lines) == 1
    assert lines[0].startswith("kept" if case == "interval" else "error:")


def test_the_gate_reads_the_bench_s_real_output(monkeypatch):
    """The committed evaluation that promoted the shipped head passes the gate as written, and
    its baseline, which evaluated the head then at the same path, no longer names the shipped one."""
    monkeypatch.chdir(ROOT)  # its paths are the repository's
    ev = json.loads(Path("reports/head-train-2026-12-07/eval_greedy_wsd.json").read_text())
    old = json.loads(Path("reports/draft/feature/eval_greedy.json").read_text())["weights_sha256"]
    wsd = Path("checkpoints/training/smollm2-135m-eagle3-wsd/best")
    ok, why = P.gate(ev, wsd, P.SHIPPED, ev["weights_sha256"], old)
    assert ok and "general step 1 +0.032" in why and "code step 1 +0.040" in why
    with pytest.raises(ValueError, match="does not evaluate"):
        P.gate(ev, wsd, P.SHIPPED, ev["weights_sha256"], ev["weights_sha256"])


def test_the_command_line_says_one_error_line_for_a_missing_head(tmp_path, capsys):
    assert P.main(["--challenger", str(tmp_path / "none"), "--evidence", str(tmp_path / "e.json")]) == P.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no head directory")
