"""The GPU suite: what a GPU user gets, in one prepared run (`python -m decoding.bench --suite gpu
--out DIR`), inside a time budget (a device lease is minutes), no network.

Rows, on the held-out prompts (the first --prompts of each set, chat template, greedy, bf16):
HF `generate` (eager: the baseline users know), our `ar`, our defaults (the shipped head, the
`cuda` entry of decoding/defaults.yaml) and a few other lossless candidates, all on the graph
forward (decoding.forward.static: a static cache, CUDA graphs per tree-size bucket), and HF
assisted generation with the stand-alone draft. Each row runs every prompt at each length, the
order rotating per prompt; ratios come with 95% bootstrap intervals over prompts
(decoding.bench.stats). Beside them: the per-forward cost by tree size on the GPU (graph and eager)
and the CPU's (the stored curve of the latest decider), and the `cuda` defaults entry picked from
the run (the fastest lossless row whose interval over `ar` clears 1 at every length), written as
DIR/defaults.yaml (decoding/defaults.yaml with that entry; copy it over to adopt it).

Every part checks the budget and skips what would not fit (marked in the report). With tiny
models (`--target DIR --head DIR --draft DIR --device cpu`) it runs end to end on a CPU: the
same code, the static forward without capture (what the tests run).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from decoding.bench.gpu_rows import load_rows, warm

STANDALONE_DRAFT = "checkpoints/drafts/smollm2-135m-draft"


@dataclass
class GpuSuiteConfig:
    target: str | None = None
    """None: the embedded SmolLM2 target (converted from its GGUF once)."""
    head: str | None = None
    """The feature head of our rows (None: the shipped one)."""
    draft: str | None = STANDALONE_DRAFT
    """The stand-alone draft of HF's assisted row (None: no such row)."""
    device: str = "cuda"
    dtype: str = "bfloat16"
    prompts: int = 6
    """Per prompt set (general, code): 12 prompts."""
    new_tokens: tuple[int, ...] = (96, 512)
    budget_s: float = 420.0
    """Seconds for the whole suite (loading included); parts past it are skipped."""
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    candidates: tuple[dict, ...] = (
        {"strategy": "sd", "gamma": 3},
        {"strategy": "ar", "round": "device"},
        {"strategy": "sd", "gamma": 2, "round": "device"},
        {"strategy": "sd", "gamma": 3, "round": "device"},
        {"strategy": "sd", "gamma": 4, "round": "device"},
        {"strategy": "ti-mcsd", "width": 4, "depth": 4, "round": "device"},
        {"strategy": "mcsd", "k_config": "4,2,2,1,1", "round": "device"},
        {"strategy": "mcsd", "k_config": "4,2,2,1,1", "round": "device", "lookahead": 2},
    )
    """Further lossless rows for the `cuda` entry (and the defaults row unless it is `ar`): the host
    round's best earlier row (sd γ=3), and fixed trees run whole on the device (decoding.round)."""
    sampled: tuple[str, ...] = ("ar", "ar+device", "sd[g=3]+device", "ti-mcsd[W=4,D=4]+device")
    """Rows run again at temperature 1.0 (named NAME@T1, compared with ar@T1)."""
    hf_tokens: int = 96
    """HF's rows run at lengths up to this only (an eager HF generate costs minutes at 512)."""
    hf_compiled: bool = True
    """A row of HF generate with its static cache and torch.compile (what a transformers user tries
    first on a GPU), compiled in the warm-up when the budget allows."""
    prompt_sets: dict = field(default_factory=lambda: {"general": "data/prompts/heldout_general.jsonl",
                                                       "code": "data/prompts/heldout_code.jsonl"})

    @property
    def forward(self) -> str:
        return "graph" if self.device.startswith("cuda") else "static"


class Clock:
    """The suite's budget: parts ask before they start."""

    def __init__(self, budget_s: float, progress):
        self.t0, self.budget, self.progress = time.monotonic(), budget_s, progress

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def say(self, msg: str) -> None:
        self.progress(f"[{time.monotonic() - self.t0:6.1f} s] {msg}")


def cost_curves(sess, cfg: GpuSuiteConfig, clock: Clock) -> dict:
    """ms per target forward by tokens fed: this device's graph and eager forwards, and the CPU's
    stored curve (the latest decider's cost model, measured on a CPU)."""
    import copy

    from decoding.forward.cost import time_forwards
    from decoding.forward.packed import set_forward

    out = {"sizes": list(cfg.sizes), cfg.forward: time_forwards(sess.target, cfg.sizes)}
    clock.say(f"cost curve ({cfg.forward}): " + ", ".join(f"{n}:{ms:.2f}" for n, ms in zip(cfg.sizes, out[cfg.forward])))
    if clock.left() > 60:
        eager = copy.deepcopy(sess.target)
        set_forward(eager, "eager")
        out["eager"] = time_forwards(eager, cfg.sizes)
        del eager
    try:
        from decoding.decider.policy import resolve_decider_dir

        cm = json.loads((resolve_decider_dir("latest") / "config.json").read_text())["cost_model"]
        src = cm.get("source", "the latest decider's cost model")
        src = src.get("target_ms", str(src)) if isinstance(src, dict) else src
        out["cpu"] = {"sizes": cm["sizes"], "target_ms": cm["target_ms"], "source": src}
    except Exception as e:  # no registry: the report says so
        out["cpu"] = {"missing": f"{type(e).__name__}: {e}"}
    return out


def timed_runs(rows: dict, prompts: list[dict], cfg: GpuSuiteConfig, clock: Clock, failed: dict,
               save=lambda res: None) -> dict:
    """{n: {row: [(tokens, seconds, ids) per prompt]}}, rows rotating per prompt. Before each
    prompt the budget is asked for one more (its time estimated from the prompts so far, or the
    shorter length's scaled): a length runs on as many prompts as fit (at least 2 for an
    interval), else it is skipped. A row that raises is dropped (its error kept in `failed`)."""
    res = {}
    for n in cfg.new_tokens:
        names = [k for k in rows if k not in failed and (not k.startswith("hf-") or n <= cfg.hf_tokens)]
        got = {k: [] for k in names}
        for i, p in enumerate(prompts):
            need = _per_prompt(got, res, n)
            if need * 1.1 > clock.left():
                clock.say(f"{n} tokens: stopped after {i} prompts (about {need:.0f} s a prompt, {clock.left():.0f} s left)")
                break
            for name in names[i % len(names):] + names[:i % len(names)]:
                if name in failed:
                    continue
                try:
                    out, sec = rows[name](p["ids"], n)
                except Exception as e:  # one row's failure must not cost the others' report
                    failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    clock.say(f"{name} failed: {failed[name]}")
                    continue
                got[name].append((len(out), sec, out, getattr(rows[name], "last_rounds", None)))
            clock.say(f"{n} tokens, prompt {i + 1}/{len(prompts)}: " + ", ".join(
                f"{k} {got[k][-1][0] / got[k][-1][1]:.0f} tok/s" for k in names if k not in failed))
        got = {k: v for k, v in got.items() if k not in failed}
        if min((len(v) for v in got.values()), default=0) >= 2 and "ar" in got:
            res[n] = got
            save(res)
        else:
            clock.say(f"{n} tokens: skipped (fewer than 2 prompts fit the budget)")
    return res


def _per_prompt(got: dict, res: dict, n: int) -> float:
    """Seconds one more prompt of every row should take at length n."""
    done = [sum(r[1] for r in v) / len(v) for v in got.values() if v]
    if done:
        return sum(done)
    if not res:
        return 0.0
    m = max(res)
    return sum(sum(r[1] for r in v) / len(v) for v in res[m].values()) * n / m


def summarize(runs: dict, rows: dict) -> dict:
    from decoding.bench.stats import speedup_ci

    out = {}
    for n, got in runs.items():
        k = min(len(v) for v in got.values())  # a row that failed late ran fewer prompts
        got = {name: v[:k] for name, v in got.items()}
        base = got.get("hf-generate")
        cond = {}
        for name, r in got.items():
            ar = got.get("ar@T1" if name.endswith("@T1") else "ar")
            tok, wall = [[x[0] for x in r]], [[x[1] for x in r]]
            row = {"tokens_per_s": sum(tok[0]) / sum(wall[0]), "tokens": tok[0], "wall_s": wall[0],
                   "equal_to_hf_generate": sum(a[2] == b[2] for a, b in zip(r, base or r)) if base else None,
                   "prompts": len(r),
                   "spec": getattr(rows[name], "spec", None)}
            rounds = [x[3] for x in r]
            if all(isinstance(x, int) and x > 0 for x in rounds):  # our rows: what one round buys and costs
                row["tokens_per_round"] = sum(tok[0]) / sum(rounds)
                row["ms_per_round"] = 1000 * sum(wall[0]) / sum(rounds)
            for ref, key in ((base, "over_hf_generate"), (ar, "over_ar")):
                if ref is not None and ref is not r:
                    p, lo, hi = speedup_ci(tok, wall, [[x[0] for x in ref]], [[x[1] for x in ref]])
                    row[key] = {"median": p, "ci95": [lo, hi]}
            cond[name] = row
        out[str(n)] = cond
    return out


def pick_cuda(summary: dict, dtype: str, forward: str, date: str) -> dict:
    """The fastest of our lossless rows whose interval over ar clears 1 at every length (geometric
    mean of the medians); plain ar when none does."""
    best, score = {"strategy": "ar"}, 0.0
    names = set.intersection(*(set(c) for c in summary.values())) if summary else set()
    for name in sorted(n for n in names - {"hf-generate", "hf-assisted", "ar"} if not n.startswith("hf-") and "@" not in n):
        sp = [summary[n][name].get("over_ar") for n in summary]
        if not sp or any(s is None or not s["ci95"][0] > 1.0 for s in sp):
            continue
        g = math.exp(sum(math.log(s["median"]) for s in sp) / len(sp))
        if g > score:
            best = {k: v for k, v in (summary[next(iter(summary))][name]["spec"] or {}).items() if v is not None}
            best["measured"] = {f"greedy/{n}-tokens": round(summary[n][name]["over_ar"]["median"], 3) for n in summary}
            score = g
    best["dtype"] = dtype
    best["source"] = f"python -m decoding.bench --suite gpu ({date}, {forward} forward): fastest lossless greedy row over ar"
    return best


def write_json(path: Path, data) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def gpu_suite(cfg: GpuSuiteConfig, out: Path, progress=print) -> dict:
    """Run the suite and write DIR/results.json, README.md, cost.png and defaults.yaml."""
    import torch

    from decoding.bench.config import load_prompts
    from decoding.bench.gpu_report import cost_plot, markdown
    from decoding.bench.launches import for_rows
    from decoding.bench.pick_defaults import write_defaults
    from decoding.defaults import DEFAULTS_PATH

    out.mkdir(parents=True, exist_ok=True)
    clock = Clock(cfg.budget_s, progress)
    if cfg.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # bf16 rows: what a user runs
    sess, rows = load_rows(cfg)
    clock.say(f"loaded: {sess.target_dir} ({cfg.dtype}, {cfg.forward} forward), rows: {', '.join(rows)}")
    prompts = [dict(r, kind=k) for k, f in cfg.prompt_sets.items() for r in load_prompts(f, cfg.prompts)]
    chat = getattr(sess.tokenizer, "chat_template", None) is not None
    for p in prompts:
        p["ids"] = sess.encode(p["prompt"], chat=chat)
    failed: dict[str, str] = {}
    warm(rows, max((p["ids"] for p in prompts), key=len), cfg, clock, failed)
    res = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "device": _device(cfg.device), "dtype": cfg.dtype,
                    "forward": cfg.forward, "torch": torch.__version__, "config": asdict(cfg),
                    "prompts": [{"id": p["id"], "kind": p["kind"], "tokens": len(p["ids"])} for p in prompts]}}
    res["failed_rows"] = failed
    try:
        res["cost"] = cost_curves(sess, cfg, clock)
    except Exception as e:  # the runs still go ahead
        res["cost"] = {"sizes": [], "failed": f"{type(e).__name__}: {e}"}
        clock.say(f"cost curve failed: {res['cost']['failed']}")
    try:  # what a round launches besides the replays (decoding.bench.launches): untimed, ~20 s
        ours = {k: r.engine for k, r in rows.items() if hasattr(r, "engine") and k not in failed}
        res["launches"] = for_rows(ours, [p["ids"] for p in prompts[::cfg.prompts]], 64, sess.eos_token_id, clock.left)
    except Exception as e:  # the report goes ahead without them
        res["launches"] = {"failed": f"{type(e).__name__}: {e}"}
    try:  # a device round's ms by step (decoding.round.timing), each step's own graph: untimed runs
        from decoding.round.timing import split_ms

        ids0 = prompts[0]["ids"]
        res["round_split"] = {k: split_ms(r.engine, ids0) for k, r in rows.items()
                              if k not in failed and hasattr(getattr(r, "engine", None), "runner") and "@" not in k}
    except Exception as e:  # the report goes ahead without it
        res["round_split"] = {"failed": f"{type(e).__name__}: {e}"}
    write_json(out / "results.json", res)  # kept up to date: a run cut short leaves what it measured

    def save(runs):
        res["conditions"] = summarize(runs, rows)
        res["meta"]["elapsed_s"] = cfg.budget_s - clock.left()
        write_json(out / "results.json", res)

    runs = timed_runs(rows, prompts, cfg, clock, failed, save)
    res["conditions"] = summarize(runs, rows)
    res["cuda_defaults"] = pick_cuda(res["conditions"], cfg.dtype, cfg.forward, res["meta"]["date"])
    res["meta"]["elapsed_s"] = cfg.budget_s - clock.left()
    write_json(out / "results.json", res)
    (out / "defaults.yaml").write_text(DEFAULTS_PATH.read_text())
    write_defaults(res["cuda_defaults"], "cuda", out / "defaults.yaml")
    cost_plot(res["cost"], out / "cost.png")
    (out / "README.md").write_text(markdown(res))
    clock.say(f"report in {out}")
    return res


def _device(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    import platform

    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    """`python -m decoding.bench --suite gpu --out DIR [--target DIR --head DIR --draft DIR
    --device cpu --quick]`: the prepared device run (module docstring); --quick: 1 prompt per set,
    8 and 16 new tokens, cost sizes 1, 2, 4 (a CPU smoke run with tiny models)."""
    import argparse
    import sys

    from decoding.models import ModelError
    from decoding.options import add_option, add_options

    ap = argparse.ArgumentParser(prog="python -m decoding.bench --suite gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    # --draft is the stand-alone draft of HF's assisted row ('none': no row); --head drafts our rows
    add_option(ap, "suite", default="gpu", only=("gpu",))
    add_option(ap, "out", required=True)
    add_options(ap, "target", "head")
    add_option(ap, "draft", default=STANDALONE_DRAFT)
    add_option(ap, "device", default="cuda")
    add_option(ap, "dtype", only=("float32", "bfloat16", "float16"), unset="bfloat16 on CUDA, float32 elsewhere")
    add_option(ap, "prompts", unset="6")
    add_option(ap, "new_tokens", several=True, unset="96,512")
    # not --budget: that is the server's batch budget
    ap.add_argument("--budget-seconds", type=float, default=None,
                    help="seconds for the whole suite (default 420; --budget still reads as this)")
    add_option(ap, "quick")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = GpuSuiteConfig(target=a.target, head=a.head, draft=None if a.draft == "none" else a.draft,
                         device=a.device, dtype=a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"))
    if a.quick:
        cfg.prompts, cfg.new_tokens, cfg.sizes = 1, (8, 16), (1, 2, 4)
        cfg.candidates, cfg.sampled, cfg.hf_tokens = cfg.candidates[:3], ("ar", "ar+device"), 16
    if a.prompts:
        cfg.prompts = a.prompts
    if a.new_tokens:
        cfg.new_tokens = tuple(a.new_tokens)
    if a.budget_seconds:
        cfg.budget_s = a.budget_seconds
    try:
        import torch

        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--suite gpu needs a CUDA device (or --device cpu with tiny models)")
        gpu_suite(cfg, Path(a.out), progress=lambda s: print(s, flush=True))
    except (ModelError, ValueError, FileNotFoundError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0
