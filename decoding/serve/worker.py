"""The engine's thread: admits requests between rounds, runs rounds, streams tokens back.

Why a thread of its own: a round is one blocking target forward (torch releases the GIL inside
it), and the HTTP side must keep accepting, streaming and noticing disconnects meanwhile. The CLI
runs the loop on the main thread (`run`) and the HTTP side in another: the thread that loaded the
model already owns an OpenMP pool, and a second thread running parallel regions doubles the
threads libgomp manages past the cores, which turns its spin-waiting off (on 2 cores a step run
from a new thread went 157 -> 91 tok/s). The worker owns the
BatchEngine (not thread-safe); the HTTP side only talks to it through `submit` and `cancel`, and
hears back through each job's asyncio queue (`loop.call_soon_threadsafe`). Requests join and
leave only between rounds, so a cancelled request's caches are dropped at the next seam and no
other request is touched.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import traceback
from dataclasses import dataclass, field

from decoding.batch.prefill import ChunkSizer
from decoding.sampling import SamplingConfig


class Busy(Exception):
    """The waiting queue is full: the caller should answer 503 and let the client retry."""


@dataclass
class Job:
    """One request as the worker sees it."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    seed: int = 0
    eos: tuple[int, ...] = ()
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    """Receives ("tokens", ids) (each after its ("logprobs", entries) where `logprobs` is set), then
    ("done", reason) or ("error", message)."""
    logprobs: int | None = None
    """None: no logprobs; k: each token's logprob and k alternatives (decoding.batch.logprobs)."""
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    generated: int = 0
    cancelled: bool = False
    stopped: bool = False
    """Ended by the client's stop string (counted as a stop, not a cancel)."""
    req: object | None = field(default=None, repr=False)

    def push(self, kind: str, value, outbox: dict | None = None) -> None:
        """Hand (kind, value) to the request's asyncio queue; into `outbox` (loop -> items), sent
        with every other request's by one wake-up of that loop (EngineWorker._flush), where given."""
        if self.loop is None or self.loop.is_closed():
            return
        if outbox is None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        else:
            outbox.setdefault(self.loop, []).append((self.queue, (kind, value)))


def _deliver(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


@dataclass
class Counters:
    """What /metrics reports (read by the HTTP thread; ints and floats only)."""

    requests: collections.Counter = field(default_factory=collections.Counter)
    """finished requests by outcome: length | stop | cancelled | error."""
    generated: int = 0
    prompt_tokens: int = 0
    rounds: int = 0
    verify_rows: int = 0
    round_requests: int = 0
    """Sum over rounds of the requests in the round (tokens per request-round = acceptance)."""
    busy_s: float = 0.0
    """Seconds the engine spent in rounds (busy / wall = how loaded the engine is)."""
    ttft_s: list[float] = field(default_factory=list)
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))
    """(time, tokens) of recent commits, for tokens/s over the last window."""

    def tokens_per_s(self, window: float = 10.0) -> float:
        now = time.perf_counter()
        n = sum(k for t, k in list(self.recent) if now - t <= window)
        return n / window


class EngineWorker:
    """Runs `engine` (a decoding.batch.BatchEngine) in a thread; at most `max_active` requests
    in a round, at most `max_queue` waiting."""

    def __init__(self, engine, max_active: int = 8, max_queue: int = 64):
        self.engine, self.max_active, self.max_queue = engine, max_active, max_queue
        self.counters = Counters()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._cv = threading.Condition()
        self._stop = False
        self._deadline: float | None = None
        """Set by drain: when the loop ends whatever is still running."""
        self._looping = False
        self._thread = threading.Thread(target=self._loop, name="specstop-engine", daemon=True)
        self.seam = None
        """Optional: its tick() runs on this thread between rounds, outside the lock (so submit never
        waits on it), its due() / wait_s() end an idle wait (decoding.serve.reload.Reloader)."""
        self._outbox: dict = {}
        """What a round has for the HTTP side, sent at once after it: one wake-up of the event loop
        a round, not one per request (each is a write to the loop's self-pipe, ~3% of the engine
        thread at 4 clients under py-spy)."""

    # ---- called from the HTTP side ----
    def start(self) -> EngineWorker:
        self._looping = True  # alive from here: /health must not race the thread's first line
        self._thread.start()
        return self

    def run(self) -> None:
        """The loop on the calling thread, until `stop` (instead of `start`)."""
        self._loop()

    def stop(self) -> None:
        """Ask the loop to end after the current round (any thread; no wait)."""
        with self._cv:
            self._stop = True
            self._cv.notify()

    def drain(self, timeout: float) -> None:
        """Stop admitting (a new request gets Busy) and end the loop once every accepted request
        has finished, or after `timeout` seconds: those still running then get an error (any
        thread; no wait)."""
        with self._cv:
            self._deadline = time.perf_counter() + timeout
            self._cv.notify()

    def close(self, timeout: float = 30.0) -> None:
        self.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._deadline is not None:
                raise Busy("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise Busy(f"{len(self._waiting)} requests are waiting already")
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job, stopped: bool = False) -> None:
        """The client went away (or its stop string matched: `stopped`): the job leaves at the next
        seam between rounds."""
        with self._cv:
            job.stopped = job.stopped or stopped
            job.cancelled = True
            self._cv.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._running)

    @property
    def alive(self) -> bool:
        return self._looping

    # ---- the engine's thread ----
    def _loop(self) -> None:
        self._looping = True
        try:
            self._rounds()
        finally:
            self._looping = False

    def _rounds(self) -> None:
        while True:
            if self.seam is not None:
                self.seam.tick()
            with self._cv:
                while not self._stop and not self._waiting and not self._running and self._deadline is None \
                        and not (self.seam is not None and self.seam.due()):
                    self._cv.wait(self.seam.wait_s() if self.seam is not None else None)
                if self._stop or (self._deadline is not None and (
                        time.perf_counter() > self._deadline or not (self._waiting or self._running))):
                    break
                self._drop_cancelled()
                while self._waiting and len(self._running) < self.max_active:
                    self._admit(self._waiting.popleft())
            if self._running:
                self._round()
            self._flush()
        why = "the server is shutting down" + (": its drain timeout ended this request" if self._deadline else "")
        for job in [*self._running, *self._waiting]:
            self._finish(job, "error", why)
        self._flush()

    def _flush(self) -> None:
        out, self._outbox = self._outbox, {}
        for loop, items in out.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(_deliver, items)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.cancelled]:
            self._waiting.remove(job)
            self.counters.requests["stop" if job.stopped else "cancelled"] += 1
        for job in [j for j in self._running if j.cancelled]:
            self.engine.remove(job.req)
            self._running.remove(job)
            self.counters.requests["stop" if job.stopped else "cancelled"] += 1

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            self.counters.requests["stop" if job.stopped else "cancelled"] += 1
            return
        try:
            job.req = self.engine.add(job.prompt, job.max_new_tokens, job.sampling, job.seed,
                                      eos_token_id=list(job.eos), on_tokens=lambda ids, j=job: self._tokens(j, ids),
                                      top_logprobs=job.logprobs)
        except ValueError as e:
            self._finish(job, "error", str(e))
            return
        self.counters.prompt_tokens += len(job.prompt)
        self._running.append(job)

    def _tokens(self, job: Job, ids: list[int]) -> None:
        now = time.perf_counter()
        if job.first_token is None:
            job.first_token = now
            self.counters.ttft_s.append(now - job.submitted)
            del self.counters.ttft_s[:-4096]
        job.generated += len(ids)
        self.counters.generated += len(ids)
        self.counters.recent.append((now, len(ids)))
        if job.logprobs is not None:
            job.push("logprobs", job.req.logprobs[-len(ids):], self._outbox)
        job.push("tokens", list(ids), self._outbox)

    def _round(self) -> None:
        jobs = list(self._running)
        t0 = time.perf_counter()
        try:
            finished = self.engine.step()
        except Exception as e:  # past the engine's own isolation: the round's requests fail, never the server
            traceback.print_exc()
            for job in jobs:
                self.engine.remove(job.req)
                self._finish(job, "error", f"{type(e).__name__}: {e}")
            self._running.clear()
            return
        failed, self.engine.failed = list(getattr(self.engine, "failed", [])), []
        for job in [j for j in jobs if any(j.req is r for r in failed)]:  # its own part raised: it alone ends
            self._running.remove(job)
            err = job.req.error
            self._finish(job, "error", f"{type(err).__name__}: {err}")
        self.counters.busy_s += time.perf_counter() - t0
        self.counters.rounds += 1
        self.counters.round_requests += len(jobs)
        if getattr(self.engine, "verify_rows", None):
            self.counters.verify_rows += self.engine.verify_rows[-1]
        done = {id(r) for r in finished}
        for job in [j for j in jobs if id(j.req) in done]:
            self._running.remove(job)
            out = job.req.out
            self._finish(job, "done", "stop" if out and out[-1] in job.eos else "length")

    def _finish(self, job: Job, kind: str, value: str) -> None:
        self.counters.requests[value if kind == "done" else "error"] += 1
        job.req = None
        job.push(kind, value, self._outbox)


def batch_engine(decoder, budget: str = "joint", chunk: int | ChunkSizer | None = None):
    """The BatchEngine of a loaded Decoder: its pair, its largest tree, and either one grow budget
    across requests (over q or the decider's scores, with the decider's or this machine's cost
    curve) or each request's own copy of the decoder's stop policy; `chunk` (BatchEngine.chunk):
    prompt tokens a request feeds a round at most (an int; 0 or None: whole prompts), or a
    decoding.batch.prefill.ChunkSizer sizing each round's chunk by measured time."""
    engine = _batch_engine(decoder, budget)
    engine.chunk = chunk or None
    return engine


def _batch_engine(decoder, budget: str):
    from decoding.batch.measured import MeasuredChoice
    from decoding.batch.scheduler import BatchEngine
    from decoding.serve.reload import engine_models  # what a reload rebuilds too
    from decoding.tree import layout_from_k_config

    s, cfg = decoder.session, decoder.config
    if cfg.strategy == "ar" or s.draft is None:
        return BatchEngine(s.target, None)
    m = engine_models(decoder, budget)
    return BatchEngine(s.target, m.draft, layout_from_k_config(cfg.k_levels), stop=m.stop, budget=m.budget,
                       measured=MeasuredChoice() if budget == "joint" else None, head_window=cfg.head_window)
