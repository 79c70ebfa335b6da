"""decoding.serve under a hostile crowd, on tiny models: 50 clients at once, streamed and not,
some leaving mid-stream, some sending bad bodies, some with stop strings or logprobs, against a
queue that overflows (503 with Retry-After, the client comes back). Afterwards the server is
healthy, every well-formed greedy answer equals plain decoding's, /metrics adds up to what was
sent, no request hung, and no request's caches are left in the engine. About 10 s on 2 cores."""

import json
import threading
import time

import pytest
from support.serve import save_pair, serving

from decoding import Decoder
from decoding.bench.serve_client import TIMEOUT, bad_bodies, get_json, moved, post, scrape

pytestmark = pytest.mark.xdist_group("server-load")
PROMPTS = ["w1 w2 w3", "w4 w5", "w6 w1 w2 w7 w3", "w2", "w9 w8 w7 w6", "w3 w3"]
KINDS = ("plain", "stream", "chat", "stop", "leave")
WELL_FORMED = 40
MAX_ACTIVE, MAX_QUEUE = 4, 8
BAD = [(body, names) for _, body, names in bad_bodies("tiny", " ".join(["w1"] * 70))]  # past the 60 positions


def plan(i: int) -> dict:
    """Client i's well-formed greedy request (a stream where `stream`)."""
    p, n, kind, odd = PROMPTS[i % len(PROMPTS)], (4, 8, 12)[i % 3], KINDS[i % len(KINDS)], i // len(KINDS) % 2
    n = 48 if kind == "leave" else n  # long enough that most leave before their end
    req = {"model": "tiny", "max_tokens": n, "temperature": 0, "stream": kind in ("stream", "leave")}
    if kind == "chat":
        req |= {"messages": [{"role": "user", "content": p}], "stream": bool(odd)}
    else:
        req["prompt"] = p
    if kind == "plain" and odd:
        req["logprobs"] = 2
    if kind == "stop":
        req |= {"stop": ["w5", " w1"], "stream": bool(odd)}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return {"kind": kind, "req": req, "path": path, "body": json.dumps(req).encode(), "prompt": p, "n": n}


def test_a_hostile_crowd_leaves_the_server_healthy_exact_and_counted(tmp_path_factory):
    t, d = save_pair(tmp_path_factory.mktemp("load"))
    spec = Decoder.load(t, d, strategy="ti-mcsd", width=2, depth=3, stop="confidence", confidence_rule="grow",
                        grow_cost="measure")
    ar = Decoder.load(t, strategy="ar")
    plans = [plan(i) for i in range(WELL_FORMED)] + [
        {"kind": "bad", "body": body, "names": names, "path": "/v1/completions"} for body, names in BAD]
    CLIENTS = len(plans)
    good = [p for p in plans if p["kind"] != "bad"]
    with serving(spec, max_active=MAX_ACTIVE, max_queue=MAX_QUEUE) as (worker, port):
        # hold the engine's first round until the queue has overflowed, so the 503 path is taken
        gate, step = threading.Event(), worker.engine.step
        worker.engine.step = lambda: (gate.wait(TIMEOUT), step())[1]
        before = scrape(port)
        results, busy, errors = [None] * CLIENTS, [], []
        start = threading.Barrier(CLIENTS)

        def client(i: int) -> None:
            p = plans[i]
            try:
                start.wait()
                for _ in range(60):
                    status, headers, body = post(port, p["path"], p["body"], p.get("req", {}).get("stream", False),
                                                 int(p["kind"] == "leave"))
                    if status != 503:
                        results[i] = (status, body)
                        return
                    busy.append(headers.get("retry-after"))
                    time.sleep(float(headers["retry-after"]))  # as asked
                errors.append(f"client {i}: still 503 after 60 tries")
            except Exception as e:  # a timeout included: a hung request
                errors.append(f"client {i} ({p['kind']}): {type(e).__name__}: {e}")

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for th in threads:
            th.start()
        deadline = time.time() + TIMEOUT
        while worker.queue_depth + worker.active + len(busy) < len(good) and time.time() < deadline:
            time.sleep(0.01)  # every well-formed client has been queued, or turned away
        gate.set()
        for th in threads:
            th.join(max(0.0, deadline + 2 * TIMEOUT - time.time()))
        assert not [i for i, th in enumerate(threads) if th.is_alive()], "a request hung"
        assert not errors, errors
        assert busy and set(busy) == {"1"}  # the queue overflowed, and each 503 said when to come back

        while (worker.active or worker.queue_depth) and time.time() < deadline + 3 * TIMEOUT:
            time.sleep(0.01)  # the leavers' cancels land at the next seam
        assert get_json(port, "/health") == (200, {"status": "ok", "active": 0, "waiting": 0})
        assert worker.engine.active == [] and worker._running == []  # no request's caches left behind

        tok = ar.session.tokenizer
        known = {"length": 0, "stop": 0}
        for i, p in enumerate(plans):
            status, body = results[i]
            if p["kind"] == "bad":
                msg = body["error"]["message"]
                assert status == 400 and p["names"] in msg and "\n" not in msg, (p["body"], msg)
                continue
            assert status == 200, (p, body)
            if p["kind"] == "leave":
                continue
            chat = p["kind"] == "chat"
            want = ar.generate(p["prompt"], p["n"], chat=chat)
            text, finish = want.text, ("stop" if want.token_ids[-1] == ar.session.eos_token_id else "length")
            if p["kind"] == "stop":
                cuts = [k for k in (text.find(s) for s in p["req"]["stop"]) if k >= 0]
                text, finish = (text[:min(cuts)], "stop") if cuts else (text, finish)
            if p["req"]["stream"]:
                got, got_finish = body.text, body.finish
            else:
                c = body["choices"][0]
                got, got_finish = (c["message"]["content"] if chat else c["text"]), c["finish_reason"]
                if p["kind"] != "stop":
                    assert body["usage"]["completion_tokens"] == len(want.token_ids)
                if "logprobs" in p["req"]:
                    assert c["logprobs"]["tokens"] == [tok.decode([k]) for k in want.token_ids]
            assert (got, got_finish) == (text, finish), (i, p["req"])
            if p["kind"] != "stop":  # a stop string may race the request's own end in the counters
                known[finish] += 1

        after = scrape(port)
        outcomes = {o: moved(after, before, "specstop_requests_total", outcome=o) for o in ("length", "stop", "cancelled", "error")}
        # each well-formed request was accepted once (its 503s were not), and ended once
        assert sum(outcomes.values()) == len(good) and outcomes["error"] == 0, outcomes
        assert outcomes["cancelled"] <= sum(p["kind"] == "leave" for p in good)
        assert outcomes["length"] >= known["length"] and outcomes["stop"] >= known["stop"], (outcomes, known)
        prompt_len = lambda p: len(ar.generate(p["prompt"], 1, chat=p["kind"] == "chat").prompt_ids)  # noqa: E731
        assert moved(after, before, "specstop_prompt_tokens_total") == sum(prompt_len(p) for p in good)
        assert after[("specstop_queue_depth", ())] == 0 and after[("specstop_active_requests", ())] == 0

        again = post(port, "/v1/completions", json.dumps({"model": "tiny", "prompt": "w4 w5", "max_tokens": 8,
                                                          "temperature": 0}).encode())
        assert again[0] == 200 and again[2]["choices"][0]["text"] == ar.generate("w4 w5", 8).text
