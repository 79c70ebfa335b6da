"""decoding.serve --log-prompts end to end on tiny models: every request's row comes back through
read_logged as the prompt the retrain's collect should feed (a one-message chat wrapped again, a
completion raw), responses are kept only when asked, /metrics counts rows, and without a log
nothing is written."""

import json
import urllib.request

import pytest

from decoding import Decoder
from decoding.serve.__main__ import batch_engine, main, parser, traffic_log
from decoding.serve.app import Served, create_app
from decoding.serve.traffic_log import LogConfig, TrafficLog
from decoding.serve.worker import EngineWorker
from support.serve import running, save_pair
from training.logged import logged_files, read_logged

pytestmark = pytest.mark.xdist_group("server")


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    t, d = save_pair(tmp_path_factory.mktemp("logged-served"))
    return Decoder.load(t, d, strategy="ti-mcsd", width=2, depth=3)


def post(port, path, body) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read()) if not body.get("stream") else {"events": r.read().decode()}


def serve_some(decoder, log) -> str:
    """Four requests (chat, streamed chat, text and token-id completions); the /metrics text."""
    worker = EngineWorker(batch_engine(decoder, "joint"), max_active=2, max_queue=8).start()
    eos = decoder.session.eos_token_id
    served = Served("tiny", decoder.session.tokenizer, 60, (eos,), 6, log)
    with running(create_app(served, worker)) as port:
        post(port, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}]})
        post(port, "/v1/chat/completions", {"model": "tiny", "stream": True, "messages": [
            {"role": "system", "content": "w3"}, {"role": "user", "content": "w4 w5"}]})
        post(port, "/v1/completions", {"model": "tiny", "prompt": "w6 w7"})
        post(port, "/v1/completions", {"model": "tiny", "prompt": decoder.session.tokenizer.encode("w2 w1")})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
    worker.close()
    if log is not None:
        log.close()
    return metrics


@pytest.mark.parametrize("keep", ["prompts", "responses"])
def test_served_requests_come_back_as_retrain_prompts(decoder, tmp_path, keep):
    log = TrafficLog(LogConfig(str(tmp_path / "logged"), keep=keep)).start()
    metrics = serve_some(decoder, log)
    assert "specstop_logged_requests_total" in metrics
    assert 'specstop_log_dropped_total{reason="queue_full"} 0.0' in metrics
    prompts = {p.text: p for p in read_logged(tmp_path / "logged")}
    assert len(prompts) == 4
    assert not prompts["w1 w2"].raw and prompts["w1 w2"].kind == "chat"  # the collect wraps it as served
    convo = next(p for p in prompts.values() if "w4 w5" in p.text)
    assert convo.raw and convo.text == "w3 w4 w5 "  # rendered with the template: fed as is
    assert prompts["w6 w7"].raw and prompts["w2 w1"].raw and prompts["w6 w7"].kind == "completion"
    rows = [json.loads(x) for f in logged_files(tmp_path / "logged") for x in f.read_text().splitlines()]
    assert all(r["time"].endswith("Z") and len(r["id"]) == 16 for r in rows)
    assert next(r for r in rows if r["prompt"] == "w1 w2")["messages"] == [{"role": "user", "content": "w1 w2"}]
    if keep == "responses":
        assert all(r["finish_reason"] in ("stop", "length") and isinstance(r["response"], str) for r in rows)
        assert any(r["response"] for r in rows)
    else:
        assert not any("response" in r for r in rows)
    assert log.logged == 4


def test_without_the_option_nothing_is_logged(decoder, tmp_path, capsys):
    assert traffic_log(parser().parse_args([])) is None
    metrics = serve_some(decoder, None)
    assert "specstop_logged_requests" not in metrics
    for bad in (["--log-sample-rate", "0"], ["--log-rotate-mb", "-1"]):
        with pytest.raises(ValueError):
            traffic_log(parser().parse_args(["--log-prompts", str(tmp_path / "x"), *bad]))
    assert not (tmp_path / "x").exists()
    assert main(["--log-prompts", str(tmp_path / "x"), "--log-sample-rate", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --log-sample-rate must be in (0, 1]")
