"""The server suite: our OpenAI server against llama-server under concurrent clients
(`python -m decoding.bench --suite serve [--clients 1,2,4,8] [--llama-server PATH --head-gguf H]`);
the server under a hostile crowd is decoding.bench.serve_load (`--suite serve-load`).

Every server is a subprocess on a loopback port, driven over HTTP by client threads, each client
sending its share of the held-out chat prompts one after another, greedy, streamed (time to first
token, time per token after it). Each repeat starts its own servers, all up at once, and runs every
row in turn, each repeat starting one row further on (the first row after start-up ran ~10% slow
beside its own interleaved A/B, 2026-11-29): a drift of the shared machine's speed hits all rows
alike, and each row's spread
includes the process's own (two processes of one server ran 15-20% apart for their whole lives
here, 2026-11-28; repeats on one process hid that):
  ours, joint        decoding.serve, one grow budget across requests (the default)
  ours, independent  decoding.serve --budget independent
  ours, ar           decoding.serve --strategy ar (plain decoding, batched)
  ours, fixed chain  decoding.serve --strategy sd --gamma 2 --budget independent (every request a
                     chain of 2 every round: the fastest fixed chain in process, 1 and 4 clients,
                     reports/serve-2026-11-28/ceiling)
  ours, joint, f16 KV  the default with --kv-dtype float16 (a GGUF target: its KV cache in float16)
  ours, one by one   decoding.serve --max-batch 1: the batch-1 engine serving requests in turn
  ours, joint, logged KEEP  with --serve-log KEEP: the default with --log-prompts (every request
                     logged, keeping KEEP) into a temporary directory: logging on against "ours, joint"
  llama.cpp -np N    llama-server plain, and with our head (-md HEAD --spec-type draft-eagle3)
Throughput = completion tokens of all requests / the wall time from first send to last answer
(tokens counted with the target's tokenizer for every server alike).
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from decoding.bench.config import BenchConfig, load_prompts
from decoding.bench.llama import ServerProcess, free_port


class Server(ServerProcess):
    """Our server as a subprocess on a free loopback port (`cmd` gets --port appended)."""

    def __init__(self, name: str, cmd: list[str], timeout: float = 300, **kw):
        port = free_port()
        super().__init__([*cmd, "--port", str(port)], port, name, timeout, **kw)


def ask(port: int, model: str, prompt: str, max_tokens: int, cancel_after: int | None = None,
        extra: dict | None = None) -> dict:
    """One streamed chat request: its text, time to first token, end time; cancel_after=k closes
    the connection after k events (a client that goes away); `extra`: server-specific fields
    (llama-server's cache_prompt: ours refuses a field it does not implement)."""
    import http.client

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, **(extra or {})}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        return {"error": f"HTTP {r.status}: {r.read()[:200]!r}", "t0": t0}
    text, first, events = "", None, 0
    while True:
        line = r.readline()
        if not line:
            break
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if "error" in obj:
            return {"error": obj["error"].get("message", "?"), "t0": t0}
        piece = (obj["choices"][0].get("delta") or {}).get("content") or ""
        if piece and first is None:
            first = time.perf_counter()
        text += piece
        events += 1
        if cancel_after is not None and events >= cancel_after:
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
            return {"cancelled": True, "t0": t0}
    conn.close()
    return {"text": text, "t0": t0, "first": first, "end": time.perf_counter()}


def _extra(row: str) -> dict | None:
    """llama-server rows: no prompt cache (every server computes every prompt)."""
    return {"cache_prompt": False} if row.startswith("llama") else None


def drive(port: int, prompts: list[str], clients: int, max_tokens, count, cancel_every: int = 0,
          extra: dict | None = None) -> dict:
    """`clients` threads share `prompts` round-robin; every `cancel_every`-th request leaves early."""
    results: list[dict] = []
    lock = threading.Lock()

    def client(c: int):
        for i in range(c, len(prompts), clients):
            cancel = 2 if cancel_every and i % cancel_every == cancel_every - 1 else None
            r = ask(port, "specstop", prompts[i], max_tokens[i] if isinstance(max_tokens, list) else max_tokens,
                    cancel, extra)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for r in results if "text" in r]
    tokens = [count(r["text"]) for r in done]
    ttft = sorted(r["first"] - r["t0"] for r in done if r["first"])
    tpot = sorted((r["end"] - r["first"]) / (n - 1) for r, n in zip(done, tokens) if r["first"] and n > 1)
    pct = lambda xs, q: round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 1) if xs else None  # noqa: E731
    return {"clients": clients, "requests": len(results), "errors": [r["error"] for r in results if "error" in r],
            "cancelled": sum(1 for r in results if r.get("cancelled")), "tokens": sum(tokens),
            "wall_s": round(wall, 3), "tok_s": round(sum(tokens) / wall, 2),
            "ttft_ms": {"p50": pct(ttft, 0.5), "p90": pct(ttft, 0.9)},
            "tpot_ms": {"p50": pct(tpot, 0.5), "p90": pct(tpot, 0.9)}}


def _counter(target: str | None):
    """Completion tokens of a text, by the target's tokenizer (every server's text alike)."""
    from decoding.models import load_tokenizer, named_targets

    tok = load_tokenizer(named_targets.default_target_dir() if target is None else
                         named_targets.gguf_target_dir(Path(target)) if str(target).endswith(".gguf") else target)
    return lambda text: len(tok.encode(text, add_special_tokens=False))


def held_out(n: int) -> list[str]:
    files = BenchConfig().prompt_sets
    per = [load_prompts(f, n) for f in files.values()]
    return [p["prompt"] for pair in zip(*per) for p in pair][:n]


def ours(extra: list[str], threads: int | None, target: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "decoding.serve", "--model-name", "specstop", *extra]
    return cmd + (["--threads", str(threads)] if threads else []) + (["--target", target] if target else [])


def serve_suite(clients: list[int], prompts: int, new_tokens: int, threads: int | None, repeats: int,
                llama_server: str | None, head_gguf: str | None, target: str | None, progress=print,
                serve_log: str | None = None) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="specstop-serve-log-") as logs:
        return _serve_suite(clients, prompts, new_tokens, threads, repeats, llama_server, head_gguf, target,
                            progress, serve_log, logs)


def _serve_suite(clients, prompts, new_tokens, threads, repeats, llama_server, head_gguf, target, progress,
                 serve_log, logs) -> dict:
    count = _counter(target)
    texts = held_out(max(prompts, max(clients)))
    rows = {"ours, joint": ours([], threads, target), "ours, independent": ours(["--budget", "independent"], threads, target),
            "ours, ar": ours(["--strategy", "ar"], threads, target),
            "ours, fixed chain": ours(["--strategy", "sd", "--gamma", "2", "--budget", "independent"], threads, target),
            "ours, one by one": ours(["--max-batch", "1"], threads, target)}
    if serve_log:
        rows[f"ours, joint, logged {serve_log}"] = ours(["--log-prompts", logs, "--log-keep", serve_log], threads, target)
    if target is None or str(target).endswith(".gguf"):  # a float32 target on the lean forward
        rows["ours, joint, f16 KV"] = ours(["--kv-dtype", "float16"], threads, target)
    if llama_server:
        from decoding.bench.llama import LlamaServer, find_server
        from decoding.models import named_targets

        binary, gguf = find_server(llama_server), Path(target) if target else named_targets.smollm2_gguf_path()
        for n in clients:
            rows[f"llama.cpp -np {n}"] = lambda n=n: LlamaServer(binary, gguf, threads or 1, 4096 * n, parallel=n)
            if head_gguf:
                rows[f"llama.cpp+head -np {n}"] = lambda n=n: LlamaServer(binary, gguf, threads or 1, 4096 * n,
                                                                         Path(head_gguf), parallel=n)
    out = {"clients": clients, "prompts": len(texts), "new_tokens": new_tokens, "threads": threads,
           "repeats": repeats, "runs": []}
    for rep in range(repeats):
        servers: dict = {}
        try:  # every server up at once (idle ones wait on a condition), fresh each repeat
            for name, cmd in rows.items():
                progress(f"[serve] starting {name} (repeat {rep})")
                servers[name] = cmd() if callable(cmd) else Server(name, cmd)
                ask(servers[name].port, "specstop", texts[0], 4, extra=_extra(name))  # warm-up: kernels, the cost curve
            names = list(servers)  # the rows in turn, each repeat starting one further on: no row
            names = names[rep % len(names):] + names[:rep % len(names)]  # always runs first after start-up
            for name in names:
                srv = servers[name]
                for n in clients if not name.startswith("llama") else [int(name.rsplit(" ", 1)[1])]:
                    r = drive(srv.port, texts, n, new_tokens, count, extra=_extra(name))
                    out["runs"].append({"row": name, "repeat": rep, **r})
                    progress(f"[serve] {name} clients={n} rep={rep}: {r['tok_s']} tok/s, errors {len(r['errors'])}" + (f" (first: {r['errors'][0]})" if r['errors'] else ""))
        finally:
            for srv in servers.values():
                srv.close()
    return out


def summary(res: dict) -> dict:
    """Median tok/s per (row, clients) over repeats, and each row over `ours, one by one`."""
    by: dict[tuple, list[float]] = {}
    for r in res["runs"]:
        by.setdefault((r["row"], r["clients"]), []).append(r["tok_s"])
    med = {k: statistics.median(v) for k, v in by.items()}
    return {f"{row} @ {n}": {"tok_s": v, "range": [min(by[(row, n)]), max(by[(row, n)])],
                             "x_one_by_one": round(v / med[("ours, one by one", n)], 3)
                             if ("ours, one by one", n) in med else None}
            for (row, n), v in sorted(med.items(), key=lambda kv: (kv[0][1], kv[0][0]))}


def serve_markdown(res: dict) -> str:
    s = summary(res)
    lines = ["# Serving: concurrent clients, our server vs llama-server", "",
             f"{res['prompts']} held-out chat prompts shared round-robin by the clients, greedy, "
             f"{res['new_tokens']} new tokens, {res['threads'] or 'all'} threads, {res['repeats']} repeats "
             "(each repeat starts its own servers, all up at once, and runs every row in turn); tokens/s = completion tokens / wall from first send to last answer, median "
             "[min, max] over repeats; x = over `ours, one by one` at the same clients.", "",
             "| row @ clients | tok/s [min, max] | x one-by-one | TTFT p50 / p90 ms | per token p50 / p90 ms | errors |",
             "|---|---|---|---|---|---|"]
    last = {(r["row"], r["clients"]): r for r in res["runs"]}
    for key, v in s.items():
        row, n = key.rsplit(" @ ", 1)
        r = last[(row, int(n))]
        lines.append(f"| {key} | {v['tok_s']:.1f} [{v['range'][0]:.1f}, {v['range'][1]:.1f}] | "
                     f"{v['x_one_by_one'] if v['x_one_by_one'] is not None else '-'} | "
                     f"{r['ttft_ms']['p50']} / {r['ttft_ms']['p90']} | {r['tpot_ms']['p50']} / {r['tpot_ms']['p90']} "
                     f"| {len(r['errors'])} |")
    return "\n".join(lines) + "\n"


def main(a, command: str, progress=print) -> int:
    """`--suite serve` of python -m decoding.bench (its parsed args)."""
    import time

    from decoding.bench.plots import serve_plot
    from decoding.bench.report import write_atomic

    res = serve_suite(a.clients, a.prompts or 16, a.new_tokens, a.threads, a.repeats or 2, a.llama_server,
                      a.head_gguf, a.target, progress, getattr(a, "serve_log", None))
    md = serve_markdown(res)
    res["command"] = command
    out = Path(a.out or f"reports/serve-{time.strftime('%Y-%m-%d')}")
    write_atomic(out / "results.json", json.dumps(res, indent=2))
    write_atomic(out / "results.md", md + f"\nCommand: `{command}`\n")
    serve_plot(summary(res), out / "serve.png")
    print(md)
    return 0
