"""Measuring rows: runners for our engine and the Hugging Face peers, the interleaved
repeat loop, peak memory, agreement with `ar` and the target log-likelihood of outputs."""

from __future__ import annotations

import copy
import os
import statistics
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from decoding.bench.agreement import check_greedy, count_kinds
from decoding.bench.config import BenchConfig, StrategySpec
from decoding.bench.stats import RESAMPLES, speedup_ci
from decoding.drafts.io import is_feature_draft
from decoding.models import ModelError
from decoding.sampling import SamplingConfig


class MemorySampler:
    """Peak memory above the pre-run baseline, in MB. CPU: RSS sampled from /proc/self/statm
    by a thread (every 10 ms: KV caches grow over a whole run, so they are not missed);
    CUDA: torch.cuda.max_memory_allocated."""

    def __init__(self, device: str, interval_s: float = 0.01):
        self.cuda = device.startswith("cuda")
        self.interval_s = interval_s
        self.peak_mb: float | None = None
        self._stop = threading.Event()

    @staticmethod
    def _rss() -> int | None:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None

    def _loop(self):
        while not self._stop.wait(self.interval_s):
            rss = self._rss()
            if rss is not None:
                self._peak = max(self._peak, rss)

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        self._base = self._rss()
        self._peak = self._base or 0
        if self._base is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_mb = (torch.cuda.max_memory_allocated() - self._base) / 2**20
        elif self._base is not None:
            self._stop.set()
            self._thread.join()
            self._peak = max(self._peak, self._rss() or 0)
            self.peak_mb = (self._peak - self._base) / 2**20
        return False


@dataclass
class RunOut:
    tokens: list[int]
    wall_s: float
    stats: dict | None = None
    """RunStats.to_dict() for our engine; {new_tokens, target_calls} for HF peers."""


class EngineRunner:
    def __init__(self, engine, eos, setting: dict | None = None):
        self.engine, self.eos = engine, eos
        self.setting = setting
        """The stop policy's resolved rule / threshold and where the threshold came from."""

    def run(self, ids, n, seed) -> RunOut:
        t = time.perf_counter()
        out, st = self.engine.generate(ids, n, self.eos, seed)
        return RunOut(out, time.perf_counter() - t, st.to_dict())


class HFRunner:
    """`target.generate` with the draft as assistant (HF's defaults) or prompt lookup.
    Target forwards are counted by a hook, for block efficiency."""

    def __init__(self, target, draft, spec: StrategySpec, sampling: SamplingConfig, eos, stop_at_eos: bool):
        self.target, self.draft = target, draft
        self.kw = {"do_sample": not sampling.greedy, "pad_token_id": eos if isinstance(eos, int) else None}
        if not sampling.greedy:  # full-vocabulary sampling, like our engine (HF's top_k=50 off)
            self.kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        if eos is not None:
            self.kw["eos_token_id"] = eos
        self.stop_at_eos = stop_at_eos
        # HF's assisted generation passes a generation_config plus kwargs internally and warns
        # about it on every call; the warning is HF's own and says nothing about this run
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        if spec.strategy == "hf-assisted":
            if draft is None:
                raise ModelError("hf-assisted needs a draft model")
            if is_feature_draft(draft):
                raise ModelError("hf-assisted needs a stand-alone draft (HF's assisted generation cannot drive "
                                 "a feature head): give the row its own, e.g. "
                                 "`draft: checkpoints/drafts/smollm2-135m-draft`")
            self.kw["assistant_model"] = draft
            # HF adapts the assistant's threshold and persists it on its generation_config; reset
            # it before every call so each prompt starts from HF's defaults (repeats stay identical)
            self._gc0 = copy.deepcopy(draft.generation_config)
        else:
            self.kw["prompt_lookup_num_tokens"] = spec.prompt_lookup_num_tokens
            self._gc0 = None

    def run(self, ids, n, seed) -> RunOut:
        if self._gc0 is not None:
            self.draft.generation_config = copy.deepcopy(self._gc0)
        calls = [0]
        hook = self.target.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        dev = self.target.device
        x = torch.tensor([ids], device=dev)
        extra = {} if self.stop_at_eos else {"min_new_tokens": n}
        torch.manual_seed(seed)
        try:
            t = time.perf_counter()
            with torch.inference_mode():
                y = self.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                         **self.kw, **extra)
            wall = time.perf_counter() - t
        finally:
            hook.remove()
        out = y[0, len(ids):].tolist()
        return RunOut(out, wall, {"new_tokens": len(out), "target_calls": calls[0]})


def _setting(spec: StrategySpec, stop) -> dict | None:
    """What the row's stop policy really ran with (read back from the built policy)."""
    if getattr(stop, "sizes_children", False):  # decoding.growth: no threshold, a cost model
        return {"rule": "grow", "scores": stop.label, "max_width": stop.max_width, "max_nodes": stop.max_nodes,
                **({"level_widths": list(stop.level_widths)} if stop.level_widths else {}),
                "source": "cost model " + ("timed on this machine at the start of the run"
                                           if spec.grow_cost == "measure" else "measured by the decider's fit")}
    if spec.stop == "decider":
        return {"rule": stop.cfg.rule, "threshold": stop.cfg.threshold,
                "source": "config" if spec.decider_threshold is not None else f"validated for the {stop.cfg.rule} rule"}
    if spec.stop == "confidence":
        return {"rule": stop.rule, "threshold": stop.threshold,
                "source": "tuned on the decider's validation replay" if spec.tuned else "config"}
    return None


def make_runner(sess, spec: StrategySpec, sampling: SamplingConfig, cfg: BenchConfig):
    """A runner for the row; a row that cannot run (missing / corrupt decider, no validated
    threshold for its rule, ...) is an error naming the row: never a quietly skipped row."""
    eos = sess.eos_token_id if cfg.stop_at_eos else None
    try:
        if spec.peer:
            return HFRunner(sess.target, sess.draft, spec, sampling, sess.eos_token_id, cfg.stop_at_eos)
        decider = spec.decider or cfg.decider
        tuned = sess.tuned_confidence_threshold(decider, spec.confidence_rule) if spec.tuned else None
        eng = sess.engine(spec.engine_config(tuned), sampling, decider, spec.decider_rule, spec.decider_threshold)
    except (ValueError, OSError) as e:  # ModelError is a ValueError: missing / corrupt / other pair
        raise ValueError(f"strategy {spec.name}: {str(e).splitlines()[0]}") from e
    return EngineRunner(eng, eos, _setting(spec, eng.stop))


@dataclass
class Acc:
    """Everything measured for one row in one condition."""

    tok_s: list[float] = field(default_factory=list)
    """Per repeat: new tokens over all prompts / wall time over all prompts."""
    tokens: list[list[int]] = field(default_factory=list)
    """[repeat][prompt] new tokens (the speedup's bootstrap resamples prompts)."""
    wall: list[list[float]] = field(default_factory=list)
    """[repeat][prompt] wall seconds."""
    outputs: list[list[int]] = field(default_factory=list)
    """Repeat 0's output per prompt (later repeats are identical: same seeds)."""
    stats: list[dict] = field(default_factory=list)
    """Repeat 0's stats per prompt."""
    time_split: Counter = field(default_factory=Counter)
    """draft_s / verify_s / bookkeeping_s / wall_s summed over all repeats."""
    peak_mb: float | None = None


def measure(runners: dict, prompts: list[list[int]], cfg: BenchConfig, n: int, repeats: int,
            device: str, seed: int, warmup: int) -> dict[str, Acc]:
    """Warm-up, then `repeats` passes; within a pass every runner does all prompts in turn, so
    drift in background load hits all rows alike and speedups are paired per repeat."""
    for r in runners.values():
        if warmup:
            r.run(prompts[0], warmup, seed)
    accs = {k: Acc() for k in runners}
    for rep in range(repeats):
        for name, r in runners.items():
            a, toks, wall = accs[name], 0, 0.0
            a.tokens.append([])
            a.wall.append([])
            with MemorySampler(device) as mem:
                for i, ids in enumerate(prompts):
                    res = r.run(ids, n, seed + i)
                    toks += len(res.tokens)
                    wall += res.wall_s
                    a.tokens[-1].append(len(res.tokens))
                    a.wall[-1].append(res.wall_s)
                    a.time_split["wall_s"] += res.wall_s
                    for k in ("draft_s", "verify_s", "bookkeeping_s"):
                        a.time_split[k] += (res.stats or {}).get(k, 0.0)
                    if rep == 0:
                        a.outputs.append(res.tokens)
                        a.stats.append(res.stats or {})
            a.tok_s.append(toks / wall if wall else 0.0)
            if mem.peak_mb is not None:
                a.peak_mb = max(a.peak_mb or 0.0, mem.peak_mb)
    return accs


class LogLik:
    """Mean target log-likelihood (temperature 1) per generated token: one forward over
    prompt + output, cached by sequence (many rows share ar's greedy output)."""

    def __init__(self, target):
        self.target = target
        self._cache: dict[tuple, tuple[float, int]] = {}

    @torch.inference_mode()
    def score(self, prompt: list[int], out: list[int]) -> tuple[float, int]:
        if not out:
            return 0.0, 0
        key = (tuple(prompt), tuple(out))
        if key not in self._cache:
            x = torch.tensor([prompt + out], device=self.target.device)
            logits = self.target(x).logits[0, len(prompt) - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, x[0, len(prompt):, None])
            self._cache[key] = (float(lp.sum()), len(out))
        return self._cache[key]

    def mean(self, prompts, outputs) -> float | None:
        tot = [self.score(p, o) for p, o in zip(prompts, outputs)]
        n = sum(c for _, c in tot)
        return sum(s for s, _ in tot) / n if n else None


def prefix_fraction(out: list[int], ref: list[int]) -> float:
    """Length of the common prefix over the length of ar's output."""
    k = 0
    for a, b in zip(out, ref):
        if a != b:
            break
        k += 1
    return k / len(ref) if ref else 1.0


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "per_repeat": xs}


def row_of(spec: StrategySpec, runner, acc: Acc | None, ar: Acc | None, greedy: bool,
           prompts, loglik: LogLik, resamples: int = RESAMPLES, seed: int = 0, dtype: str = "float32") -> dict:
    """The results.json row of one strategy in one condition. `lossless` is measured where it
    can be: greedy rows are compared with ar prompt by prompt (decoding.bench.agreement), and a row
    with a mismatch is not lossless whatever its configuration says."""
    row = {"name": spec.name, "strategy": spec.strategy, "kind": "hf" if spec.peer else "engine",
           "lossless": spec.mode == "lossless", "configured_lossless": spec.mode == "lossless", "dynamic": not spec.peer and spec.stop != "fixed",
           "tree_nodes": spec.tree_nodes, "stop": None if spec.peer else spec.stop,
           "stop_setting": getattr(runner, "setting", None), "draft": spec.draft, "decider": spec.decider}
    if acc is None:
        return {**row, "status": runner if isinstance(runner, str) else "skipped"}
    row["status"] = "ok"
    row["tokens_per_s"] = spread(acc.tok_s)
    row["per_prompt"] = {"tokens": acc.tokens, "wall_s": acc.wall}
    paired = [a / b for a, b in zip(acc.tok_s, ar.tok_s) if b]
    row["speedup"] = spread(paired) if paired else None
    if paired:  # 95% CI by a bootstrap over prompts, paired with ar's runs in the same repeats
        _, lo, hi = speedup_ci(acc.tokens, acc.wall, ar.tokens, ar.wall, resamples, seed=seed)
        med = row["speedup"]["median"]  # the same statistic, summed in another order: equal up to rounding
        row["speedup"]["ci95"] = [min(lo, med), max(hi, med)]
    st = acc.stats
    new = sum(s.get("new_tokens", 0) for s in st)
    calls = sum(s.get("target_calls", 0) for s in st)
    row.update(new_tokens=new, target_calls=calls, block_efficiency=new / calls if calls else None,
               peak_mem_mb=acc.peak_mb)
    if spec.peer:
        row.update(acceptance_rate=None, accepted_lengths=None, drafted_depths=None, profile=None)
    else:
        drafted = sum(s["drafted"] for s in st)
        hist, depths = Counter(), Counter()
        for s in st:
            hist.update({int(k): v for k, v in s["accepted_lengths"].items()})
            depths.update({int(k): v for k, v in s["drafted_depths"].items()})
        rounds = sum(s["rounds"] for s in st)
        row["mean_tree_size"] = sum(s["mean_tree_size"] * s["rounds"] for s in st) / rounds if rounds else None
        ts, wall = acc.time_split, acc.time_split["wall_s"] or 1.0
        parts = {k: ts[k + "_s"] / wall for k in ("draft", "verify", "bookkeeping")}
        row.update(acceptance_rate=sum(s["accepted"] for s in st) / drafted if drafted else None,
                   accepted_lengths=dict(sorted(hist.items())), drafted_depths=dict(sorted(depths.items())),
                   profile={**parts, "other": max(0.0, 1 - sum(parts.values())),
                            "ms_per_round": 1000 * wall / (rounds * len(acc.tok_s)) if rounds else None})
    if greedy and ar is not None:
        checks = [check_greedy(loglik.target, p, r, o, dtype) for p, r, o in zip(prompts, ar.outputs, acc.outputs)]
        kinds = count_kinds(checks)
        eq = kinds["equal"]
        row["equal_to_ar"] = {**kinds, "n": len(ar.outputs),
                              "differences": [{"prompt": i, **asdict(c)} for i, c in enumerate(checks)
                                              if c.kind != "equal"]}
        row["lossless"] = row["lossless"] and not kinds["mismatch"]
        row["lossless_evidence"] = "greedy vs ar (equal / tie / mismatch)"
        row["agreement"] = {"exact_match": eq / len(ar.outputs),
                            "prefix_fraction": statistics.mean(
                                prefix_fraction(o, r) for o, r in zip(acc.outputs, ar.outputs))}
    else:
        row["equal_to_ar"] = row["agreement"] = None
        row["lossless_evidence"] = "the exact-sampling test" if row["lossless"] else None
    row["loglik_per_token"] = loglik.mean(prompts, acc.outputs)
    return row
