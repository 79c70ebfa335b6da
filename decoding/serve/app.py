"""The HTTP side: OpenAI-compatible routes over one EngineWorker (FastAPI + uvicorn).

/v1/completions and /v1/chat/completions (streamed as server-sent events with `stream: true`),
/v1/models, /health and Prometheus /metrics. Every bad request gets one OpenAI-style error body
and the server goes on; a client that disconnects mid-stream is cancelled at the next seam
between rounds (its caches go with it)."""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from decoding.sampling import SamplingConfig
from decoding.serve import protocol as P
from decoding.serve.logprobs import Logprobs
from decoding.serve.reload import ReloadMetrics, serving_status
from decoding.serve.traffic_log import Rows, TrafficLog
from decoding.serve.worker import Busy, EngineWorker, Job


@dataclass
class Served:
    """What the routes need besides the worker."""

    model: str
    """The name clients pass as `model` (also listed by /v1/models)."""
    tokenizer: object
    max_context: int
    """Prompt + completion tokens a request may reach (the target's positions)."""
    eos: tuple[int, ...] = ()
    default_max_tokens: int = 256
    log: TrafficLog | None = None
    """Where sampled requests are recorded for retraining (--log-prompts); None: nothing is."""


def create_app(served: Served, worker: EngineWorker) -> FastAPI:
    app = FastAPI(title="specstop", docs_url=None, redoc_url=None)
    app.add_middleware(_JsonBodies)
    registry = CollectorRegistry()
    registry.register(_Metrics(worker, served.log))
    registry.register(ReloadMetrics(worker))
    rows = Rows(served.tokenizer) if served.log else None

    def sample(make):
        """The request's log row, or None when logging is off or the draw skips it."""
        if served.log is None or not served.log.sampled():
            return None
        try:
            return make(rows)
        except Exception:  # e.g. a template that renders only tokenized: the request is served anyway
            served.log.dropped["bad_row"] += 1
            return None

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = first.get("msg", "invalid request")
        return JSONResponse(P.error(f"{where}: {msg}" if where else msg), status_code=400)

    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok", "active": worker.active, "waiting": worker.queue_depth, **serving_status(worker)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model, "object": "model", "owned_by": "specstop"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        ids = body.prompt if isinstance(body.prompt, list) else served.tokenizer.encode(body.prompt)
        row = sample(lambda r: r.completion(body.prompt))
        return await _answer(served, worker, body, ids, chat=False, request=request, row=row)

    @app.post("/v1/chat/completions")
    async def chat(body: P.ChatRequest, request: Request):
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = served.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # a template that refuses the roles given
            return JSONResponse(P.error(f"messages: {e}"), status_code=400)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        row = sample(lambda r: r.chat(msgs))
        return await _answer(served, worker, body, ids, chat=True, request=request, row=row)

    return app


async def _answer(served: Served, worker: EngineWorker, body, ids: list[int], chat: bool, request: Request,
                  row: dict | None = None):
    if body.model != served.model:
        return JSONResponse(P.error(f"model {body.model!r} is not served here (try {served.model!r})",
                                    code="model_not_found"), status_code=404)
    vocab = len(served.tokenizer)
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        return JSONResponse(P.error(f"prompt token ids must be in [0, {vocab})"), status_code=400)
    budget = body.budget(served.default_max_tokens)
    if len(ids) + budget > served.max_context:
        return JSONResponse(P.error(f"prompt ({len(ids)} tokens) + max_tokens ({budget}) exceeds the "
                                    f"context of {served.max_context} tokens", code="context_length_exceeded"),
                            status_code=400)
    eos = served.eos + tuple(t for t in body.stop_token_ids or () if t not in served.eos)
    seed = body.seed if body.seed is not None else secrets.randbits(31)  # unseeded: random, as OpenAI's
    alt = body.alternatives()
    job = Job(ids, budget, SamplingConfig(body.temperature, body.top_p), seed, eos,
              asyncio.get_running_loop(), asyncio.Queue(), logprobs=alt)
    lp = Logprobs(served.tokenizer, chat, alt) if alt is not None else None
    try:
        worker.submit(job)
    except Busy as e:  # nothing accepted is dropped: the queue is full, so ask the client to come back
        return JSONResponse(P.error(f"server busy: {e}", kind="server_error"), status_code=503,
                            headers={"Retry-After": "1"})
    log = served.log if row is not None else None
    if log is not None and not log.responses:  # accepted: its prompt is traffic, whatever comes of it
        log.put(row)
        log = None
    text_of = _Text(served.tokenizer, eos, body.stop)
    if body.stream:
        return StreamingResponse(_events(text_of, worker, job, chat, body.model, lp, log, row),
                                 media_type="text/event-stream")
    text, finish = "", "cancelled"
    try:
        text, finish = await _collect(text_of, worker, job, lp)
    except asyncio.CancelledError:  # the client went away before the answer
        worker.cancel(job)
        raise
    finally:
        if log is not None:
            _log_response(log, row, text if finish else "", finish or "error")
    if finish is None:
        return JSONResponse(P.error(text, kind="server_error"), status_code=500)
    make = P.chat_completion if chat else P.completion
    # after a stop string: the tokens whose text starts before the cut
    logprobs = lp.take(len(text) if job.stopped else None, empty=True) if lp else None
    return make(body.model, text, finish, len(ids), job.generated, logprobs)


class _Text:
    """A request's text so far: decoded whole (a token's bytes can complete the previous one's
    character), cut before the first stop string, a trailing end-of-text token dropped."""

    def __init__(self, tokenizer, eos: tuple[int, ...], stops: list[str] | None):
        self.tokenizer, self.eos, self.stops = tokenizer, eos, stops or []
        self.ids: list[int] = []

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """(the text, whether a stop string ended it)."""
        self.ids += ids
        text = self.tokenizer.decode(_strip(self.ids, self.eos), skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)

    def safe(self, text: str) -> str:
        """What may be sent before the answer ends: no half character, and nothing that could be
        the start of a stop string completed by the next tokens."""
        text = text.rstrip("\ufffd")
        hold = max((len(s) - 1 for s in self.stops), default=0)
        for k in range(min(hold, len(text)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stops):
                return text[:-k]
        return text


async def _collect(text_of: _Text, worker: EngineWorker, job: Job, lp: Logprobs | None) -> tuple[str, str | None]:
    text = ""
    while True:
        kind, value = await job.queue.get()
        if kind == "logprobs":
            lp.add(value)
        elif kind == "tokens":
            text, stopped = text_of.add(value)
            if stopped:
                worker.cancel(job, stopped=True)
                return text, "stop"
        elif kind == "done":
            return text.rstrip("\ufffd"), value  # a budget can end inside a character
        else:
            return value, None


def _log_response(log: TrafficLog, row: dict, text: str, finish: str) -> None:
    log.put({**row, "response": text, "finish_reason": finish})


async def _events(text_of: _Text, worker: EngineWorker, job: Job, chat: bool, model: str,
                  lp: Logprobs | None = None, log: TrafficLog | None = None, row: dict | None = None):
    chunks, sent, text, finish = P.Chunks(chat, model), "", "", "cancelled"
    take = lp.take if lp else (lambda chars=None: None)  # a token goes with the piece its text starts in
    try:
        if chat:
            yield _sse(chunks.piece("", first=True))
        while True:
            kind, value = await job.queue.get()
            if kind == "logprobs":
                lp.add(value)
            elif kind == "tokens":
                text, stopped = text_of.add(value)
                ready = text if stopped else text_of.safe(text)
                if ready[len(sent):]:
                    yield _sse(chunks.piece(ready[len(sent):], logprobs=take(len(ready))))
                    sent = ready
                if stopped:
                    worker.cancel(job, stopped=True)
                    finish = "stop"
                    yield _sse(chunks.piece("", finish="stop"))
                    break
            elif kind == "done":
                finish = value
                rest = text.rstrip("\ufffd")[len(sent):]
                if rest:
                    yield _sse(chunks.piece(rest, logprobs=take()))
                yield _sse(chunks.piece("", finish=value, logprobs=take()))
                break
            else:
                finish = "error"
                yield _sse(P.error(value, kind="server_error"))
                break
        yield "data: [DONE]\n\n"
    finally:  # normal end, error, or the client disconnected (the generator is closed)
        worker.cancel(job)
        if log is not None:
            _log_response(log, row, text.rstrip("\ufffd"), finish)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _strip(ids: list[int], eos: tuple[int, ...]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


class _JsonBodies:
    """Reads every POST body as JSON, whatever its Content-Type says (as llama-server does): a
    plain `curl -d '{...}'` sends application/x-www-form-urlencoded."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class _Metrics:
    """Prometheus collector read at scrape time from the worker's counters."""

    def __init__(self, worker: EngineWorker, log: TrafficLog | None = None):
        self.worker, self.log = worker, log

    def collect(self):
        c, w = self.worker.counters, self.worker
        req = CounterMetricFamily("specstop_requests", "Finished requests by outcome", labels=["outcome"])
        for outcome in ("length", "stop", "cancelled", "error"):
            req.add_metric([outcome], c.requests[outcome])
        yield req
        yield CounterMetricFamily("specstop_generated_tokens", "Tokens generated", value=c.generated)
        yield CounterMetricFamily("specstop_prompt_tokens", "Prompt tokens admitted", value=c.prompt_tokens)
        yield CounterMetricFamily("specstop_rounds", "Speculative rounds (one target verify each)", value=c.rounds)
        yield CounterMetricFamily("specstop_verify_rows", "Rows verified, all requests together", value=c.verify_rows)
        yield CounterMetricFamily("specstop_round_requests", "Sum over rounds of the requests in each",
                                  value=c.round_requests)
        yield CounterMetricFamily("specstop_engine_busy_seconds", "Seconds the engine spent in rounds",
                                  value=c.busy_s)
        yield GaugeMetricFamily("specstop_tokens_per_round", "Tokens committed per request per round (acceptance)",
                                value=c.generated / c.round_requests if c.round_requests else 0.0)
        yield GaugeMetricFamily("specstop_tokens_per_second", "Tokens generated per second, last 10 s",
                                value=c.tokens_per_s())
        yield GaugeMetricFamily("specstop_queue_depth", "Requests waiting for a slot", value=w.queue_depth)
        yield GaugeMetricFamily("specstop_active_requests", "Requests in the running batch", value=w.active)
        if self.log is not None:
            yield CounterMetricFamily("specstop_logged_requests", "Request rows written to the traffic log",
                                      value=self.log.logged)
            dropped = CounterMetricFamily("specstop_log_dropped", "Traffic-log rows lost", labels=["reason"])
            for reason, n in self.log.dropped.items():
                dropped.add_metric([reason], n)
            yield dropped
        ttft = sorted(c.ttft_s[-1024:])
        yield GaugeMetricFamily("specstop_ttft_p50_seconds", "Median time to first token, last 1024",
                                value=ttft[len(ttft) // 2] if ttft else 0.0)
