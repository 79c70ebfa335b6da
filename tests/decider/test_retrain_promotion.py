"""Every promotion branch of training.decider.retrain, on synthetic traces (seconds, no real fit).

Seams (tests/support/retrain_seams.py): synthetic traces instead of collection, a hand-made decider
instead of a fit, and a table instead of the live check; assess / decide / the registry
compare-and-swap / the decision record are the real code. Crashes and races are injected at
the exact step (events, no timing).
"""

import json
from types import SimpleNamespace

import pytest

from support import retrain_seams
from support.models import noisy_copy, tiny_llama
from support.retrain_seams import make_decider
from support.decider import write_prompts
from decoding.decider import policy as D
from training.decider import registry
from training.decider import retrain as R


class Crash(BaseException):
    """Stands in for a kill: no `except Exception` handler sees it."""


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A champion (quality chosen per test) and a retrain whose challenger quality is chosen too."""
    target = tiny_llama(0, vocab=16, layers=1, hidden=16)
    sess = SimpleNamespace(target=target, draft=noisy_copy(target, 0.05))
    state = {"kind": "good", "live": {}, "assessed": 0}
    retrain_seams.install(monkeypatch.setattr, state)
    real_assess = R.assess

    def counting_assess(*a, **k):
        state["assessed"] += 1
        return real_assess(*a, **k)

    monkeypatch.setattr(R, "assess", counting_assess)
    monkeypatch.setattr(R, "live_tokens_per_s",
                        lambda s, d, p, c: state["live"].get("chall" if d.name.startswith("retrain-") else "champ", 1.0))
    write_prompts(tmp_path / "logged", "day1.jsonl", 16)

    def run(**kw):
        logs = []
        cfg = R.RetrainConfig(new_prompts=str(tmp_path / "logged"), work=str(tmp_path / "work"),
                              deciders=str(tmp_path / "deciders"), heldout_fraction=0.4,
                              live_prompts=1, min_prompts=8, fit_overrides=["--data.val_fraction", "0.3"], **kw)
        return R.run(cfg, session=sess, log=logs.append), logs

    def latest():
        return registry.read_registry(tmp_path / "deciders")["latest"]

    def decision():
        (d,) = (tmp_path / "work").glob("*/decision.json")
        assert not list((tmp_path / "work").glob("*/" + R.PENDING))
        return json.loads(d.read_text())

    return SimpleNamespace(root=tmp_path / "deciders", state=state, run=run, latest=latest,
                           decision=decision, work=tmp_path / "work")


def test_challenger_wins(env):
    make_decider(env.root, "champ", "timid", promote=True)
    rc, _ = env.run(margin=0.02)
    d = env.decision()
    assert rc == R.EXIT_PROMOTED and env.latest() == d["challenger"] and d["promoted"]
    assert d["champion"] == "champ" and d["reason"] == "beats the champion on held-out traces"
    assert d["challenger_metrics"]["tokens_per_s"] > d["champion_metrics"]["tokens_per_s"] * 1.02


def test_challenger_loses_on_roc_auc(env):
    make_decider(env.root, "champ", "good", promote=True)
    env.state["kind"] = "inverted"
    rc, _ = env.run(margin=-1.0, auc_tolerance=0.01)  # the replay check passes; AUC decides
    d = env.decision()
    assert rc == R.EXIT_KEPT and env.latest() == "champ" and not d["promoted"]
    assert d["reason"].startswith("ROC-AUC") and d["challenger_metrics"]["roc_auc"] < 0.5 < d["champion_metrics"]["roc_auc"]


def test_challenger_fails_the_live_check(env):
    make_decider(env.root, "champ", "good", promote=True)
    env.state["live"] = {"champ": 100.0, "chall": 80.0}
    rc, _ = env.run(margin=-1.0, live_tolerance=0.1)
    d = env.decision()
    assert rc == R.EXIT_KEPT and env.latest() == "champ"
    assert d["reason"] == "slower than the champion in the live check"
    assert d["challenger_metrics"]["live_tokens_per_s"] == 80.0


def test_concurrent_promotion_is_not_overwritten(env, monkeypatch):
    make_decider(env.root, "champ", "timid", promote=True)
    real_decide = R.decide

    def fit_promotes_meanwhile(*a):  # a training.decider.fit promotes while retrain is comparing
        make_decider(env.root, "other", "timid", promote=True)
        return real_decide(*a)

    monkeypatch.setattr(R, "decide", fit_promotes_meanwhile)
    rc, logs = env.run()
    assert rc == R.EXIT_LATEST_MOVED == 75 and env.latest() == "other"
    assert len(logs) == 1 and logs[0].startswith("error: ") and "'other'" in logs[0] and "'champ'" in logs[0]
    assert not list(env.work.glob("*/decision*.json"))
    monkeypatch.setattr(R, "decide", real_decide)
    rc, _ = env.run()  # the next run compares against the new champion
    assert rc == R.EXIT_PROMOTED and env.decision()["champion"] == "other"


@pytest.mark.parametrize("when", ["before the swap", "after the swap"])
def test_crash_during_promotion_is_completed_not_recomputed(env, monkeypatch, when):
    make_decider(env.root, "champ", "timid", promote=True)
    real_register = R.register

    def crashing_register(*a, **k):
        if when == "after the swap":
            real_register(*a, **k)
        raise Crash(when)

    monkeypatch.setattr(R, "register", crashing_register)
    with pytest.raises(Crash):
        env.run()
    (pending,) = env.work.glob("*/" + R.PENDING)
    assert not list(env.work.glob("*/" + R.DECISION))
    assert env.latest() == ("champ" if when == "before the swap" else json.loads(pending.read_text())["challenger"])
    monkeypatch.setattr(R, "register", real_register)
    env.state["assessed"] = 0
    rc, _ = env.run()
    d = env.decision()
    assert rc == R.EXIT_PROMOTED and env.state["assessed"] == 0  # completed, not re-compared
    assert d["champion"] == "champ" and env.latest() == d["challenger"] != "champ"
    assert env.run()[0] == R.EXIT_UP_TO_DATE


@pytest.mark.parametrize("shipped_kind", ["timid", "good"])
def test_a_new_root_is_judged_against_the_shipped_latest_and_only_it_changes(env, tmp_path, monkeypatch,
                                                                             shipped_kind):
    shipped = tmp_path / "shipped"
    make_decider(shipped, "ship", shipped_kind, promote=True)
    monkeypatch.setattr(D, "DECIDERS_DIR", shipped)
    monkeypatch.setattr(R, "DECIDERS_DIR", shipped)
    before = {p.name: p.read_bytes() for p in shipped.rglob("*") if p.is_file()}
    rc, _ = env.run(margin=0.02)
    d = env.decision()
    assert d["champion"] == str(shipped / "ship") and d["champion_metrics"]["tokens_per_s"] > 0
    if shipped_kind == "timid":  # beaten: the challenger becomes the user root's latest
        assert rc == R.EXIT_PROMOTED and env.latest() == d["challenger"]
    else:
        assert rc == R.EXIT_KEPT and env.latest() is None and not d["promoted"]
    assert {p.name: p.read_bytes() for p in shipped.rglob("*") if p.is_file()} == before
