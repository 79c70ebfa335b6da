"""HTTP client pieces for load tests of decoding.serve: one request (streamed or not, or left
mid-stream), a /metrics scrape, and the malformed bodies a hostile crowd sends. Shared by the
serve-load suite (decoding.bench.serve_load) and tests/serve/test_hostile_load.py."""

from __future__ import annotations

import http.client
import json
import socket
from typing import NamedTuple

TIMEOUT = 30.0  # per request: past it a request counts as hung instead of stalling its caller


class Streamed(NamedTuple):
    """A streamed answer: its text, finish reason, logprob tokens, the error event's message (if
    one came), whether `data: [DONE]` ended it, and whether the client left after `events` events."""

    text: str
    finish: str | None
    tokens: list
    error: str | None
    done: bool
    left: bool = False
    events: int = 0


def bad_bodies(model: str, over_context: str) -> list[tuple[str, bytes, str]]:
    """(label, body, what the 400's message names) of each malformed request; `over_context`: a
    prompt longer than the server's context."""
    return [
        ("truncated JSON", f'{{"model": "{model}", "prompt": '.encode(), ""),
        ("JSON array", b"[1, 2, 3]", ""),
        ("not UTF-8", b"\xff\xfe not utf-8", ""),
        ("prompt a number", json.dumps({"model": model, "prompt": 5, "max_tokens": 4}).encode(), "prompt"),
        ("max_tokens a string", json.dumps({"model": model, "prompt": "w1", "max_tokens": "lots"}).encode(),
         "max_tokens"),
        ("max_tokens 1e9", json.dumps({"model": model, "prompt": "w1", "max_tokens": 10**9}).encode(), "max_tokens"),
        ("prompt over the context", json.dumps({"model": model, "prompt": over_context, "max_tokens": 4}).encode(),
         "prompt"),
        ("unknown field", json.dumps({"model": model, "prompt": "w1", "max_tokens": 4, "frobnicate": True}).encode(),
         "frobnicate"),
        ("logprobs 9", json.dumps({"model": model, "prompt": "w1", "max_tokens": 4, "logprobs": 9}).encode(),
         "logprobs"),
        ("negative temperature", json.dumps({"model": model, "prompt": "w1", "max_tokens": 4,
                                             "temperature": -1}).encode(), "temperature"),
    ]


def post(port: int, path: str, body: bytes, stream: bool = False, leave: int = 0, timeout: float = TIMEOUT):
    """(status, headers, body): the JSON body (a non-JSON one as {"raw": text}), or for a 200 stream
    a Streamed; `leave`: hang up after that many events. Connection errors and timeouts raise."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        headers = {k.lower(): v for k, v in r.getheaders()}
        if r.status != 200 or not stream:
            raw = r.read()
            try:
                return r.status, headers, json.loads(raw)
            except ValueError:
                return r.status, headers, {"raw": raw.decode(errors="replace")}
        text, finish, tokens, error, done, events = "", None, [], None, False, 0
        for raw in iter(r.readline, b""):
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
                continue
            if not line.startswith("data: "):
                continue
            obj = json.loads(line[6:])
            events += 1
            if "error" in obj:
                error = obj["error"].get("message", "?")
                continue
            choice = obj["choices"][0]
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finish = choice["finish_reason"] or finish
            tokens += (choice.get("logprobs") or {}).get("tokens") or []
            if leave and events >= leave:
                conn.sock.shutdown(socket.SHUT_RDWR)
                return 200, headers, Streamed(text, finish, tokens, error, done, True, events)
        return 200, headers, Streamed(text, finish, tokens, error, done, False, events)
    finally:
        conn.close()


def get_json(port: int, path: str, timeout: float = TIMEOUT):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def scrape(port: int, timeout: float = TIMEOUT) -> dict:
    """/metrics as {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def moved(after: dict, before: dict, name: str, **labels) -> float:
    """How far a /metrics sample moved between two scrapes."""
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)
