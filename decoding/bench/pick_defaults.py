"""Pick the defaults entry from a benchmark run (the fastest lossless greedy row that beats `ar`)
and write it into a defaults file.

The package's own decoding/defaults.yaml is rewritten only by the maintainer's step

    make defaults REPORT=reports/DIR      # = python -m decoding.bench.pick_defaults reports/DIR

from a kept report of the shipped pair (a compare run's results.json, or the GPU suite's, whose
pick is its `cuda_defaults`): what every install loads changes by a reviewed commit that cites its
evidence, never as a side effect of a benchmark run. A run's `--write-defaults` writes its pick
into the report's own folder (DIR/defaults.yaml) or a PATH, for a look before that step.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import yaml

from decoding.defaults import FIELDS, DEFAULTS_PATH, KINDS, OTHER, Defaults, load_defaults
from decoding.options import GROW

HEADER = """\
# Default decoding configuration of `python -m decoding.generate` and `decoding.Decoder`, per
# device kind, for the shipped pair (SmolLM2-135M-Instruct + checkpoints/drafts/smollm2-135m-eagle3).
# cpu: float32 CPUs | cpu-bf16: AMX, or AVX512-BF16 with the packed forward (bfloat16) | cuda | other-pairs: any other
# pair (not measured: the plain historical default). Rewritten, one kind at a time, by
#   make defaults REPORT=reports/DIR      (python -m decoding.bench.pick_defaults reports/DIR)
# which keeps the fastest lossless greedy row of that report (decoding/bench/pick_defaults.py: pick_best).
"""


def _spec_entry(spec: dict, row: dict) -> dict | None:
    """The options that reproduce a bench row; None when they cannot be recovered. (A grow row
    timed with `measure` keeps it: outside benchmarks the timed curve is stored per machine,
    pair, dtype and thread count by decoding.forward.cost_cache, so only the first load pays.)"""
    spec = {**asdict(Defaults()), **spec}  # older reports omit defaulted keys
    spec["decider_rule"] = spec["decider_rule"] or spec.get("rule")  # reports before 2026-11-27 say `rule`
    e = {"strategy": spec["strategy"]}
    e.update({"sd": {"gamma": spec["gamma"]}, "mcsd": {"k_config": spec["k_config"]},
              "ti-mcsd": {"width": spec["width"], "depth": spec["depth"]}}.get(spec["strategy"], {}))
    if spec["strategy"] == "ar":
        return e
    e["stop"] = spec["stop"]
    setting = row.get("stop_setting") or {}
    if spec["stop"] == "confidence":
        t = setting.get("threshold", spec["confidence_threshold"])
        if not isinstance(t, (int, float)):
            return None  # a `tuned` row of a report that did not record the resolved threshold
        e.update(confidence_threshold=float(t), confidence_rule=spec["confidence_rule"])
    elif spec["stop"] == "decider":
        e["decider_rule"] = setting.get("rule") or spec["decider_rule"]
    if GROW in (e.get("confidence_rule"), e.get("decider_rule")):
        e.pop("confidence_threshold", None)  # the grow rule has no threshold
        e.update(max_nodes=spec["max_nodes"], grow_cost=spec["grow_cost"])
    return e


def pick_best(results: dict, source: str | None = None) -> dict:
    """The fastest lossless greedy row of a bench results.json, as a defaults entry.

    A candidate is one of our engine's lossless rows that ran in every greedy condition and
    beat ar in each: the lower end of its 95% CI above 1.0 where the report has CIs (else its
    median), and no output that differs from ar other than by a near-tie flip (reports
    without tie detection: equal to ar on every prompt in float32; bf16 is not asked). The fastest is the highest geometric mean of the median
    speedups over the greedy conditions. With no candidate the default is plain `ar`.
    """
    meta = results.get("meta", {})
    specs = {s["name"]: s for s in meta.get("config", {}).get("strategies", [])}
    greedy = [c for c in results.get("conditions", []) if c.get("temperature") == 0]
    if not greedy:
        raise ValueError("the results have no greedy condition to pick defaults from")
    best, best_score = None, 0.0
    for name, spec in specs.items():
        if spec["strategy"] in ("ar", "hf-assisted", "hf-prompt-lookup") or spec.get("mode", "lossless") != "lossless":
            continue
        rows = [next((r for r in c["rows"] if r["name"] == name), None) for c in greedy]
        if any(not _beats_ar(r, meta.get("dtype")) for r in rows):
            continue
        score = math.exp(sum(math.log(r["speedup"]["median"]) for r in rows) / len(rows))
        entry = _spec_entry(spec, rows[0])
        if entry is not None and score > best_score:
            entry["measured"] = {c["name"]: round(r["speedup"]["median"], 3) for c, r in zip(greedy, rows)}
            best, best_score = entry, score
    best = best or {"strategy": "ar"}
    best["dtype"] = meta.get("dtype", "float32")
    where = ", ".join(str(x) for x in (meta.get("cpu"), meta.get("forward") and f"{meta['forward']} forward") if x)
    best["source"] = (f"{source or meta.get('command', 'a bench run')} ({meta.get('date', '?')}, "
                      f"{meta.get('threads', '?')} threads{', ' + where if where else ''}): fastest lossless greedy row")
    return best


def _beats_ar(row: dict | None, dtype: str | None) -> bool:
    if row is None or row.get("status") != "ok" or not row.get("lossless") or not row.get("speedup"):
        return False
    sp = row["speedup"]
    if not (sp.get("ci95") or [sp["median"]])[0] > 1.0:
        return False
    eq = row.get("equal_to_ar")
    if eq is not None and "mismatch" in eq:  # reports that tell near-tie flips from mismatches
        return not eq["mismatch"]
    return dtype != "float32" or eq is None or eq["equal"] == eq["n"]


def render(data: dict[str, dict]) -> str:
    parts = [HEADER]
    for kind in (*KINDS, OTHER, *sorted(set(data) - {*KINDS, OTHER})):
        if kind in data:
            parts.append(f"\n# {kind}: {data[kind].get('source', '')}\n")
            parts.append(yaml.safe_dump({kind: data[kind]}, sort_keys=False, width=1000))
    return "".join(parts)


def write_defaults(entry: dict, kind: str, path: str | os.PathLike | None = None) -> Path:
    """Replace one kind's entry (the others are kept); atomic: temp file + rename."""
    bad = set(entry) - FIELDS
    if bad:
        raise ValueError(f"not default options: {', '.join(sorted(bad))}")
    p = Path(path or DEFAULTS_PATH)
    data = load_defaults(p) if p.exists() else {}
    data[kind] = dict(entry)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(render(data))
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def package_entry(report: str | os.PathLike) -> tuple[str, dict]:
    """(kind, entry) a kept report gives the package's file: a GPU suite run's `cuda_defaults`,
    else pick_best of a compare run; refused unless the report measured the shipped pair."""
    from decoding.defaults import is_shipped_pair, run_kind

    p = Path(report)
    p = p / "results.json" if p.is_dir() else p
    results = json.loads(p.read_text())
    meta, cfg = results.get("meta", {}), results.get("meta", {}).get("config", {})
    try:
        shown = str(p.resolve().relative_to(Path.cwd().resolve()))  # no machine's absolute path in the file
    except ValueError:
        shown = str(p)
    if "cuda_defaults" in results:  # decoding.bench.gpu_suite: picked there, among its own rows
        if cfg.get("head") is not None:
            raise ValueError(f"{shown}: the GPU run measured the head {cfg['head']}, not the shipped one")
        entry = results["cuda_defaults"]
        return "cuda", dict(entry, source=f"{shown}: {entry.get('source', 'the GPU suite')}")
    if not is_shipped_pair(cfg.get("target"), cfg.get("draft")):
        raise ValueError(f"{shown}: the defaults are for the shipped pair, and this run measured another one")
    entry = pick_best(results, source=shown)
    return run_kind(meta.get("device", "cpu"), entry["dtype"]), entry


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__, file=sys.stdout if argv in (["-h"], ["--help"]) else sys.stderr)
        return 0 if argv in (["-h"], ["--help"]) else 2
    try:
        kind, entry = package_entry(argv[0])
        written = write_defaults(entry, kind)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"{kind} in {written}: {entry['strategy']} ({entry['source']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
