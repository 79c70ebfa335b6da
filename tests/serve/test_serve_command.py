"""`python -m decoding.serve` as a user runs it: bad options are refused in one error line each;
a real server process answers as the batch-1 engine does, runs the engine's loop on its main
thread with HTTP beside it, drains on SIGTERM (exit 0, the traffic log whole) and refuses a port
already taken in one line (exit 2)."""

import json
import socket
import threading
import time

import openai
import pytest
from support.serve import alone, finish_reason, free_port, save_pair

from decoding import Decoder

pytestmark = pytest.mark.xdist_group("server")  # with the other server modules, on one worker


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("served"))


def test_the_command_refuses_bad_options_in_one_line(tmp_path, capsys):
    from decoding.serve.__main__ import main

    assert main(["--max-batch", "0"]) == 2
    assert main(["--strategy", "sd", "--gamma", "0"]) == 2
    assert main(["--target", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)


def test_the_command_serves_on_its_main_thread_and_stops_on_sigterm(pair, tmp_path):
    """`python -m decoding.serve`: the engine's loop on the main thread, HTTP beside it; SIGTERM
    ends both (exit 0) and hands over the traffic log's open file, whole; a port already taken is
    one error line and exit 2."""
    import signal
    import subprocess
    import sys
    import urllib.request

    t, d = pair
    port = free_port()
    cmd = [sys.executable, "-m", "decoding.serve", "--target", str(t), "--draft", str(d), "--strategy", "sd",
           "--gamma", "2", "--host", "127.0.0.1", "--model-name", "tiny",
           "--log-prompts", str(tmp_path / "logged"), "--log-keep", "responses"]
    proc = subprocess.Popen(cmd + ["--port", str(port)], stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        text = client.completions.create(model="tiny", prompt="w4 w5", max_tokens=6, temperature=0).choices[0].text
        assert text == alone(Decoder.load(t, d, strategy="sd", gamma=2), "w4 w5", 6)
        with socket.socket() as busy:  # a second server on a taken port
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            taken = busy.getsockname()[1]
            other = subprocess.run(cmd + ["--port", str(taken)], capture_output=True, text=True, timeout=300)
        assert other.returncode == 2 and other.stderr.strip().splitlines()[-1].startswith("error: could not serve")
        want = Decoder.load(t, d, strategy="sd", gamma=2).generate("w1 w2", 40)
        got, reasons = [], []

        def stream():
            for ch in client.completions.create(model="tiny", prompt="w1 w2", max_tokens=40, temperature=0,
                                                stream=True):
                got.append(ch.choices[0].text)
                reasons.append(ch.choices[0].finish_reason)
        reader = threading.Thread(target=stream)
        reader.start()
        while not got:  # in flight when the signal comes
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert "".join(got) == want.text and reasons[-1] == finish_reason(Decoder.load(t, d, strategy="sd", gamma=2), want)
        assert proc.wait(timeout=60) == 0  # drained, then a clean exit
    finally:
        proc.kill()
    from training.logged import logged_files

    (f,) = logged_files(tmp_path / "logged")
    rows = {r["prompt"]: r for r in map(json.loads, f.read_text().splitlines())}
    assert sorted(rows) == ["w1 w2", "w4 w5"] and rows["w1 w2"]["response"] == want.text
    assert not list((tmp_path / "logged").glob(".*"))  # nothing left half-written
