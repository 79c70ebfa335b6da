"""The server under a hostile crowd, as a user runs it (`python -m decoding.bench --suite serve-load
[--clients 8] [--prompts 16] [--duration S] [--threads 2]`): one `python -m decoding.serve`
subprocess on the default engine and target, `--max-queue 16`, with the opt-in fault trigger of
decoding.serve.faults set. Each client sends its share of a mix, one request after another,
and comes back after a 503's Retry-After (up to RETRIES times):
  greedy, greedy stream, chat, chat stream  well-formed greedy requests on held-out prompts
  stop, logprobs     greedy, with stop strings / `logprobs: 2`, streamed or not
  sampled            T = 0.8, top_p 0.95, seeded, completions or chat, streamed or not
  leave              a stream the client hangs up on after 1-3 events
  bad, oversized     malformed bodies (decoding.bench.serve_client.bad_bodies), a prompt past the context
  fault              a request seeded to raise inside the engine's rounds (decoding.serve.faults)
and one more client floods the queue: bursts of MAX_BATCH + MAX_QUEUE + 8 requests at once, never
retried (its 503s are the expected answer). Every request's outcome is counted: completed, left (by
its client), refused (400 by the server's reason, 503), failed (an error event or a 500, by reason),
lost (the connection ended with no answer) or hung (no answer within the timeout). Every completed
greedy text is compared with the same server's answer to that request sent alone before the crowd
(batch 1, no stop string: the stop strings cut that text). The server's RSS is sampled from
/proc/PID/status all along. The run passes with 0 lost, 0 hung, 0 unexpected outcomes, the same PID
alive throughout with /health ok at the end, an RSS at the end within 5% of
half-way through the crowd (no growth once its shapes have reached their high-water mark) and
every greedy text equal.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import Counter
from pathlib import Path

from decoding.bench.serve_client import Streamed, bad_bodies, get_json, moved, post, scrape
from decoding.bench.serve_suite import Server, held_out, ours
from decoding.serve.faults import ENV as FAULT_ENV

MODEL = "specstop"
FAULT_SEED = 2**31 + 1  # above any seed the server draws for an unseeded request (31 bits)
MAX_BATCH, MAX_QUEUE = 8, 16
BURST = MAX_BATCH + MAX_QUEUE + 8
FLOOD_EVERY = 10.0  # seconds between the flooder's bursts
RETRIES = 30
WARM = 2  # requests per client of the warm-up crowd
PROMPTS = 6
STOPS = [".", "\n"]
FLAT = 0.05  # RSS at the end within 5% of half-way through the crowd
OUTCOMES = ("completed", "left", "refused 400", "refused 503", "failed", "lost", "hung")
MIX = ("greedy", "greedy stream", "chat", "chat stream", "stop", "logprobs", "sampled", "leave", "bad",
       "oversized", "fault")
EXPECT = {"leave": {"left", "completed"}, "bad": {"refused 400"}, "oversized": {"refused 400"},
          "fault": {"failed"}, "flood": {"completed", "refused 503"}}
"""Each kind's acceptable outcomes (any other kind: completed); anything else is unexpected."""


def new_tokens(pi: int) -> int:
    return (16, 24, 32)[pi % 3]


def make_plan(kind: str, k: int, prompts: list[str], bad: list) -> dict:
    """The k-th request of `kind`: its route, body, and what it is checked against."""
    pi = k % len(prompts)
    chat = kind.startswith("chat") or (kind in ("sampled", "leave") and k % 2 == 1)
    stream = kind.endswith("stream") or (kind in ("stop", "logprobs", "sampled", "fault") and k % 2 == 1) \
        or kind == "leave"
    p = {"kind": kind, "stream": stream, "leave": 0, "key": None, "stop": None, "names": None,
         "path": "/v1/chat/completions" if chat else "/v1/completions"}
    if kind in ("bad", "oversized"):
        label, body, names = bad[k % len(bad)]
        return p | {"path": "/v1/completions", "stream": False, "body": body, "names": names, "label": label}
    req = {"model": MODEL, "max_tokens": new_tokens(pi), "temperature": 0, "stream": stream}
    req |= {"messages": [{"role": "user", "content": prompts[pi]}]} if chat else {"prompt": prompts[pi]}
    if kind == "sampled":
        req |= {"temperature": 0.8, "top_p": 0.95, "seed": k}
    elif kind == "leave":
        req["max_tokens"], p["leave"] = 64, 1 + k % 3
    elif kind == "fault":
        req["seed"] = FAULT_SEED
    else:  # greedy: checked against its answer alone
        p["key"] = ("chat" if chat else "completion", pi)
    if kind == "stop":
        req["stop"] = p["stop"] = STOPS
    if kind == "logprobs":
        req["logprobs"] = 2
    return p | {"body": json.dumps(req).encode()}


def reason(body) -> str:
    """A refusal's or failure's reason, short: the error's code, the field it names, or its start."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return str(body.get("raw", body) if isinstance(body, dict) else body)[:60]
    msg = str(err.get("message", ""))
    head, _, tail = msg.partition(":")
    if tail and not any(c.isalpha() for c in head):  # a position in the body ("0: ..."): what it says
        head, tail = tail.strip(), ""
    return err.get("code") or (head if tail and len(head) <= 40 else " ".join(head.split()[:5]))


def classify(status: int | None, body, exc: BaseException | None = None) -> tuple[str, str]:
    """(outcome, reason) of one answer, or of the exception that came instead."""
    if exc is not None:
        if isinstance(exc, TimeoutError):
            return "hung", "no answer in time"
        return "lost", type(exc).__name__
    if status == 200 and isinstance(body, Streamed):
        if body.left:
            return "left", ""
        if body.error is not None:
            return "failed", reason({"error": {"message": body.error}})
        if body.done and body.finish:
            return "completed", body.finish
        return "lost", "stream ended without a finish and [DONE]"
    if status == 200:
        return ("completed", body["choices"][0]["finish_reason"]) if body.get("choices") else ("lost", "no choices")
    if status == 400:
        return "refused 400", reason(body)
    if status == 503:
        return "refused 503", reason(body)
    if status == 500:  # the engine's error, unstreamed
        return "failed", reason(body)
    return "failed", f"HTTP {status}: {reason(body)}"


def text_of(body) -> str:
    if isinstance(body, Streamed):
        return body.text
    c = body["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


def expected_text(alone: str, stops: list[str] | None) -> str:
    cuts = [k for k in (alone.find(s) for s in stops or ()) if k >= 0]
    return alone[:min(cuts)] if cuts else alone


def judge(p: dict, status, body, exc, refs: dict) -> dict:
    """One request's record: kind, outcome, reason, whether it was expected, greedy equality."""
    outcome, why = classify(status, body, exc)
    ok = outcome in EXPECT.get(p["kind"], {"completed"})
    if outcome == "refused 400" and p["names"] and p["names"] not in body["error"]["message"]:
        ok, why = False, f"{why} (the message does not name {p['names']!r})"
    rec = {"kind": p["kind"], "outcome": outcome, "reason": why, "expected": ok, "equal": None}
    if p.get("label"):
        rec["label"] = p["label"]
    if outcome == "completed" and p["key"] is not None:
        got, want = text_of(body), expected_text(refs[p["key"]], p["stop"])
        rec["equal"] = got == want
        if not rec["equal"]:  # where it parts from its answer alone, for a reader to judge
            at = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            rec |= {"key": list(p["key"]), "parted_at": at, "got": got, "alone": want}
    return rec


def send(port: int, p: dict, refs: dict, timeout: float, retry: bool) -> dict:
    """One planned request, coming back after each 503's Retry-After where `retry`."""
    for tries in range(RETRIES if retry else 1):
        status, body, exc = None, None, None
        try:
            status, headers, body = post(port, p["path"], p["body"], p["stream"], p["leave"], timeout)
        except (OSError, http.client.HTTPException, ValueError) as e:  # TimeoutError is an OSError
            exc = e
        if status != 503 or not retry or tries == RETRIES - 1:
            break
        time.sleep(float(headers.get("retry-after", 1)))
    return judge(p, status, body, exc, refs) | {"retried_503": tries}


class RssSampler(threading.Thread):
    """The server's VmRSS (MiB) every `every` s, and whether its PID vanished."""

    def __init__(self, pid: int, every: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.every, self.samples, self.vanished = pid, every, [], False
        self.halt, self.t0 = threading.Event(), time.perf_counter()

    def read(self) -> float | None:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024
        except (OSError, StopIteration):
            self.vanished = True
            return None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def at(self, t: float) -> float | None:
        """The sample nearest to `t` seconds."""
        return min(self.samples, key=lambda s: abs(s[0] - t))[1] if self.samples else None

    def run(self) -> None:
        while not self.halt.wait(self.every):
            mib = self.read()
            if mib is not None:
                self.samples.append((round(self.now(), 1), round(mib, 1)))


def crowd(port: int, clients: int, requests: int, duration: float | None, prompts: list[str], bad: list,
          refs: dict, timeout: float) -> tuple[list[dict], float]:
    """The clients and the flooder at once; every request's record, and the wall seconds."""
    records, lock, start = [], threading.Lock(), time.perf_counter()
    stop_at = start + duration if duration else float("inf")
    done = threading.Event()
    oversized = [b for b in bad if b[0] == "prompt over the context"]
    malformed = [b for b in bad if b[0] != "prompt over the context"]

    def keep(rec):
        with lock:
            records.append(rec)

    def client(c: int) -> None:
        for j in range(requests):
            if time.perf_counter() > stop_at:
                return
            kind = MIX[(3 * c + j) % len(MIX)]
            keep(send(port, make_plan(kind, c * requests + j, prompts, oversized if kind == "oversized"
                                      else malformed), refs, timeout, retry=True))

    def flooder() -> None:
        p = make_plan("greedy", 0, prompts, bad) | {"kind": "flood"}
        while True:
            burst = [threading.Thread(target=lambda: keep(send(port, p, refs, timeout, retry=False)))
                     for _ in range(BURST)]
            for t in burst:
                t.start()
            for t in burst:
                t.join()
            if done.wait(FLOOD_EVERY):
                return

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    flood = threading.Thread(target=flooder)
    for t in [flood, *threads]:
        t.start()
    for t in threads:
        t.join()
    done.set()
    flood.join()
    return records, time.perf_counter() - start


def context_of(target: str | None) -> int:
    """The target's positions (config.json), for a prompt that must not fit."""
    from decoding.models import named_targets

    d = Path(named_targets.default_target_dir() if target is None else named_targets.gguf_target_dir(Path(target))
             if str(target).endswith(".gguf") else target)
    try:
        return int(json.loads((d / "config.json").read_text()).get("max_position_embeddings") or 8192)
    except (OSError, ValueError):
        return 8192


def load_test(clients: int, requests: int, duration: float | None, threads: int | None, target: str | None,
              timeout: float = 120.0, log: Path | None = None, progress=print) -> dict:
    """Start the server, warm it up (each greedy reference alone, then MAX_BATCH clients x WARM
    requests of the mix and a flood burst), run the crowd, let it settle, and count."""
    prompts = held_out(PROMPTS)
    bad = bad_bodies(MODEL, " ".join(["word"] * (context_of(target) + 256)))
    extra = ["--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE)]
    srv = Server("ours", ours(extra, threads, target), env={FAULT_ENV: str(FAULT_SEED)}, log=log)
    pid, rss = srv.proc.pid, RssSampler(srv.proc.pid)
    marks = {"start": rss.read()}
    rss.start()
    try:
        refs = {}
        for chat in (False, True):  # the greedy references, each alone (batch 1) on this server
            for pi in range(PROMPTS):
                p = make_plan("chat" if chat else "greedy", pi, prompts, bad)
                _, _, body = post(srv.port, p["path"], p["body"], timeout=timeout)
                refs[p["key"]] = text_of(body)
        # a short crowd of the same mix reaches the shapes' high-water mark; "flat" is measured from it
        crowd(srv.port, MAX_BATCH, WARM, None, prompts, bad, refs, timeout)
        marks["after warm-up"] = rss.read()
        progress(f"[serve-load] warm: rss {marks['start']:.0f} -> {marks['after warm-up']:.0f} MiB; crowd of "
                 f"{clients} x {requests} + a flooder")
        before, begun = scrape(srv.port), rss.now()
        records, wall = crowd(srv.port, clients, requests, duration, prompts, bad, refs, timeout)
        deadline = time.time() + timeout
        while time.time() < deadline:  # the leavers' cancels land at the next seam
            status, health = get_json(srv.port, "/health")
            if status == 200 and not health["active"] and not health["waiting"]:
                break
            time.sleep(0.2)
        marks["half-way"], marks["end"] = rss.at(begun + wall / 2), rss.read()
        after = scrape(srv.port)
        health = get_json(srv.port, "/health")
        alive = srv.proc.poll() is None and not rss.vanished
    finally:
        rss.halt.set()
        srv.close()
    counted = {o: moved(after, before, "specstop_requests_total", outcome=o)
               for o in ("length", "stop", "cancelled", "error")}
    return {"clients": clients, "requests_per_client": requests, "duration_s": duration, "threads": threads,
            "timeout_s": timeout, "max_batch": MAX_BATCH, "max_queue": MAX_QUEUE, "burst": BURST,
            "wall_s": round(wall, 1), "records": records, "server": {
                "pid": pid, "alive_throughout": alive, "restarts": 0 if alive else 1, "health_end": health[1]},
            "metrics_outcomes": counted,
            "rss_mib": {**{k: round(v, 1) for k, v in marks.items() if v is not None},
                        "max": round(max([m for _, m in rss.samples] + [v for v in marks.values() if v is not None]), 1)},
            "rss_samples": rss.samples}


def summarize(res: dict) -> dict:
    """Outcome counts by kind, reasons, unexpected records, the checks and the verdict."""
    recs = res["records"]
    kinds = [k for k in (*MIX, "flood") if any(r["kind"] == k for r in recs)]
    table = {k: Counter(r["outcome"] for r in recs if r["kind"] == k) for k in kinds}
    greedy = [r["equal"] for r in recs if r["equal"] is not None]
    reasons = {o: Counter(r["reason"] for r in recs if r["outcome"] == o)
               for o in ("refused 400", "refused 503", "failed", "lost", "hung")}
    total = Counter(r["outcome"] for r in recs)
    engine_failed = sum(1 for x in recs if x["outcome"] == "failed" and not x["reason"].startswith("HTTP "))
    accepted = total["completed"] + total["left"] + engine_failed  # what the server took in and ended
    r, s, m = res["rss_mib"], res["server"], res["metrics_outcomes"]
    flat = "end" in r and "half-way" in r and abs(r["end"] - r["half-way"]) <= FLAT * r["half-way"]
    checks = {"0 lost": total["lost"] == 0, "0 hung": total["hung"] == 0,
              "0 unexpected": all(x["expected"] for x in recs),
              "0 restarts": s["restarts"] == 0 and s["alive_throughout"],
              "/health ok at the end": s["health_end"] == {"status": "ok", "active": 0, "waiting": 0},
              "RSS flat": flat, "greedy = alone": all(greedy),
              "metrics add up": sum(m.values()) == accepted and m["error"] == engine_failed}
    return {"kinds": {k: dict(v) for k, v in table.items()}, "total": dict(total), "accepted": accepted,
            "greedy_equal": [sum(greedy), len(greedy)],
            "retried_503": sum(x["retried_503"] for x in recs if x["kind"] != "flood"),
            "reasons": {o: dict(c) for o, c in reasons.items() if c}, "rss_flat": flat, "checks": checks,
            "unexpected": [x for x in recs if not x["expected"]][:20], "passed": all(checks.values())}


def load_markdown(res: dict, cpu: str) -> str:
    s, r, srv = summarize(res), res["rss_mib"], res["server"]
    cell = lambda n: str(n) if n else "."  # noqa: E731
    lines = ["# decoding.serve under a hostile crowd", "", f"`{res['command']}`", "",
             f"CPU: {cpu}; server threads: {res['threads'] or 'torch default'}. One `python -m decoding.serve "
             f"--max-batch {res['max_batch']} --max-queue {res['max_queue']}` process on the default engine and "
             f"target, ${FAULT_ENV} set; {res['clients']} clients x up to {res['requests_per_client']} requests"
             + (f" (for at most {res['duration_s']:g} s)" if res["duration_s"] else "")
             + f", each retrying a 503 after its Retry-After (up to {RETRIES} times), and a flooder sending "
             f"bursts of {res['burst']} every {FLOOD_EVERY:g} s without retrying; {res['timeout_s']:g} s "
             f"per request before it counts as hung; the crowd took {res['wall_s']:g} s. Warm-up: each greedy "
             f"request alone, then {MAX_BATCH} clients x {WARM} requests of the mix and a flood burst.", "",
             "| kind | sent | " + " | ".join(OUTCOMES) + " | greedy = alone |",
             "|---|---|" + "---|" * len(OUTCOMES) + "---|"]
    for kind, c in [*s["kinds"].items(), ("**all**", s["total"])]:
        eq = [x["equal"] for x in res["records"] if x["equal"] is not None and kind in (x["kind"], "**all**")]
        lines.append(f"| {kind} | {sum(c.values())} | " + " | ".join(cell(c.get(o, 0)) for o in OUTCOMES)
                     + f" | {f'{sum(eq)}/{len(eq)}' if eq else '-'} |")
    lines += [""] + [f"- {o} by reason: " + ", ".join(f"{k or '?'} {n}" for k, n in c.items())
                     for o, c in s["reasons"].items()]
    lines += [f"- well-formed clients' 503s, each retried: {s['retried_503']}",
              f"- unexpected outcomes: {len(s['unexpected']) or 'none'}"
              + "".join(f"\n  - {x['kind']}: {x['outcome']} ({x['reason']})" for x in s["unexpected"]),
              f"- server: PID {srv['pid']} {'alive from start to end' if srv['alive_throughout'] else 'GONE'} "
              f"({srv['restarts']} restarts); /health at the end: `{json.dumps(srv['health_end'])}`",
              "- /metrics, requests ended during the crowd: " + ", ".join(
                  f"{k} {v:g}" for k, v in res["metrics_outcomes"].items())
              + f"; the clients saw {s['accepted']} accepted (completed + left + failed in the engine)",
              f"- RSS MiB: start {r.get('start')}, after warm-up {r.get('after warm-up')}, half-way through the "
              f"crowd {r.get('half-way')}, end {r.get('end')}, max {r['max']}: "
              f"{'flat' if s['rss_flat'] else 'NOT flat'} (end within {FLAT:.0%} of half-way; the crowd's shapes "
              "reach their high-water mark early on, and a leak grows on through its second half)",
              f"- greedy texts equal to the same server's answer to that request sent alone before the crowd "
              f"(batch 1; a stop string cuts that text): {s['greedy_equal'][0]}/{s['greedy_equal'][1]}", "",
              "Checks: " + ", ".join(f"{k} {'yes' if v else '**NO**'}" for k, v in s["checks"].items())
              + f". **{'PASS' if s['passed'] else 'FAIL'}**", ""]
    return "\n".join(lines)


def main(a, command: str, progress=print) -> int:
    """`--suite serve-load` of python -m decoding.bench (its parsed args)."""
    from decoding.forward.cpu import describe
    from decoding.bench.report import write_atomic

    out = Path(a.out or f"reports/serve-load-{time.strftime('%Y-%m-%d')}")
    out.mkdir(parents=True, exist_ok=True)
    res = load_test(max(a.clients), a.prompts or 16, a.duration, a.threads, a.target, log=out / "server.log",
                    progress=progress)
    res["command"], res["summary"] = command, summarize(res)
    md = load_markdown(res, describe())
    write_atomic(out / "results.json", json.dumps(res, indent=2))
    write_atomic(out / "results.md", md)
    print(md)
    return 0 if res["summary"]["passed"] else 1
