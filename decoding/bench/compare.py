"""The comparison suite (`python -m decoding.bench`, the default `--suite compare`): every row of
the config under every condition (temperature x prompt set), interleaved repeats, then the oracle
bound, the tree-size sweep and the run's meta (run_compare); its report (write_report). The
command that parses the flags and dispatches the suites is decoding.bench.cli."""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

from decoding import models
from decoding.bench.config import BenchConfig, StrategySpec, as_dict, load_prompts
from decoding.bench.oracle import oracle_bound
from decoding.bench.plots import plots
from decoding.bench.report import add_bound_rows, compare_drafts, compute_goals, markdown, write_atomic, write_json
from decoding.bench.runs import LogLik, make_runner, measure, row_of
from decoding.defaults import resolve_dtype
from decoding.forward import gguf
from decoding.sampling import SamplingConfig
from decoding.models.session import Session


def describe_cpu() -> str:
    """This machine's CPU as a report names it (decoding.forward.cpu.describe)."""
    from decoding.forward import cpu

    return cpu.describe()


def log(msg: str) -> None:
    """Progress, on stderr: stdout carries the report."""
    print(msg, file=sys.stderr, flush=True)


def _needs_draft(specs: list[StrategySpec]) -> bool:
    return any(s.strategy not in ("ar", "hf-prompt-lookup") for s in specs)


def _decider_name(cfg: BenchConfig) -> str | None:
    from decoding.decider.policy import resolve_decider_dir

    try:
        d = resolve_decider_dir(cfg.decider) if cfg.decider else None
    except ValueError:
        return None
    return d.name if d is not None and (d / "config.json").is_file() else None


def run_sweep(sess, cfg: BenchConfig, prompts: list[list[int]]) -> dict:
    """Greedy tokens/s of a few tree shapes (fixed depth) next to ar, on a few prompts."""
    sw, greedy = cfg.sweep, SamplingConfig(0.0, cfg.top_p)
    specs = [StrategySpec("ar")]
    specs += [StrategySpec("ti-mcsd", name=f"ti-mcsd[W={w},D={d}]", width=w, depth=d) for w, d in sw.ti_mcsd]
    specs += [StrategySpec("mcsd", name=f"mcsd[{k}]", k_config=k) for k in sw.mcsd]
    runners = {s.name: make_runner(sess, s, greedy, cfg) for s in specs}
    accs = measure(runners, prompts[: sw.prompts], cfg, sw.max_new_tokens, sw.repeats, cfg.device,
                   cfg.seed, cfg.warmup_tokens)
    ar = accs["ar"]
    ar_tps = sorted(ar.tok_s)[len(ar.tok_s) // 2]
    points = []
    for s in specs[1:]:
        a = accs[s.name]
        tps = sorted(a.tok_s)[len(a.tok_s) // 2]
        new = sum(x["new_tokens"] for x in a.stats)
        calls = sum(x["target_calls"] for x in a.stats)
        rounds = sum(x["rounds"] for x in a.stats)
        points.append({"name": s.name, "family": s.strategy, "tree_nodes": s.tree_nodes,
                       "label": f"{s.width}x{s.depth}" if s.strategy == "ti-mcsd" else s.k_config,
                       "tokens_per_s": tps, "speedup": tps / ar_tps if ar_tps else None,
                       "block_efficiency": new / calls if calls else None,
                       "ms_per_round": 1000 * a.time_split["wall_s"] / (rounds * len(a.tok_s)) if rounds else None})
        log(f"  sweep {s.name}: {tps:.1f} tok/s ({s.tree_nodes} nodes)")
    return {"prompt_set": sw.prompt_set, "prompts": min(sw.prompts, len(prompts)),
            "max_new_tokens": sw.max_new_tokens, "repeats": sw.repeats, "ar_tokens_per_s": ar_tps,
            "points": points}


def row_sessions(sess, specs: list[StrategySpec]) -> dict:
    """Each row's session: the config's pair, or the same target with the row's own draft
    (each draft loaded and checked once, before any row runs)."""
    drafts = {None: sess}
    for s in specs:
        if s.draft is not None and s.draft not in drafts:
            try:
                drafts[s.draft] = sess.with_draft(s.draft)
            except (models.ModelError, OSError) as e:
                raise ValueError(f"strategy {s.name}: {str(e).splitlines()[0]}") from e
    return {s.name: drafts[s.draft] for s in specs}


def bench_dtype(dtype: str, target, device: str) -> tuple[str, str]:
    """The dtype a run measures and why: `auto` is what Decoder.load picks for this target, so a
    GGUF target runs on its blocks (float32 activations) as a user's does, else resolve_dtype."""
    if dtype == "auto" and gguf.runs_quantized(target, device):
        return "float32", "auto: a GGUF target on its blocks, float32 activations in"
    return resolve_dtype(dtype, device)


def run_compare(cfg: BenchConfig, command: str) -> dict:
    t0 = time.perf_counter()
    cfg.dtype, dtype_source = bench_dtype(cfg.dtype, cfg.target, cfg.device)
    log(f"dtype {cfg.dtype} ({dtype_source})")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    sets = {k: load_prompts(v, cfg.prompts_per_set) for k, v in cfg.prompt_sets.items()}
    sess = Session.open(cfg.target, cfg.draft, cfg.dtype, cfg.device, need_draft=_needs_draft(cfg.strategies))
    log(f"forward {sess.forward} (decoding.forward.packed; $SPECSTOP_FORWARD=eager for the reference)")
    depth = max((len(s.shape_config().k_levels) for s in cfg.strategies if not s.peer), default=0)
    n_max = max(cfg.max_new_tokens, cfg.sweep.max_new_tokens if cfg.sweep.enabled else 0)
    ids = {k: [sess.encode(p["prompt"], chat=cfg.chat, max_new_tokens=n_max, tree_depth=depth) for p in v]
           for k, v in sets.items()}
    loglik = LogLik(sess.target)
    sessions = row_sessions(sess, cfg.strategies)
    conditions, n_cond = [], len(cfg.temperatures) * len(ids)
    for temp in cfg.temperatures:
        sampling = SamplingConfig(temp, cfg.top_p)
        for set_name, prompts in ids.items():
            name = f"{'greedy' if sampling.greedy else f'T={temp:g}'}/{set_name}"
            log(f"[{time.perf_counter() - t0:6.0f}s] {name}: {len(cfg.strategies)} rows x {cfg.repeats} repeats")
            runners = {s.name: make_runner(sessions[s.name], s, sampling, cfg) for s in cfg.strategies}
            accs = measure(runners, prompts, cfg, cfg.max_new_tokens, cfg.repeats, cfg.device, cfg.seed,
                           cfg.warmup_tokens)
            rows = [row_of(s, runners[s.name], accs.get(s.name), accs.get("ar"), sampling.greedy, prompts, loglik,
                           cfg.bootstrap_resamples, cfg.seed, cfg.dtype) for s in cfg.strategies]
            for r in rows:
                log(f"  {r['name']}: " + (f"{r['tokens_per_s']['median']:.1f} tok/s, "
                                           f"{r['speedup']['median']:.2f}x" if r["status"] == "ok" else r["status"])
                     + (" MISMATCH vs ar" if (r.get("equal_to_ar") or {}).get("mismatch") else ""))
            conditions.append({"name": name, "temperature": temp, "prompt_set": set_name,
                               "prompt_ids": [p["id"] for p in sets[set_name]], "n_prompts": len(prompts),
                               "rows": rows})
            el = time.perf_counter() - t0
            log(f"  {len(conditions)}/{n_cond} conditions in {el / 60:.1f} min; about "
                 f"{el / len(conditions) * (n_cond - len(conditions)) / 60:.1f} min to go (+ sweep)")
    log(f"[{time.perf_counter() - t0:6.0f}s] oracle bound (replay)")
    bound = oracle_bound(cfg.oracle, sess, cfg.decider)
    sweep = None
    if cfg.sweep.enabled:
        log(f"[{time.perf_counter() - t0:6.0f}s] tree-size sweep")
        sw_prompts = load_prompts(cfg.prompt_sets[cfg.sweep.prompt_set], cfg.sweep.prompts)
        sweep = run_sweep(sess, cfg, [sess.encode(p["prompt"], chat=cfg.chat, max_new_tokens=n_max,
                                                  tree_depth=depth) for p in sw_prompts])
    results = {
        "meta": {"date": time.strftime("%Y-%m-%d"), "command": command, "target": sess.target_dir.name,
                 "draft": _shown(sess.draft_dir), "dtype": cfg.dtype, "forward": sess.forward, "cpu": describe_cpu(),
                 "dtype_source": dtype_source,
                 "device": cfg.device, "threads": torch.get_num_threads(), "prompts_per_set": cfg.prompts_per_set,
                 "max_new_tokens": cfg.max_new_tokens, "repeats": cfg.repeats, "decider": _decider_name(cfg),
                 "ci": {"level": 0.95, "method": "percentile bootstrap over prompts, paired by repeat",
                        "resamples": cfg.bootstrap_resamples, "seed": cfg.seed},
                 "versions": {"torch": torch.__version__, "python": platform.python_version(),
                              "transformers": __import__("transformers").__version__},
                 "config": as_dict(cfg)},
        "conditions": conditions, "oracle": bound, "sweep": sweep}
    curve = getattr(sess, "_measured_cost", None)  # what the grow_cost: measure rows were priced by
    if curve is not None:
        results["meta"]["grow_cost_measured"] = {"sizes": curve.sizes, "target_ms": curve.target_ms,
                                                 "draft_ms": curve.draft_ms, "unit": curve.unit}
    add_bound_rows(results, cfg)
    results["goals"] = compute_goals(results, cfg)
    results["drafts"] = compare_drafts(results, cfg)
    results["meta"]["wall_s"] = time.perf_counter() - t0
    return results


def write_report(results: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    files = plots(results, out)
    results["meta"]["files"] = ["results.json", "results.md", *files]
    md = markdown(results)
    write_json(out / "results.json", results)
    write_atomic(out / "results.md", md)
    return md


def _shown(path) -> str | None:
    """A path as a report shows it: relative to the working directory when inside it (no
    machine-specific absolute paths in committed reports)."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
