"""The serve-check's runs, paired: one vLLM engine at a time in its own interpreter
(vllm_side.py, kept alive), specstop's engine in this one, alternating prompt by prompt (who goes
first alternating too), so ours and theirs are timed in the same minutes. These machines drift
by 20-30% within an hour; a design that ran all of vLLM, then all of ours, read that drift as a
speed ratio."""

from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
import time
from pathlib import Path

SIDE = Path(__file__).with_name("vllm_side.py")
# CPU libraries vLLM wants preloaded (speculative decoding loses much without Intel OpenMP)
PRELOAD = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "lib/libiomp5.so")


class CheckError(Exception):
    """Bad input or an unusable vLLM (exit 2), one line."""


def vllm_env(python: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    venv = Path(python).parent.parent
    libs = [str(p) for p in (Path(PRELOAD[0]), venv / PRELOAD[1]) if p.is_file()]
    if libs:
        env["LD_PRELOAD"] = ":".join([*libs, env.get("LD_PRELOAD", "")]).rstrip(":")
    return env


class VllmProcess:
    """One vLLM engine in vllm_side.py's process, for the length of a `with` block."""

    def __init__(self, python: str, request: dict, timeout_s: int):
        if not Path(python).is_file():
            raise CheckError(f"no vLLM python at {python} (make serve-check builds .venv-vllm)")
        self.python, self.request, self.timeout_s = python, request, timeout_s

    def __enter__(self) -> VllmProcess:
        fd, self.log_path = tempfile.mkstemp(prefix="serve-check-vllm-", suffix=".log")
        self.log = os.fdopen(fd, "w")
        self.req_path = Path(self.log_path).with_suffix(".request.json")
        self.req_path.write_text(json.dumps(self.request))
        t = time.perf_counter()
        self.proc = subprocess.Popen([self.python, str(SIDE), str(self.req_path)], env=vllm_env(self.python),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        try:
            ready = self._read()
        except BaseException:
            self._close(keep_log=True)
            raise
        self.version, self.construct_s = ready.get("vllm"), ready.get("construct_s", time.perf_counter() - t)
        return self

    def generate(self, ids: list[int]) -> dict:
        self.proc.stdin.write(json.dumps({"ids": list(ids)}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        if not select.select([self.proc.stdout], [], [], self.timeout_s)[0]:
            raise CheckError(f"vLLM did not answer in {self.timeout_s} s (its log: {self.log_path})")
        line = self.proc.stdout.readline()
        if not line:
            raise CheckError(f"vLLM exited ({self.proc.wait()}) without an answer (its log: {self.log_path})")
        out = json.loads(line)
        if "error" in out:
            raise CheckError(f"vLLM failed: {out['error']} (its log: {self.log_path})")
        return out

    def __exit__(self, *exc) -> None:
        self._close(keep_log=exc[0] is not None)

    def _close(self, keep_log: bool) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        self.req_path.unlink(missing_ok=True)
        if not keep_log:  # kept only when something went wrong
            Path(self.log_path).unlink(missing_ok=True)


def _record(run: dict, out: dict) -> None:
    for k in ("outputs", "seconds", "accepted", "tokens", "drafted"):
        if k in out:
            run[k].append(out[k])


def pair(cfg, rows: list[dict], request: dict, key: str, decoders: dict, theirs: dict, mine: dict) -> None:
    """vLLM's `key` run and specstop's `decoders` ({run key: Decoder}) over `rows`, alternating."""
    with VllmProcess(cfg.python, dict(request, warmup=rows[0]["ids"]), cfg.timeout_s) as eng:
        theirs["vllm"] = eng.version
        for dec in decoders.values():  # warm-up, as vLLM's (a first call may time the cost curve)
            dec.generate(rows[0]["ids"], max_new_tokens=cfg.max_new_tokens)
        run = theirs["runs"][key] = {"outputs": [], "seconds": [], "accepted": [], "drafted": [],
                                     "construct_s": eng.construct_s}
        for name in decoders:
            mine[name] = {"outputs": [], "seconds": [], "accepted": [], "tokens": []}
        for i, r in enumerate(rows):
            turn = [None, *decoders]
            for name in turn[::-1] if i % 2 else turn:
                if name is None:
                    _record(run, eng.generate(r["ids"]))
                    continue
                res = decoders[name].generate(r["ids"], max_new_tokens=cfg.max_new_tokens)
                _record(mine[name], {"outputs": res.token_ids, "seconds": res.stats["wall_s"],
                                     "accepted": res.stats.get("accepted", 0), "tokens": res.stats["new_tokens"]})


def run_paired(cfg, rows: list[dict], request: dict, speculators: str | None, log) -> tuple[dict, dict]:
    """Every vLLM run beside the specstop runs it is compared with: per dtype, plain vLLM with
    `ar`, vLLM + head with the default and `sd --gamma G --stop fixed --head-window 0`; then the speculators export
    (fp32, contract only). Returns (theirs, mine) keyed "<dtype>/<run>"."""
    from decoding import Decoder
    from decoding.forward import quant

    theirs, mine = {"vllm": None, "runs": {}}, {}
    for dtype in cfg.dtypes:
        t = time.perf_counter()
        # vLLM runs a GGUF target's dequantized weights and its head over the whole context: so does sd here
        with quant.dequantized():
            sd = Decoder.load(cfg.target, cfg.draft, dtype=dtype, strategy="sd", gamma=cfg.gamma, stop="fixed",
                              head_window=0)
        head = {f"{dtype}/sd": sd}
        if not cfg.contract_only:
            head = {f"{dtype}/default": sd.default_variant(), **head}
        pair(cfg, rows, dict(request, dtype=dtype, draft=None), f"{dtype}/plain", {f"{dtype}/ar": sd.variant("ar")},
             theirs, mine)
        pair(cfg, rows, dict(request, dtype=dtype), f"{dtype}/head", head, theirs, mine)
        log(f"serve-check: {dtype}, vLLM and specstop paired, {time.perf_counter() - t:.0f} s")
    if speculators:  # the `vllm serve DIR` path
        pair(cfg, rows, dict(request, dtype="float32", draft=None, model=speculators), "float32/speculators", {},
             theirs, mine)
        log("serve-check: the speculators export served")
    return theirs, mine
