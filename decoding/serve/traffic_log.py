"""Opt-in traffic logging for retraining (`python -m decoding.serve --log-prompts DIR`).

Each sampled request becomes one JSON row in the format `python -m training.retrain` reads
(training.logged.read_logged; docs/retraining.md):

    {"id": "<16 hex>", "kind": "chat" | "completion", "prompt": "...", "raw": false,
     "time": "2026-11-28T21:51:50Z", "messages": [...],            # chat requests only
     "response": "...", "finish_reason": "stop"}                    # --log-keep responses only

`prompt` is what the retrain's collect feeds: a chat of one user message is stored as that
message (the collect wraps it in the chat template, as the server did); any other chat is stored
as its rendered template text and a completion as its text, both with `raw: true` (fed as is,
never wrapped again). Token-id completion prompts are decoded to text (raw).

The event loop only builds the row and puts it on a bounded queue (full: the row is dropped and
counted); a writer thread appends rows to `.traffic-<UTC>-<pid>-<n>.jsonl.part` and on rotation
(size or age) or close fsyncs it and renames it to `traffic-<UTC>-<pid>-<n>.jsonl`: the retrain
reads `*.jsonl`, so it only ever sees whole files (a killed server's open file is handed over by
the next one started on the folder). A write error (a full disk) loses that batch of rows,
counts them and is said once on stderr; the server goes on.
"""

from __future__ import annotations

import hashlib
import os
import queue
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

KEEP = ("prompts", "responses")


@dataclass
class LogConfig:
    folder: str
    """Where finished files land (created if missing)."""
    keep: str = "prompts"
    """prompts: the request only; responses: also the generated text and finish reason."""
    sample_rate: float = 1.0
    """Share of requests logged, drawn per request (0 < r <= 1)."""
    rotate_mb: float = 64.0
    """Finish the open file once it holds this many MiB."""
    rotate_minutes: float = 60.0
    """... or once its first row is this old (so a quiet server still hands files over)."""
    queue_size: int = 4096
    """Rows waiting for the writer at most; more are dropped (counted), never waited for."""
    seed: int | None = None
    """Seed of the sampling draws (tests); None: random."""

    def check(self) -> None:
        if self.keep not in KEEP:
            raise ValueError(f"--log-keep must be one of {', '.join(KEEP)} (got {self.keep!r})")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"--log-sample-rate must be in (0, 1] (got {self.sample_rate})")
        if self.rotate_mb <= 0 or self.rotate_minutes <= 0:
            raise ValueError("--log-rotate-mb and --log-rotate-minutes must be > 0")
        if self.queue_size < 1:
            raise ValueError("the log queue needs room for one row")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def row_id(prompt: str, raw: bool) -> str:
    """read_logged's default id for a wrapped prompt; a raw one is salted so that the same text
    served both ways stays two prompts."""
    return hashlib.sha256((("raw:" if raw else "") + prompt).encode()).hexdigest()[:16]


class Rows:
    """Builds rows from requests (on the event loop; no I/O)."""

    def __init__(self, tokenizer, clock=time.time):
        self.tokenizer, self.clock = tokenizer, clock
        bos = getattr(tokenizer, "bos_token", None)
        try:  # re-encoding text that starts with the BOS text would add a second BOS
            adds = bos is not None and tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
        except Exception:
            adds = False
        self.strip = bos if adds else None

    def _row(self, kind: str, prompt: str, raw: bool) -> dict:
        if raw and self.strip and prompt.startswith(self.strip):
            prompt = prompt[len(self.strip):]
        return {"id": row_id(prompt, raw), "kind": kind, "prompt": prompt, "raw": raw, "time": utc(self.clock())}

    def chat(self, messages: list[dict]) -> dict:
        if len(messages) == 1 and messages[0]["role"] == "user":
            row = self._row("chat", messages[0]["content"], False)
        else:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            row = self._row("chat", text, True)
        return {**row, "messages": messages}

    def completion(self, prompt: str | list[int]) -> dict:
        if isinstance(prompt, list):
            prompt = self.tokenizer.decode(prompt, skip_special_tokens=False)
        return self._row("completion", prompt, True)


class TrafficLog:
    """The bounded queue, its writer thread and the counters /metrics reports."""

    def __init__(self, cfg: LogConfig, clock=time.time, tick_s: float = 1.0, err=None):
        cfg.check()
        self.cfg, self.clock, self.tick_s = cfg, clock, tick_s
        self.err = err or sys.stderr
        self.folder = Path(cfg.folder)
        self.logged = 0
        """Rows written (a counter, read by /metrics)."""
        self.dropped = {"queue_full": 0, "write_error": 0, "bad_row": 0}
        self._rng = random.Random(cfg.seed)
        self._q: queue.Queue = queue.Queue(cfg.queue_size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specstop-traffic-log", daemon=True)
        self._fd: int | None = None
        self._part: Path | None = None
        self._opened = 0.0
        self._size = 0
        self._seq = 0
        self._warned = False

    @property
    def responses(self) -> bool:
        return self.cfg.keep == "responses"

    def start(self) -> TrafficLog:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--log-prompts {self.folder}: {e.strerror or e}") from None
        if not os.access(self.folder, os.W_OK):
            raise ValueError(f"--log-prompts {self.folder}: not writable")
        self.recover()
        self._thread.start()
        return self

    def recover(self) -> list[Path]:
        """Hand over the open files of servers that died without their drain (killed): each cut
        to its last whole row and renamed. A file of a live process is left alone."""
        out = []
        for part in sorted(self.folder.glob(".traffic-*.jsonl.part")):
            try:
                pid = int(part.name.split("-")[2])
                if pid != os.getpid() and _alive(pid):
                    continue
                data = part.read_bytes()
                whole = data[: data.rfind(b"\n") + 1]
                if whole:
                    with open(part, "r+b") as f:
                        f.truncate(len(whole))
                        os.fsync(f.fileno())
                    out.append(part.parent / part.name[1:].removesuffix(".part"))
                    os.replace(part, out[-1])
                else:
                    part.unlink()
            except (ValueError, IndexError, OSError):
                continue  # not one of ours, or gone meanwhile
        return out

    def sampled(self) -> bool:
        """Whether this request is logged (one draw per request; event loop only)."""
        return self.cfg.sample_rate >= 1 or self._rng.random() < self.cfg.sample_rate

    def put(self, row: dict) -> None:
        """Queue a row; never blocks (full: dropped and counted)."""
        try:
            self._q.put_nowait(row)
        except queue.Full:
            self.dropped["queue_full"] += 1

    def wait_idle(self) -> None:
        """Until every queued row has been handled (tests)."""
        self._q.join()

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then finish the open file (the server's shutdown)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        else:
            self._drain()
            self._finish()

    # ---- the writer thread ----
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._q.get(timeout=self.tick_s)
            except queue.Empty:
                self._rotate_if_due()
                continue
            self._write([first, *self._take()])
        self._drain()
        self._finish()

    def _take(self) -> list[dict]:
        rows = []
        while True:
            try:
                rows.append(self._q.get_nowait())
            except queue.Empty:
                return rows

    def _drain(self) -> None:
        rows = self._take()
        if rows:
            self._write(rows)

    def _write(self, rows: list[dict]) -> None:
        import json

        try:
            data = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)
            self._append(data)
            self.logged += len(rows)
        except (OSError, TypeError, ValueError) as e:
            self.dropped["write_error"] += len(rows)
            self._say(e)
        try:
            self._rotate_if_due()
        finally:  # after the rotation: wait_idle then sees the file handed over
            for _ in rows:
                self._q.task_done()

    def _append(self, data: bytes) -> None:
        if self._fd is None:
            now = self.clock()
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
            self._part = self.folder / f".traffic-{stamp}-{os.getpid()}-{self._seq:04d}.jsonl.part"
            self._fd = os.open(self._part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            self._opened, self._size = now, 0
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            try:  # no half row stays behind: the file keeps only whole rows
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass
            raise
        self._size += len(data)

    def _rotate_if_due(self) -> None:
        if self._fd is None:
            return
        if self._size >= self.cfg.rotate_mb * 2**20 or self.clock() - self._opened >= self.cfg.rotate_minutes * 60:
            self._finish()

    def _finish(self) -> None:
        """fsync the open file and rename it to its visible name (an empty one is removed)."""
        if self._fd is None:
            return
        fd, part, self._fd = self._fd, self._part, None
        self._seq += 1
        try:
            os.fsync(fd)
            os.close(fd)
            if self._size == 0:
                part.unlink()
                return
            os.replace(part, part.parent / part.name[1:].removesuffix(".part"))
            dfd = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            self._say(e)

    def _say(self, e: Exception) -> None:
        if not self._warned:
            self._warned = True
            print(f"warning: traffic log: {e} (rows are being dropped and counted in "
                  "specstop_log_dropped; the server goes on)", file=self.err, flush=True)
