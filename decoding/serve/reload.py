"""Serving a promoted decider or head without a restart.

Trigger: what a promotion changes on disk, polled every `--reload-interval` seconds. A decider
promotion (training.retrain) replaces its root's registry.json atomically, so the `--decider`
argument re-resolved through resolve_decider_dir names another run directory; a head promotion
(training.head.redistill) exchanges the `--draft` directory (training.swap.replace_dir), so the
path's inode changes, and an in-place rewrite changes its files' inode / mtime / size. A poll
needs nothing from the trainer, which may run on another machine sharing the checkpoints;
SIGHUP would need the server's PID there, an admin endpoint would need authentication. A check
is a few stat calls and one small JSON read, so it runs between rounds on the engine thread
(no second thread at all); a model changed on disk is LOADED there too, between rounds, because a
second thread running torch parallel regions turns libgomp's spin-waiting off (decoding.serve.worker:
157 -> 91 tok/s). Rounds pause for the load, so its duration is logged.

Checks before the swap; any failure keeps the models serving, logs one line on stderr and counts
`specstop_reloads_total{outcome="failed"}`: the head must load and pass check_draft against the
target (Session.with_draft); with `--stop decider` the decider must load and pass its pair check
against the target and the (possibly new) head. A head promoted before the decider fitted for it
waits, and both swap together once that decider is promoted; without a decider the head swaps
alone. A failed state is not retried until the files change again. Requests in flight finish on
the models they started with (decoding.batch.binding); requests admitted after the swap use
the new ones.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from decoding.batch.binding import Models

_HEAD_FILES = ("config.json", "model.safetensors", "specstop_draft.json")
_DECIDER_FILES = ("config.json", "model.safetensors")


def engine_models(decoder, budget: str) -> Models:
    """The draft and per-request stop policy or joint budget a BatchEngine runs for `decoder`
    (`budget`: joint | joint-always | independent, as `python -m decoding.serve --budget`)."""
    import copy

    from decoding.batch.budget import JointGrow
    from decoding.growth import GrowPolicy
    from decoding.stopping import make_stop_policy

    s, cfg, stop = decoder.session, decoder.config, decoder._stop
    if budget in ("joint", "joint-always"):
        grow = stop if isinstance(stop, GrowPolicy) else s.grow_policy(cfg, scorer=None)
        return Models(s.draft, budget=JointGrow(grow.scorer, grow.cost, max_width=grow.max_width,
                                                max_nodes=grow.max_nodes, label=grow.label,
                                                needs_hidden=grow.needs_hidden, gate=copy.deepcopy(grow.gate)))
    own = (lambda: copy.deepcopy(stop)) if stop is not None else \
        (lambda: make_stop_policy(cfg.stop, cfg.confidence_threshold, cfg.confidence_rule))
    return Models(s.draft, stop=own)


def _stat(p: Path) -> tuple:
    try:
        st = os.stat(p)
    except OSError:
        return ()
    return st.st_ino, st.st_mtime_ns, st.st_size


def head_identity(d: Path) -> tuple:
    """What a head promotion changes: the directory's inode (an exchange) and its files' stats."""
    return (_stat(d)[:1],) + tuple(_stat(d / f) for f in _HEAD_FILES)


def decider_identity(arg) -> tuple:
    """The directory `arg` resolves to now (a registry's latest moves) and its files' stats."""
    from decoding.decider.policy import resolve_decider_dir
    from decoding.models.errors import ModelError

    try:
        d = resolve_decider_dir(arg)
    except ModelError as e:
        return ("", str(e))
    return (str(d),) + tuple(_stat(d / f) for f in _DECIDER_FILES)


@dataclass(frozen=True)
class Look:
    """The on-disk state of the watched checkpoints (None: not watched)."""

    head: tuple | None
    decider: tuple | None


@dataclass(frozen=True)
class Serving:
    """What /metrics and /health report as serving (replaced whole, so the HTTP thread reads one)."""

    version: int
    head: str
    """The head's directory name and the start of its weights' fingerprint."""
    decider: str
    """The decider's run directory name (`none` without one)."""


class Reloader:
    """Watches the checkpoints `decoder` was loaded from and swaps what changed into `engine`
    (see the module docstring). `tick` runs on the engine thread between rounds (EngineWorker.seam)."""

    def __init__(self, decoder, engine, budget: str, interval: float = 5.0, log=None, clock=time.monotonic):
        if interval < 0:
            raise ValueError(f"--reload-interval must be >= 0 (got {interval})")
        self.decoder, self.engine, self.budget, self.interval = decoder, engine, budget, interval
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.clock = clock
        self.decider_arg = decoder._decider[0]
        self.watch_decider = decoder.config.stop == "decider"
        self.outcomes: collections.Counter = collections.Counter()
        """Reloads by outcome: ok | failed."""
        self.last_error = ""
        self._serving_look = self._failed_look = self.look()
        self.serving = Serving(engine.models.version, self._head_label(decoder.session),
                               self._decider_label(self._serving_look))
        self._next = clock() + interval

    def look(self) -> Look:
        d = self.decoder.session.draft_dir
        return Look(head_identity(d) if d is not None else None,
                    decider_identity(self.decider_arg) if self.watch_decider else None)

    # ---- the engine thread's side (EngineWorker.seam) ----
    def due(self) -> bool:
        return self.interval > 0 and self.clock() >= self._next

    def wait_s(self) -> float | None:
        """Seconds until the next check (None: never), for the worker's idle wait."""
        return max(self._next - self.clock(), 0.0) if self.interval > 0 else None

    def tick(self) -> None:
        if self.due():
            self._next = self.clock() + self.interval
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 reading the disk failed: the engine thread must go on
                self.log(f"reload: the check failed, kept version {self.serving.version}: {_first(e)}")

    def check(self) -> str | None:
        """Reload if the checkpoints changed since the models serving (or a failed attempt) were
        read: "ok", "failed", or None when nothing changed. A failed load never raises."""
        now = self.look()
        if now in (self._serving_look, self._failed_look):
            return None
        t0 = time.perf_counter()
        try:
            new = self._load(now)
        except Exception as e:  # noqa: BLE001 any fault of a promoted checkpoint: keep serving the old
            self._failed_look, self.last_error = now, _first(e)
            self.outcomes["failed"] += 1
            self.log(f"reload: kept version {self.serving.version} ({self.serving.head}, decider "
                     f"{self.serving.decider}): {self.last_error}")
            return "failed"
        old = self.serving
        models = self.engine.swap(*new[1:])
        d = self.decoder  # describes what serves now; nothing else pins the old models
        d.session, d._stop, d._engines = new[0].session, new[0]._stop, {}
        self._serving_look = self._failed_look = now
        self.serving = Serving(models.version, self._head_label(d.session), self._decider_label(now))
        self.outcomes["ok"] += 1
        self.log(f"reload: serving version {models.version} ({self.serving.head}, decider {self.serving.decider}), "
                 f"loaded in {time.perf_counter() - t0:.2f} s on the engine thread (rounds paused meanwhile); "
                 f"requests in flight finish on version {old.version}")
        return "ok"

    def _load(self, now: Look):
        """(the new Decoder, draft, stop factory, budget), every check passed; raises otherwise."""
        from decoding.api import Decoder
        from decoding.models.errors import ModelError

        d, s = self.decoder, self.decoder.session
        head_moved = now.head != self._serving_look.head
        if head_moved:
            try:
                s = s.with_draft(s.draft_dir)  # loads the head and checks it against the target
            except Exception as e:
                raise ModelError(f"the head at {s.draft_dir} was not loaded: {_first(e)}") from None
        decider, rule, threshold = d._decider
        if self.watch_decider:
            decider = now.decider[0] or decider  # what was looked at, not what the registry says by now
        try:
            new = Decoder(s, d.config, decider, rule, threshold, defaults=d.defaults)
        except Exception as e:
            why = _first(e)
            if head_moved and now.decider == self._serving_look.decider:
                why = f"the promoted head waits for a decider fitted for it ({why})"
            raise ModelError(why) from None
        m = engine_models(new, self.budget)
        return new, m.draft, m.stop, m.budget

    @staticmethod
    def _head_label(session) -> str:
        from decoding.models.fingerprint import fingerprint

        if session.draft is None:
            return "none"
        name = session.draft_dir.name if session.draft_dir is not None else "loaded"
        return f"{name}@{fingerprint(session.draft)['weights_sha256'][:12]}"

    def _decider_label(self, look: Look) -> str:
        return Path(look.decider[0]).name if look.decider and look.decider[0] else "none"


def _first(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return text or type(e).__name__


class ReloadMetrics:
    """Prometheus collector of the serving version and the reload outcomes (nothing without a
    reloader: plain decoding has nothing to swap)."""

    def __init__(self, worker):
        self.worker = worker

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        r = getattr(self.worker, "seam", None)
        if not isinstance(r, Reloader):
            return
        s = r.serving
        info = GaugeMetricFamily("specstop_serving_info", "The models serving new requests (1)",
                                 labels=["decider", "head", "version"])
        info.add_metric([s.decider, s.head, str(s.version)], 1)
        yield info
        reloads = CounterMetricFamily("specstop_reloads", "Reloads of a promoted decider or head, by outcome",
                                      labels=["outcome"])
        for outcome in ("ok", "failed"):
            reloads.add_metric([outcome], r.outcomes[outcome])
        yield reloads


def serving_status(worker) -> dict:
    """/health's part: the serving version, and the last reload's failure while it stands."""
    r = getattr(worker, "seam", None)
    if not isinstance(r, Reloader):
        return {}
    out = {"version": r.serving.version}
    if r._failed_look != r._serving_look:
        out["reload_error"] = r.last_error
    return out
