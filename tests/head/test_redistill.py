"""training.head.redistill on a tiny random target: promotion, refusal, idempotence, crash
recovery, bad input, the fixed-vocabulary cache, and the training.decider.retrain hook.

"Improves" is made deterministic by a damaged champion (a head initialised from the target
with its lm_head zeroed: it never agrees, so any training helps); "does not improve" by a
zero-lr challenger (the champion's own weights)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from support.head import USED, make_head, make_head_target, setup_run
from support.head import LAYERS, teacher_of
from support.decider import write_prompts

from decoding.models import load_model
from training.head import redistill as RD


def run_dirs(work: Path) -> list[Path]:
    return [p for p in work.iterdir() if p.is_dir()] if work.is_dir() else []


def snapshot(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


class Crash(BaseException):
    """Stands in for a kill (no `except Exception` sees it)."""


def test_improving_challenger_is_promoted_atomically_and_rerun_is_up_to_date(tmp_path, damaged_champion, monkeypatch):
    import training.swap

    cfg, champ = setup_run(tmp_path, damaged_champion)
    teacher = teacher_of(damaged_champion[1])
    before = snapshot(champ)
    real = training.swap.replace_dir

    def crash(new, out):
        raise Crash

    monkeypatch.setattr(training.swap, "replace_dir", crash)  # killed at the swap
    with pytest.raises(Crash):
        RD.run(cfg, teacher, log=lambda m: None)
    assert snapshot(champ) == before  # judged, pending, but the head is untouched
    (run_dir,) = (tmp_path / "work").glob("*/" + RD.PENDING)
    run_dir = run_dir.parent
    assert not (run_dir / "distill" / "checkpoints").exists()  # cleaned after export
    assert not list(Path(cfg.distill_config).parent.glob("cache/*/logged-*"))

    swaps = []
    monkeypatch.setattr(training.swap, "replace_dir", lambda new, out: swaps.append(out) or real(new, out))
    assert RD.run(cfg, teacher, log=lambda m: None) == RD.EXIT_PROMOTED  # completes, no re-compare
    assert swaps == [champ]
    dec = json.loads((run_dir / RD.DECISION).read_text())
    assert dec["promoted"] and not (run_dir / RD.PENDING).exists()
    assert dec["serve_check"]["status"] == "skipped"  # no vLLM: promoted, and the skip recorded
    m = dec["challenger_metrics"]
    assert m["accepted_length"] > dec["champion_metrics"]["accepted_length"]
    # the chain counts leading runs: step 1 alone is its agreement, step 2 needs both
    assert m["chain_step1"] == m["agree_step1"] and m["chain_step2"] <= m["agree_step2"]
    assert m["accepted_length"] == pytest.approx(m["chain_step1"] + m["chain_step2"])
    assert snapshot(champ) == snapshot(run_dir / RD.CHALLENGER) != before
    assert not [p for p in champ.parent.iterdir() if p.name.startswith(".")]  # no temp dir left
    marker = json.loads((champ / "specstop_draft.json").read_text())
    assert marker["redistilled_from"]["weights_sha256"] and marker["redistill_run"] == run_dir.name
    from decoding.drafts.io import head_vocab, load_feature_draft

    assert torch.equal(head_vocab(champ), USED)  # the champion's vocabulary, kept
    load_feature_draft(champ, load_model(damaged_champion[1]))

    # same inputs again (the champion is now this run's challenger): nothing to do
    after = snapshot(champ)
    assert RD.run(cfg, teacher, log=lambda m: None) == RD.EXIT_UP_TO_DATE
    assert snapshot(champ) == after and len(run_dirs(tmp_path / "work")) == 1


def test_challenger_that_does_not_improve_is_refused(tmp_path, damaged_champion):
    cfg, champ = setup_run(tmp_path, damaged_champion, max_steps=3, distill_overrides=["--model.lr", "0"])
    before = snapshot(champ)
    logs = []
    assert RD.run(cfg, teacher_of(damaged_champion[1]), log=logs.append) == RD.EXIT_KEPT
    assert snapshot(champ) == before  # byte-identical
    (dec,) = (tmp_path / "work").glob("*/" + RD.DECISION)
    d = json.loads(dec.read_text())
    assert not d["promoted"] and "not 2% above" in d["reason"]
    assert d["champion_sha"] == RD.dir_sha(champ)
    assert RD.run(cfg, teacher_of(damaged_champion[1]), log=logs.append) == RD.EXIT_UP_TO_DATE
    assert snapshot(champ) == before


def test_bad_input_exits_2_with_one_line(tmp_path, damaged_champion, capsys):
    import shutil

    root, target, damaged = damaged_champion
    cfg, champ = setup_run(tmp_path, damaged_champion)

    def main(**kw) -> tuple[int, str]:
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(asdict(cfg) | kw))
        code = RD.main(["--config", str(path)])
        return code, capsys.readouterr().err

    code, err = main(new_prompts=str(tmp_path / "empty"))
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: no new prompt files")
    other = make_head_target(tmp_path / "other", seed=5)
    foreign = make_head(other, tmp_path / "foreign")
    code, err = main(draft=str(foreign))
    assert code == 2 and err.count("\n") == 1 and "only fits its own target" in err
    shutil.copytree(target, tmp_path / "not-a-head")
    code, err = main(draft=str(tmp_path / "not-a-head"))
    assert code == 2 and err.count("\n") == 1 and "not a feature-draft checkpoint" in err
    code, err = main(draft=str(tmp_path / "missing"))
    assert code == 2 and err.count("\n") == 1 and "not found" in err
    assert not run_dirs(tmp_path / "work")  # nothing was started


def test_fixed_vocabulary_cache_labels_over_the_champions_ids(tmp_path, damaged_champion):
    from training.corpus.teacher import CorpusConfig, Prompt, build_corpus, read_manifest
    from training.head.cache import CacheSettings, ShardReader, build, cached
    from training.head.data import FeatureDataModule

    root, target, damaged = damaged_champion
    teacher = teacher_of(target)
    prompts = [Prompt(f"p{i}", "general", "train", "abcde"[i % 5] * (1 + i % 4)) for i in range(16)]
    corpus = tmp_path / "corpus"
    build_corpus(CorpusConfig(out=str(corpus), dtype="float32", batch_size=8, shard_size=8,
                              max_new_tokens=12, temperature=1.0), teacher, prompts, progress=False)
    s = CacheSettings(LAYERS, draft_vocab_size=40, k=8, max_prompt_tokens=16)
    own, chosen = build([str(corpus)], tmp_path / "cache", s, teacher, progress=False)
    assert not torch.equal(chosen.used, USED)  # the corpus picks another vocabulary ...
    folder, vocab = build([str(corpus)], tmp_path / "cache", s, teacher, progress=False, vocab=USED)
    assert torch.equal(vocab.used, USED) and folder != own  # ... so the fixed one gets a sibling
    assert folder.name == f"{own.name}-v{vocab.sha256()}" and vocab.coverage is not None
    again, v2 = build([str(corpus)], tmp_path / "cache", s, teacher, progress=False)
    assert again == own and torch.equal(v2.used, chosen.used)  # current callers unchanged

    shard, path = cached(folder, corpus, read_manifest(corpus))[0]
    row = ShardReader(path, shard, vocab.sha256()).row(2)
    ids = row["ids"][None]
    with torch.no_grad():
        full = torch.log_softmax(teacher.model(input_ids=ids).logits[0].float(), -1)
    want = torch.log_softmax(full[:, USED], -1)[row["label_start"]: row["label_start"] + len(row["top1"])]
    torch.testing.assert_close(row["lab_logp"].float(), want.topk(8, -1).values, atol=1e-2, rtol=1e-2)
    # the ids index USED: the target's log-probs at them are the stored labels
    torch.testing.assert_close(want.gather(-1, row["lab_ids"]), row["lab_logp"].float(), atol=1e-2, rtol=1e-2)

    dm = FeatureDataModule(corpora=[str(corpus)], target=str(target), cache_root=str(tmp_path / "cache"),
                           k=8, layers=LAYERS, max_prompt_tokens=16, val_percent=20, vocab_from=str(damaged))
    dm.setup("fit")
    assert torch.equal(dm.vocab.used, USED) and dm.settings().draft_vocab_size == 40
    with pytest.raises(ValueError, match="ascending"):
        build([str(corpus)], tmp_path / "cache", s, teacher, progress=False, vocab=USED.flip(0))


def test_retrain_runs_the_head_redistill_behind_its_gate(tmp_path, damaged_champion, monkeypatch):
    """The hook: a feature-head draft runs training.head.redistill on retrain's own prompts
    and pair; a stand-alone draft keeps redistill_command; a decider fit for the head the
    draft was re-distilled from is replaced, not compared."""
    from types import SimpleNamespace

    from support import retrain_seams
    from support.models import tiny_llama
    from decoding.decider.policy import DeciderConfig, DeciderNet, save_decider
    from decoding.drafts.io import load_feature_draft
    from decoding.models import ModelError, fingerprint
    from training.decider import registry
    from training.decider import retrain as R

    root, target, damaged = damaged_champion
    tmodel = load_model(target)
    head = load_feature_draft(damaged, tmodel)
    retrain_seams.install(monkeypatch.setattr, {"kind": "good"})
    monkeypatch.setattr(R, "live_tokens_per_s", lambda *a: 1.0)
    calls = []
    given = []
    monkeypatch.setattr(RD, "execute", lambda c, teacher=None, log=None, prompts=None:
                        calls.append(c) or given.append(prompts) or RD.EXIT_KEPT)
    monkeypatch.setattr(R.subprocess, "run", lambda cmd: calls.append(cmd) or SimpleNamespace(returncode=0))
    write_prompts(tmp_path / "logged", "day1.jsonl", 16)
    rd_path = tmp_path / "rd.yaml"
    rd_path.write_text(yaml.safe_dump({"max_steps": 5, "margin": 0.1}))

    def retrain(session, **kw):
        cfg = R.RetrainConfig(new_prompts=str(tmp_path / "logged"), work=str(tmp_path / kw.pop("work")),
                              deciders=str(tmp_path / "deciders"), heldout_fraction=0.4, live_prompts=0,
                              redistill_below=1.0, redistill_command=["echo"], redistill=str(rd_path),
                              target=str(target), min_prompts=8, fit_overrides=["--data.val_fraction", "0.3"], **kw)
        return R.run(cfg, session=session, log=lambda m: None)

    feature = SimpleNamespace(target=tmodel, draft=head, draft_dir=Path(damaged))
    assert retrain(feature, work="w1") == R.EXIT_PROMOTED
    (c,) = calls
    assert (c.max_steps, c.margin, c.draft, c.target) == (5, 0.1, str(damaged), str(target))
    assert c.new_prompts == str(tmp_path / "logged") and len(given[0]) == 16  # the retrain's new prompts
    (d,) = (tmp_path / "w1").glob("*/decision.json")
    assert json.loads(d.read_text())["redistill"]["exit_code"] == RD.EXIT_KEPT
    plain = SimpleNamespace(target=tmodel, draft=tiny_llama(0, vocab=64))
    calls.clear()
    retrain(plain, work="w2")
    assert calls == [["echo"]]

    # the head was re-distilled from `head`: a decider fit for `head` is replaced, not compared
    dcfg = DeciderConfig(kind="logistic", model_pair={"target": fingerprint(tmodel),
                                                      "draft": fingerprint(head)})
    save_decider(tmp_path / "dec" / "old", DeciderNet(dcfg), dcfg, {})
    new_dir = make_head(target, tmp_path / "new", damaged=False)
    new = SimpleNamespace(target=tmodel, draft=load_feature_draft(new_dir, tmodel))
    with pytest.raises(ModelError, match="another draft"):
        R.comparable_champion(tmp_path / "dec" / "old", new, new_dir)
    RD.mark_lineage(new_dir, fingerprint(head), "run")
    assert not R.comparable_champion(tmp_path / "dec" / "old", new, new_dir)
    assert R.comparable_champion(tmp_path / "dec" / "old", SimpleNamespace(target=tmodel, draft=head), damaged)
    assert registry.read_registry(tmp_path / "deciders")["latest"]
