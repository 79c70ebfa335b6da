"""decoding.serve.reload on tiny checkpoints: a promoted head or decider serves the requests
admitted after it while those in flight finish on theirs, greedy outputs equal `ar` before and
after, a corrupt promotion or a decider for another pair keeps the old models (counted, version
unchanged, not retried until the files change), a head waits for its decider, nothing reloads
when nothing changed, and through the HTTP app /health and /metrics report the version."""

import http.client
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from decoding import Decoder
from decoding.decider import policy
from decoding.decider.policy import DeciderConfig, DeciderNet, save_decider
from decoding.drafts.io import load_feature_draft, save_feature_draft
from decoding.models import fingerprint, load_model
from decoding.sampling import SamplingConfig
from decoding.serve.__main__ import attach_reloader, batch_engine
from decoding.serve.app import Served, create_app
from decoding.serve.reload import Reloader
from decoding.serve.worker import EngineWorker
from decoding.strategies import StrategyConfig, build_engine
from support.head import make_head, make_head_target
from support.models import noisy_copy
from support.serve import running
from training.swap import replace_dir

pytestmark = pytest.mark.xdist_group("server")
PROMPTS = [[1, 5, 7, 3], [1, 8, 9], [1, 12, 12, 30, 4]]
N = 12
COST = {"sizes": [1, 8, 16, 64], "target_ms": [10.0, 11.0, 13.0, 30.0], "draft_ms": [1.0, 1.1, 1.2, 2.0]}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(target dir, {name: head dir}): three random heads for one tiny target."""
    root = tmp_path_factory.mktemp("reload")
    target = make_head_target(root / "target")
    heads = {"a": make_head(target, root / "head_a", damaged=False)}
    t = load_model(target)
    for i, name in enumerate("bc", 1):  # the same shape, other weights (other fingerprints)
        save_feature_draft(noisy_copy(load_feature_draft(heads["a"], t), 0.05, seed=i), root / f"head_{name}", t,
                           {"dtype": "float32"})
        heads[name] = root / f"head_{name}"
    return target, heads


@pytest.fixture
def site(made, tmp_path, monkeypatch):
    """A served head directory (a copy of head a) and an empty deciders root."""
    target, heads = made
    served = tmp_path / "drafts" / "head"
    shutil.copytree(heads["a"], served)
    monkeypatch.setattr(policy, "DECIDERS_DIR", tmp_path / "deciders")
    return target, heads, served


def promote(src: Path, served: Path, spoil=None) -> None:
    """What training.head.redistill does: the new head complete beside, then one exchange."""
    tmp = served.with_name(f".{served.name}.new")
    shutil.copytree(src, tmp)
    if spoil:
        spoil(tmp)
    replace_dir(tmp, served)


def register(target: Path, head: Path, run: str) -> None:
    """A decider fitted for (target, head) promoted as the registry's latest."""
    t = load_model(target)
    pair = {"target": fingerprint(t), "draft": fingerprint(load_feature_draft(head, t))}
    cfg = DeciderConfig(kind="logistic", rule="grow", model_pair=pair, cost_model=COST)
    save_decider(policy.DECIDERS_DIR / run, DeciderNet(cfg), cfg, {})
    reg = policy.DECIDERS_DIR / "registry.json"
    reg.with_suffix(".tmp").write_text(json.dumps({"latest": run, "runs": [{"run_id": run}]}))
    os.replace(reg.with_suffix(".tmp"), reg)


def load(target, served, stop="fixed"):
    return Decoder.load(str(target), str(served), strategy="ti-mcsd", width=2, depth=3, stop=stop)


def ar(dec, prompt):
    return build_engine(dec.session.target, None, StrategyConfig(strategy="ar"), SamplingConfig()).generate(
        prompt, N)[0]


def reloading(dec, budget):
    lines = []
    engine = batch_engine(dec, budget)
    return engine, Reloader(dec, engine, budget, interval=0.0, log=lines.append), lines


def test_a_promoted_head_serves_new_requests_while_old_ones_finish_on_theirs(site):
    target, heads, served = site
    dec = load(target, served)
    eng, rel, lines = reloading(dec, "independent")
    old_head = eng.draft
    first = eng.add(PROMPTS[0], N)
    eng.step()
    promote(heads["b"], served)
    assert rel.check() == "ok" and rel.serving.version == 1 and rel.outcomes == {"ok": 1}
    assert "loaded in" in lines[-1] and "version 1" in lines[-1]
    assert eng.draft is not old_head and dec.session.draft is eng.draft  # the decoder describes what serves
    second = eng.add(PROMPTS[1], N)
    assert first.models.draft is old_head and second.models.draft is eng.draft
    eng.run()
    assert first.out == ar(dec, PROMPTS[0]) and second.out == ar(dec, PROMPTS[1])
    assert rel.check() is None  # served now: nothing new


def test_nothing_changed_nothing_reloads(site):
    target, _, served = site
    register(target, served, "run1")
    dec = load(target, served, stop="decider")
    eng, rel, lines = reloading(dec, "joint")
    eng.add(PROMPTS[0], N)
    eng.run()
    os.utime(served.parent)  # the folder beside it touched: not the head
    assert [rel.check() for _ in range(3)] == [None] * 3
    assert rel.outcomes == {} and lines == [] and eng.models.version == 0


def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])


def _bad_config(d: Path) -> None:
    (d / "config.json").write_text("{not json")


@pytest.mark.parametrize("spoil", [_truncate, _bad_config], ids=["truncated", "bad-config"])
def test_a_corrupt_promotion_keeps_the_old_head(site, spoil):
    target, heads, served = site
    dec = load(target, served)
    eng, rel, lines = reloading(dec, "independent")
    old_head = eng.draft
    promote(heads["b"], served, spoil)
    assert rel.check() == "failed" and rel.outcomes == {"failed": 1}
    assert eng.draft is old_head and rel.serving.version == 0 and eng.models.version == 0
    assert len(lines) == 1 and lines[0].startswith("reload: kept version 0") and "not loaded" in lines[0]
    assert rel.check() is None and rel.outcomes == {"failed": 1}  # not retried until the files change
    r = eng.add(PROMPTS[2], N)
    eng.run()
    assert r.out == ar(dec, PROMPTS[2])
    promote(heads["b"], served)  # a good one next
    assert rel.check() == "ok" and rel.serving.version == 1 and eng.draft is not old_head


def test_a_head_waits_for_its_decider_then_both_swap(site):
    target, heads, served = site
    register(target, served, "run1")
    dec = load(target, served, stop="decider")
    eng, rel, lines = reloading(dec, "joint")
    old_head, old_scorer = eng.draft, eng.budget.scorer
    assert rel.serving.decider == "run1"
    promote(heads["b"], served)
    assert rel.check() == "failed" and "waits for a decider fitted for it" in lines[-1]
    assert eng.draft is old_head and rel.serving.version == 0
    r = eng.add(PROMPTS[0], N)
    register(target, heads["b"], "run2")  # its decider is promoted: both swap together
    assert rel.check() == "ok"
    assert eng.draft is not old_head and eng.budget.scorer is not old_scorer
    assert rel.serving.decider == "run2" and rel.serving.version == 1
    assert r.models.draft is old_head and r.models.budget.scorer is old_scorer
    s = eng.add(PROMPTS[1], N)
    eng.run()
    assert r.out == ar(dec, PROMPTS[0]) and s.out == ar(dec, PROMPTS[1])


def test_a_promoted_decider_for_the_same_pair_swaps_alone(site):
    target, _, served = site
    register(target, served, "run1")
    dec = load(target, served, stop="decider")
    eng, rel, lines = reloading(dec, "joint")
    head, scorer = eng.draft, eng.budget.scorer
    register(target, served, "run2")
    assert rel.check() == "ok" and rel.serving.decider == "run2" and rel.serving.version == 1
    assert eng.draft is head and eng.budget.scorer is not scorer  # the head was not reloaded
    r = eng.add(PROMPTS[0], N)
    eng.run()
    assert r.out == ar(dec, PROMPTS[0])


def test_a_decider_for_another_pair_is_refused(site):
    target, heads, served = site
    register(target, served, "run1")
    dec = load(target, served, stop="decider")
    eng, rel, lines = reloading(dec, "independent")
    register(target, heads["c"], "run2")  # fitted for another head
    assert rel.check() == "failed" and "another draft model" in lines[-1]
    assert rel.serving.decider == "run1" and rel.serving.version == 0 and eng.models.version == 0


# ---- through the HTTP app ----------------------------------------------------------------------

def _get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    return conn.getresponse().read().decode()


def _complete(port, prompt) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": N,
                                                        "temperature": 0}))
    return json.loads(conn.getresponse().read())


def _metrics(port) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(_get(port, "/metrics")) for s in fam.samples}


def _until(cond, what):
    end = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_the_server_swaps_between_rounds_and_reports_it(site):
    target, heads, served = site
    dec = load(target, served)
    worker = EngineWorker(batch_engine(dec, "joint"), max_active=4, max_queue=8)
    attach_reloader(worker, dec, "joint", 0.05)
    worker.start()
    app = create_app(Served("tiny", dec.session.tokenizer, 120, (), N), worker)
    try:
        with running(app) as port:
            tok = dec.session.tokenizer
            want = {i: tok.decode(ar(dec, p), skip_special_tokens=True) for i, p in enumerate(PROMPTS)}
            assert _complete(port, PROMPTS[0])["choices"][0]["text"] == want[0]
            before = _metrics(port)
            info0 = [k for k in before if k[0] == "specstop_serving_info"]
            assert len(info0) == 1 and dict(info0[0][1])["version"] == "0"
            promote(heads["b"], served)  # the engine is idle: its wait ends for the check
            _until(lambda: json.loads(_get(port, "/health")).get("version") == 1, "version 1 served")
            assert _complete(port, PROMPTS[1])["choices"][0]["text"] == want[1]
            after = _metrics(port)
            assert after[("specstop_reloads_total", (("outcome", "ok"),))] == 1
            info = [dict(k[1]) for k in after if k[0] == "specstop_serving_info"]
            assert len(info) == 1 and info[0]["version"] == "1" and info[0]["head"] != dict(info0[0][1])["head"]
            promote(heads["c"], served, _truncate)
            _until(lambda: _metrics(port).get(("specstop_reloads_total", (("outcome", "failed"),))) == 1,
                   "the failed reload counted")
            health = json.loads(_get(port, "/health"))
            assert health["version"] == 1 and "not loaded" in health["reload_error"]
            assert _complete(port, PROMPTS[2])["choices"][0]["text"] == want[2]
    finally:
        worker.close()
