"""decoding.serve through the real `openai` client on tiny models: answers equal the batch-1
engine's, with the finish reason and token counts it implies, concurrent requests each keep their
own answer, streaming adds up, /metrics counts known traffic exactly, and bad input, disconnects
and cancellations get one error each while the server goes on serving. The command itself
(`python -m decoding.serve`, a real process): test_serve_command.py."""

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from support.serve import alone, finish_reason, running, save_pair

from decoding import Decoder
from decoding.serve.worker import batch_engine
from decoding.serve.app import Served, create_app
from decoding.serve.worker import EngineWorker

pytestmark = pytest.mark.xdist_group("server")  # one server per module, on one worker
PROMPTS = ["w1 w2 w3", "w4 w5", "w6 w1 w2 w7 w3", "w2"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module", params=["joint", "independent"])
def server(pair, request):
    t, d = pair
    dec = Decoder.load(t, d, strategy="ti-mcsd", width=2, depth=3, stop="confidence", confidence_rule="grow",
                       grow_cost="measure")
    worker = EngineWorker(batch_engine(dec, request.param), max_active=4, max_queue=16).start()
    eos = dec.session.eos_token_id
    served = Served("tiny", dec.session.tokenizer, 60, (eos,) if isinstance(eos, int) else (), 8)
    with running(create_app(served, worker)) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        yield dec, worker, client, port
    worker.close()


def test_greedy_answers_equal_the_batch_1_engine(server):
    dec, _, client, _ = server
    reasons = []
    for p in PROMPTS:
        got = client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
        want = dec.generate(p, 8)
        assert got.choices[0].text == want.text
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_ids), len(want.token_ids))
        assert got.choices[0].finish_reason == finish_reason(dec, want)
        reasons.append(finish_reason(dec, want))
    assert set(reasons) == {"length", "stop"}  # the prompts end both ways ("w4 w5" on end of text)


def scrape(port) -> dict:
    """/metrics as {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_count_known_traffic(server):
    """Four greedy requests one after another: each counter moves by exactly what they did."""
    dec, worker, client, port = server
    before = scrape(port)
    wants = [dec.generate(p, 8) for p in PROMPTS]
    for p in PROMPTS:
        client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
    after = scrape(port)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before[key]

    for outcome in ("length", "stop", "cancelled", "error"):
        want = sum(finish_reason(dec, w) == outcome for w in wants)
        assert moved("specstop_requests_total", outcome=outcome) == want, outcome
    assert moved("specstop_generated_tokens_total") == sum(len(w.token_ids) for w in wants)
    assert moved("specstop_prompt_tokens_total") == sum(len(w.prompt_ids) for w in wants)
    rounds = moved("specstop_rounds_total")
    assert rounds >= len(PROMPTS) and moved("specstop_round_requests_total") == rounds  # one request a round
    assert moved("specstop_verify_rows_total") >= rounds
    assert after[("specstop_tokens_per_round", ())] == after[("specstop_generated_tokens_total", ())] / after[
        ("specstop_round_requests_total", ())]
    assert after[("specstop_queue_depth", ())] == 0 and after[("specstop_active_requests", ())] == 0


def test_concurrent_clients_each_get_their_own_answer(server):
    dec, worker, client, _ = server
    jobs = PROMPTS * 3
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=10,
                                                                 temperature=0).choices[0].text, jobs))
    assert got == [alone(dec, p, 10) for p in jobs]
    assert worker.counters.rounds > 0 and worker.counters.round_requests > worker.counters.rounds  # batched
    assert worker.engine.active == []


@pytest.mark.parametrize("content,finish", [("w1 w2", "length"), ("w4 w5", "stop")])
def test_a_stream_adds_up_to_the_answer(server, content, finish):
    dec, _, client, _ = server
    msgs = [{"role": "user", "content": content}]
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert finish_reason(dec, dec.generate(content, 8, chat=True)) == finish  # what the tiny target does
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == finish


def test_models_health_and_metrics(server):
    _, _, client, port = server
    assert [m.id for m in client.models.list()] == ["tiny"]
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read())["status"] == "ok"
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    for name in ("specstop_generated_tokens_total", "specstop_tokens_per_round", "specstop_queue_depth",
                 "specstop_tokens_per_second", 'specstop_requests_total{outcome="length"}'):
        assert name in text, name


def post(port, body: bytes):
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_bad_input_gets_one_error_and_the_server_goes_on(server):
    dec, worker, client, port = server
    status, body = post(port, b'{"model": "tiny", "prompt": ')
    assert status == 400 and "error" in body and "\n" not in body["error"]["message"]
    status, body = post(port, b'{"model": "tiny", "prompt": "w1", "max_tokens": 0}')
    assert status == 400 and "max_tokens" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt="w1", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="exceeds the context"):
        client.completions.create(model="tiny", prompt=" ".join(["w1"] * 58), max_tokens=8)
    with pytest.raises(openai.BadRequestError, match="token ids"):
        client.completions.create(model="tiny", prompt=[1, 10_000], max_tokens=4)
    assert client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=8,
                                     temperature=0).choices[0].text == alone(dec, "w1 w2 w3", 8)


def test_a_client_that_leaves_mid_stream_is_cancelled_and_nothing_leaks(server, monkeypatch):
    dec, worker, client, port = server
    before = worker.counters.requests["cancelled"]
    # After its first round the request waits until the server has heard the client leave, so it
    # cannot end on its own first (a sampled end of text, or its last token on a fast machine). A
    # first token with no text of its own sends no event: until the client has read one, a round
    # runs every half second, so the client gets its event and leaves.
    gone, read, rounds, step, cancel = threading.Event(), threading.Event(), [], worker.engine.step, worker.cancel

    def held_step():
        rounds.append(1)
        if len(rounds) > 1 and not gone.is_set() and (read.is_set() or read.wait(0.5)):
            gone.wait(20)
            return []  # no round: the next seam drops the cancelled request
        return step()

    monkeypatch.setattr(worker.engine, "step", held_step)
    monkeypatch.setattr(worker, "cancel", lambda job: (cancel(job), gone.set()))
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "w1 w2", "max_tokens": 50,
                                                        "stream": True, "temperature": 0.7}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.read(6) == b"data: "  # the first event arrived
    read.set()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 20
    while (worker.counters.requests["cancelled"] == before or worker.active) and time.time() < deadline:
        time.sleep(0.05)
    assert worker.counters.requests["cancelled"] > before and worker.active == 0
    assert worker.engine.active == []  # its caches left with it
    assert client.completions.create(model="tiny", prompt="w4 w5", max_tokens=8,
                                     temperature=0).choices[0].text == alone(dec, "w4 w5", 8)


# ---- the OpenAI parameters users send: honoured, or refused by name ----------------------------

def test_a_stop_string_ends_the_text_where_it_matches_across_tokens(server):
    dec, worker, client, _ = server
    full = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=0)
    text = full.choices[0].text
    assert len(text) > 6, text
    stop = text[3:6]  # spans the boundary between two tokens ("w3 w5 ..." style words)
    cut = text[:text.find(stop)]
    got = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=0, stop=[stop, "zz"])
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    pieces, reasons = [], []
    for ch in client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=0, stop=stop,
                                        stream=True):
        pieces.append(ch.choices[0].text)
        reasons.append(ch.choices[0].finish_reason)
    assert "".join(pieces) == cut and reasons[-1] == "stop"
    never = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=0, stop="zz")
    assert never.choices[0].text == text and never.choices[0].finish_reason == full.choices[0].finish_reason


def test_stop_token_ids_end_the_answer_as_end_of_text(server):
    dec, _, client, _ = server
    want = dec.generate(PROMPTS[0], 8)
    stop_id = want.token_ids[2]
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id]})
    k = want.token_ids.index(stop_id)
    assert got.choices[0].text == dec.session.tokenizer.decode(want.token_ids[:k], skip_special_tokens=True)
    assert got.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs,name", [
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ({"logprobs": 6}, "logprobs"), ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"), ({"best_of": 3}, "best_of"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop")])
def test_what_is_not_served_is_refused_by_name(server, kwargs, name):
    _, _, client, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="w1", max_tokens=2, **kwargs)
    assert name in str(e.value)


def test_neutral_values_of_unserved_fields_are_accepted(server):
    dec, _, client, _ = server
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, presence_penalty=0,
                                    frequency_penalty=0, user="someone", logprobs=None)
    assert got.choices[0].text == dec.generate(PROMPTS[0], 8).text


def test_a_sampled_request_without_a_seed_is_random(server):
    _, _, client, _ = server
    ask = lambda **kw: client.completions.create(model="tiny", prompt="w1", max_tokens=24, temperature=1.5,  # noqa: E731
                                                 **kw).choices[0].text
    assert len({ask() for _ in range(4)}) > 1
    assert ask(seed=7) == ask(seed=7)


def test_streamed_text_never_holds_half_a_character_or_a_stop_prefix():
    """The split-character path, on a byte tokenizer: a character's bytes cross tokens."""
    from decoding.serve.app import _Text

    class Bytes:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    t = _Text(Bytes(), (), ["ab!"])
    word = list("é ab".encode())  # é is two bytes
    text, stopped = t.add(word[:1])
    assert not stopped and t.safe(text) == ""  # half of é: held back
    text, _ = t.add(word[1:])
    assert t.safe(text) == "é " and text == "é ab"  # "ab" may start the stop string: held back
    text, stopped = t.add(list(b"!x"))
    assert stopped and text == "é "


def test_a_full_queue_answers_503_with_retry_after(server):
    from starlette.testclient import TestClient

    dec, _, _, _ = server
    idle = EngineWorker(batch_engine(dec, "joint"), max_active=1, max_queue=0)  # never started: nothing leaves
    eos = dec.session.eos_token_id
    app = create_app(Served("tiny", dec.session.tokenizer, 60, (eos,) if isinstance(eos, int) else (), 8), idle)
    r = TestClient(app).post("/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and "busy" in r.json()["error"]["message"]


def test_drain_finishes_what_was_accepted_refuses_new_and_times_out(server):
    from decoding.sampling import SamplingConfig
    from decoding.serve.worker import Busy, Job

    dec, _, _, _ = server
    worker = EngineWorker(batch_engine(dec, "joint"), max_active=2, max_queue=8).start()
    for p in PROMPTS:
        worker.submit(Job(dec.session.encode(p), 8, SamplingConfig()))
    worker.drain(60)
    with pytest.raises(Busy, match="shutting down"):
        worker.submit(Job(dec.session.encode("w1"), 8, SamplingConfig()))
    worker._thread.join(60)
    c = worker.counters.requests
    assert not worker._thread.is_alive() and c["length"] + c["stop"] == len(PROMPTS) and c["error"] == 0
    worker = EngineWorker(batch_engine(dec, "joint"), max_active=2, max_queue=8).start()
    worker.submit(Job(dec.session.encode(PROMPTS[0]), 40, SamplingConfig()))
    worker.drain(0)  # nothing may finish in time: the request ends with an error
    worker._thread.join(60)
    assert worker.counters.requests["error"] == 1


def test_a_request_whose_round_fails_ends_alone(server, monkeypatch):
    from decoding.batch import scheduler as S

    dec, _, client, _ = server
    bad = dec.session.tokenizer.encode(PROMPTS[2])
    verify = S.verify_many

    def faulty(target, segs):
        if any(list(s.committed[:len(bad)]) == bad and len(s.committed) > len(bad) + 2 for s in segs):
            raise RuntimeError("injected verify fault")
        return verify(target, segs)
    monkeypatch.setattr(S, "verify_many", faulty)

    def ask(p):
        try:
            return client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text
        except openai.InternalServerError as e:
            return e
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ask, PROMPTS))
    assert isinstance(got[2], openai.InternalServerError) and "injected verify fault" in str(got[2])
    for i, p in enumerate(PROMPTS):
        if i != 2:
            assert got[i] == alone(dec, p, 8)
