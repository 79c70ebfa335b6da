"""Which logged files a scheduled retrain consumes (training.decider.retrain on the seams of
tests/support/retrain_seams.py: synthetic traces, a hand-made decider; the selection, cursor and
decision are the real code): only whole unconsumed files, each once; a re-run with nothing new
or too few prompts exits 11 and changes nothing; a minimum below the split's floor is bad input."""

import json
from types import SimpleNamespace

import pytest
import yaml

from support import retrain_seams
from support.decider import write_prompts
from support.models import noisy_copy, tiny_llama
from training import logged as L
from training.decider import retrain as R

SPLIT = ["--data.val_fraction", "0.3"]  # read by the minimum's checks (the stand-in fit ignores it)


@pytest.fixture
def env(tmp_path, monkeypatch):
    target = tiny_llama(0, vocab=16, layers=1, hidden=16)
    sess = SimpleNamespace(target=target, draft=noisy_copy(target, 0.05))
    retrain_seams.install(monkeypatch.setattr, {"kind": "good"})
    monkeypatch.setattr(R, "live_tokens_per_s", lambda *a: 1.0)
    seen = []
    real = R.decide_files
    monkeypatch.setattr(R, "decide_files", lambda cfg, root, work, prompts, *a: seen.append(len(prompts))
                        or real(cfg, root, work, prompts, *a))

    def cfg(**kw):
        base = dict(new_prompts=str(tmp_path / "logged"), work=str(tmp_path / "work"),
                    deciders=str(tmp_path / "deciders"), heldout_fraction=0.3, live_prompts=1,
                    min_prompts=8, fit_overrides=SPLIT)
        return R.RetrainConfig(**{**base, **kw})

    def run(**kw):
        logs = []
        return R.run(cfg(**kw), session=sess, log=logs.append), logs

    def state():
        """Everything a run may change: the cursor, the registry, the run directories."""
        return {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in tmp_path.rglob("*")
                if p.is_file() and "logged" not in p.parts and p.name != ".lock"}

    return SimpleNamespace(run=run, cfg=cfg, state=state, seen=seen, logged=tmp_path / "logged",
                           work=tmp_path / "work", tmp=tmp_path)


def consumed(env) -> list[str]:
    return [e["name"] for e in L.read_cursor(env.work)]


def test_each_whole_file_once(env):
    write_prompts(env.logged, "day1.jsonl", 16)
    (env.logged / ".traffic-x.jsonl.part").write_text('{"prompt": "still being written"}\n')
    assert env.run()[0] == R.EXIT_PROMOTED
    assert consumed(env) == ["day1.jsonl"] and env.seen == [16]
    before = env.state()
    rc, logs = env.run()  # nothing new: says so, touches nothing
    assert rc == R.EXIT_UP_TO_DATE and logs == [logs[0]] and logs[0].startswith("up to date: no new logged files")
    assert env.state() == before and env.seen == [16]
    write_prompts(env.logged, "day2.jsonl", 12, offset=5)
    assert env.run(margin=10.0)[0] == R.EXIT_KEPT
    assert env.seen == [16, 12]  # only the new file's prompts
    assert consumed(env) == ["day1.jsonl", "day2.jsonl"]
    entry = next(e for e in L.read_cursor(env.work) if e["name"] == "day2.jsonl")
    assert entry["size"] == (env.logged / "day2.jsonl").stat().st_size and len(entry["sha256"]) == 64
    write_prompts(env.logged, "day2.jsonl", 14, offset=9)  # rewritten: new bytes, new input
    assert env.run(margin=10.0)[0] == R.EXIT_KEPT and env.seen[-1] == 14


def test_too_few_prompts_wait_and_are_not_consumed(env):
    write_prompts(env.logged, "a.jsonl", 5)
    before = env.state()
    rc, logs = env.run()
    assert rc == R.EXIT_UP_TO_DATE and len(logs) == 1 and "min_prompts 8" in logs[0] and "5 new prompts" in logs[0]
    assert env.state() == before == {} and env.seen == []  # nothing made, not even the work directory
    write_prompts(env.logged, "b.jsonl", 6, offset=11)
    assert env.run()[0] == R.EXIT_PROMOTED
    assert consumed(env) == ["a.jsonl", "b.jsonl"] and env.seen == [11]


def test_an_empty_split_part_waits_too(env, monkeypatch):
    write_prompts(env.logged, "a.jsonl", 16)
    monkeypatch.setattr(L, "is_heldout", lambda pid, f: False)
    rc, logs = env.run()
    assert rc == R.EXIT_UP_TO_DATE and "held-out part empty" in logs[0] and env.state() == {}


def test_floor_and_directory_are_bad_input(env, capsys):
    assert L.prompts_floor(0.25, 0.15) == 9 and L.prompts_floor(0.3, 0.3) == 5
    path = env.tmp / "cfg.yaml"
    write_prompts(env.logged, "a.jsonl", 16)
    for kw, msg in ((dict(min_prompts=4), "error: min_prompts 4 is below 5"),
                    (dict(new_prompts=str(env.tmp / "nowhere")), "error: logged prompts directory not found")):
        path.write_text(yaml.safe_dump(vars(env.cfg(**kw))))
        assert R.main(["--config", str(path)]) == R.EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(msg)
    assert not env.work.exists()
    (env.logged / "a.jsonl").unlink()
    path.write_text(yaml.safe_dump(vars(env.cfg())))
    assert R.main(["--config", str(path), "--logged", str(env.logged)]) == R.EXIT_UP_TO_DATE  # empty: 11


def test_a_decided_run_without_its_cursor_entry_is_consumed(env):
    write_prompts(env.logged, "day1.jsonl", 16)
    assert env.run()[0] == R.EXIT_PROMOTED
    (env.work / L.CURSOR).unlink()  # a crash between the decision and the cursor
    rc, logs = env.run()
    assert rc == R.EXIT_UP_TO_DATE and "already decided" in logs[0] and consumed(env) == ["day1.jsonl"]


def test_logged_rows_keep_raw(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": "x", "raw": True}) + "\n"
                                      + json.dumps({"prompt": "y"}) + "\n")
    assert {(p.text, p.raw) for p in L.read_logged(tmp_path)} == {("x", True), ("y", False)}
