"""The serve-load suite's pieces without a model: what each answer counts as, the plans, the table
and its checks, and the opt-in fault hook (off unless its variable is set)."""

import json

import pytest

from decoding.batch.scheduler import BatchEngine
from decoding.bench import serve_load as L
from decoding.bench.serve_client import Streamed, bad_bodies
from decoding.serve import faults

PROMPTS = ["one", "two", "three"]
BAD = bad_bodies(L.MODEL, "word " * 10)


def err(message, code=None):
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


@pytest.mark.parametrize("answer, want", [
    ((200, {"choices": [{"text": "hi", "finish_reason": "length"}]}), ("completed", "length")),
    ((200, Streamed("hi", "stop", [], None, True)), ("completed", "stop")),
    ((200, Streamed("h", None, [], None, False, True, 2)), ("left", "")),
    ((200, Streamed("h", None, [], "InjectedFault: injected fault (seed 3)", True)), ("failed", "InjectedFault")),
    ((200, Streamed("h", None, [], None, False)), ("lost", "stream ended without a finish and [DONE]")),
    ((400, err("prompt (9 tokens) + max_tokens (4) exceeds", "context_length_exceeded")),
     ("refused 400", "context_length_exceeded")),
    ((400, err("max_tokens: Input should be a valid integer")), ("refused 400", "max_tokens")),
    ((400, err("JSON decode error")), ("refused 400", "JSON decode error")),
    ((400, err("0: Input should be a valid dictionary")), ("refused 400", "Input should be a valid")),
    ((503, err("server busy: the queue is full")), ("refused 503", "server busy")),
    ((500, err("RuntimeError: boom")), ("failed", "RuntimeError")),
    ((404, err("model 'x' is not served here")), ("failed", "HTTP 404: model 'x' is not served")),
    ((502, {"raw": "Bad Gateway"}), ("failed", "HTTP 502: Bad Gateway")),
])
def test_each_answer_has_one_outcome_and_reason(answer, want):
    assert L.classify(*answer) == want


def test_no_answer_is_lost_and_a_timeout_is_hung():
    assert L.classify(None, None, ConnectionResetError()) == ("lost", "ConnectionResetError")
    assert L.classify(None, None, TimeoutError()) == ("hung", "no answer in time")


def test_plans_cover_the_mix_and_greedy_ones_are_checked_against_their_answer_alone():
    for k in range(6):
        for kind in L.MIX:
            p = L.make_plan(kind, k, PROMPTS, BAD)
            if kind in ("bad", "oversized"):
                assert p["names"] is not None and p["path"] == "/v1/completions"
                continue
            req = json.loads(p["body"])
            assert req["model"] == L.MODEL and req["stream"] == p["stream"]
            greedy = kind not in ("sampled", "leave", "fault")
            assert (p["key"] is not None) == greedy and (req["temperature"] == 0) == (kind != "sampled")
            assert (req.get("seed") == L.FAULT_SEED) == (kind == "fault") and bool(p["leave"]) == (kind == "leave")
    chat = L.make_plan("chat", 4, PROMPTS, BAD)
    assert chat["key"] == ("chat", 1) and json.loads(chat["body"])["messages"][0]["content"] == "two"
    assert L.expected_text("Hello. World\nmore", L.STOPS) == "Hello"


def _judged(kind, status, body, exc=None, refs=None, k=0, flood=False):
    bad = [b for b in BAD if b[0] == "prompt over the context"] if kind == "oversized" else BAD
    p = L.make_plan(kind, k, PROMPTS, bad) | ({"kind": "flood"} if flood else {})
    return L.judge(p, status, body, exc, refs or {}) | {"retried_503": 0}


def test_judge_compares_greedy_text_and_flags_the_unexpected():
    refs = {("completion", 0): "Yes. And", ("chat", 0): "Sure"}
    ok = _judged("stop", 200, {"choices": [{"text": "Yes", "finish_reason": "stop"}]}, refs=refs)
    assert ok["equal"] and ok["expected"]
    off = _judged("greedy stream", 200, Streamed("Yes. Or", "length", [], None, True), refs=refs)
    assert off["equal"] is False and off["expected"]
    assert not _judged("fault", 200, {"choices": [{"text": "x", "finish_reason": "length"}]})["expected"]
    assert _judged("fault", 500, err("InjectedFault: injected"))["expected"]
    # a 400 that does not name what was wrong is unexpected
    assert not _judged("bad", 400, err("something"), k=3)["expected"]
    assert _judged("oversized", 400, err("prompt (9 tokens) + max_tokens", "context_length_exceeded"))["expected"]


def _result(records, alive=True, rss_end=1010.0, errors=1):
    return {"clients": 2, "requests_per_client": 3, "duration_s": None, "threads": 2, "timeout_s": 120,
            "max_batch": 8, "max_queue": 16, "burst": 32, "wall_s": 12.5, "records": records,
            "server": {"pid": 42, "alive_throughout": alive, "restarts": 0 if alive else 1,
                       "health_end": {"status": "ok", "active": 0, "waiting": 0}},
            "metrics_outcomes": {"length": 2, "stop": 0, "cancelled": 1, "error": errors},
            "rss_mib": {"start": 300.0, "after warm-up": 900.0, "half-way": 1000.0, "end": rss_end, "max": 1020.0},
            "command": "python -m decoding.bench --suite serve-load"}


def test_the_table_counts_outcomes_by_kind_and_the_checks_pass_or_fail():
    refs = {("completion", 0): "a", ("chat", 0): "b"}
    recs = [_judged("greedy", 200, {"choices": [{"text": "a", "finish_reason": "length"}]}, refs=refs),
            _judged("chat stream", 200, Streamed("b", "length", [], None, True), refs=refs),
            _judged("leave", 200, Streamed("", None, [], None, False, True, 1)),
            _judged("fault", 200, Streamed("", None, [], "InjectedFault: injected", True)),
            _judged("bad", 400, err("JSON decode error"), k=0),
            _judged("greedy", 503, err("server busy: full"), flood=True)]
    s = L.summarize(_result(recs))
    assert s["passed"], s["checks"]
    assert s["total"] == {"completed": 2, "left": 1, "failed": 1, "refused 400": 1, "refused 503": 1}
    assert s["accepted"] == 4 and s["greedy_equal"] == [2, 2]
    assert s["reasons"]["failed"] == {"InjectedFault": 1}
    md = L.load_markdown(_result(recs) | {"summary": s}, "Test CPU")
    assert "| greedy | 1 | 1 | . | . | . | . | . | . | 1/1 |" in md
    assert "| **all** | 6 | 2 | 1 | 1 | 1 | 1 | . | . | 2/2 |" in md and "**PASS**" in md
    lost = recs + [_judged("greedy", None, None, ConnectionResetError())]
    s = L.summarize(_result(lost, alive=False, rss_end=1200.0, errors=0))
    assert not s["passed"] and not s["rss_flat"]
    assert {k for k, v in s["checks"].items() if not v} == {"0 lost", "0 unexpected", "0 restarts", "RSS flat",
                                                            "metrics add up"}
    assert "**FAIL**" in L.load_markdown(_result(lost, alive=False), "Test CPU")


def test_the_fault_hook_is_off_unless_its_variable_is_set(monkeypatch):
    monkeypatch.setattr(BatchEngine, "_commit", BatchEngine._commit)  # restored after the test
    commit = BatchEngine._commit
    assert faults.install({}) is None and BatchEngine._commit is commit
    assert faults.install({faults.ENV: str(L.FAULT_SEED)}) == L.FAULT_SEED
    assert faults.install({faults.ENV: str(L.FAULT_SEED)}) == L.FAULT_SEED  # once only

    class Req:
        seed = L.FAULT_SEED

    with pytest.raises(faults.InjectedFault):
        BatchEngine._commit(None, Req())
    Req.seed = 7
    monkeypatch.setattr(BatchEngine, "_commit", lambda self, r, *a: "committed")
    assert faults.install({faults.ENV: "5"}) == 5 and BatchEngine._commit(None, Req()) == "committed"
