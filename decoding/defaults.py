"""The default decoding configuration: the measured-best lossless one for the shipped pair.

`decoding/defaults.yaml` holds one entry per device kind (`cpu`: float32; `cpu-bf16`: AMX, or
AVX512-BF16 with the packed forward; `cuda`) plus `other-pairs` for any pair but the shipped one (the benchmark
measured only the shipped pair, so another pair gets the plain historical default). Each entry
names the report it came from. `python -m decoding.bench --write-defaults` rewrites this
machine's entry from the run it just measured, through `pick_best` and `write_defaults`.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path

import yaml

from decoding.options import GROW, StrategyConfig

DEFAULT_TARGET = "smollm2"
"""Name of the embedded target (SmolLM2-135M-Instruct, converted once by decoding.models)."""
DEFAULT_DRAFT = Path(__file__).resolve().parent.parent / "checkpoints" / "drafts" / "smollm2-135m-eagle3"
"""The shipped feature (EAGLE-3) head, used when no draft is named and the target is the embedded
one: on held-out prompts it is the faster of the two shipped drafts (reports/drafts-bench-2026-11-25).
The stand-alone draft, checkpoints/drafts/smollm2-135m-draft, serves HF's assisted generation."""
DEFAULTS_PATH = Path(__file__).with_name("defaults.yaml")
KINDS = ("cpu", "cpu-bf16", "cuda")
OTHER = "other-pairs"
INFO_KEYS = ("source", "measured")
"""Keys of an entry that document it and configure nothing."""

HEADER = """\
# Default decoding configuration of `python -m decoding.generate` and `decoding.Decoder`, per
# device kind, for the shipped pair (SmolLM2-135M-Instruct + checkpoints/drafts/smollm2-135m-eagle3).
# cpu: float32 CPUs | cpu-bf16: AMX, or AVX512-BF16 with the packed forward (bfloat16) | cuda | other-pairs: any other
# pair (not measured: the plain historical default). Rewritten by
#   python -m decoding.bench --config configs/bench_feature.yaml --write-defaults
# which keeps the fastest lossless greedy row of that run (decoding/defaults.py: pick_best).
"""


@dataclass
class Defaults:
    """One entry: the options a user does not set come from here."""

    strategy: str = "ti-mcsd"
    """ar | sd | mcsd | ti-mcsd."""
    gamma: int = 4
    """sd chain length."""
    k_config: str = "4,2,2,1"
    """mcsd children per level."""
    width: int = 4
    """ti-mcsd branches."""
    depth: int = 6
    """ti-mcsd maximum depth."""
    stop: str = "fixed"
    """fixed | confidence | decider."""
    confidence_threshold: float = 0.4
    confidence_rule: str = "level"
    """level | tree | grow (the cost-aware tree of decoding.growth, no threshold)."""
    max_nodes: int = 64
    """grow rules: cap on the draft tree's nodes."""
    grow_cost: str = "decider"
    """grow rules: decider (the cost curve the decider's fit timed, stored with it) or measure
    (time this machine's forwards at start, ~10-30 s)."""
    decider_rule: str | None = None
    """Decider stop rule (None: the checkpoint's); its threshold is the one validated for it."""
    dtype: str = "float32"
    source: str = ""
    """Which report (or reasoning) the entry comes from."""
    measured: dict | None = None
    """Speedup over ar per greedy condition of that report (information only)."""

    def describe(self) -> str:
        shape = {"ar": "", "sd": f" g{self.gamma}", "mcsd": f" [{self.k_config}]",
                 "ti-mcsd": f" W{self.width} D{self.depth}"}.get(self.strategy, "")
        stop = self.stop + (f"({self.decider_rule})" if self.stop == "decider" and self.decider_rule else "")
        grows = self.confidence_rule == "grow" if self.stop == "confidence" else self.decider_rule == "grow"
        if self.stop == "confidence":
            stop += "(grow: q)" if grows else f"({self.confidence_rule} >= {self.confidence_threshold:g})"
        if grows:
            stop += f", <= {self.max_nodes} nodes, cost curve: {self.grow_cost}"
        return f"{self.strategy}{shape}, stop {stop}, {self.dtype}"


_FIELDS = {f.name for f in fields(Defaults)}


def cpu_prefers_bf16(cpuinfo: str | None = None, packed: bool | None = None) -> bool:
    """AMX-BF16 in the CPU flags (Linux), or AVX512-BF16 where the packed forward runs
    (decoding.forward.packed; `packed` None: unless $SPECSTOP_FORWARD is eager). On a 2-core
    AVX512-BF16 EPYC without AMX (torch 2.13, shared machine, interleaved, issue 34): the eager
    bf16 forward is no faster than fp32 at 1 token (float32 decoded 1.175x faster,
    reports/dtype-2026-11-26), while the packed bf16 forward costs 0.5-0.84x the fp32 eager one
    at 1-16 tokens (reports/forward-2026-11-26) and decodes 1.2-1.4x faster. On a 2-core AMX
    Xeon (quiet, 1 thread): bf16 eager 1.02x fp32 at 1 token, bf16 packed 0.79x, and 0.43-0.54x at
    4-16 tokens (reports/forward-2026-11-26-amx). Without either flag, bf16 matmuls are emulated
    and slower."""
    if cpuinfo is None:
        return _cpuinfo_prefers_bf16(_packed_forward() if packed is None else packed)
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    if packed is None:
        packed = _packed_forward()
    return "amx_bf16" in flags or ("avx512_bf16" in flags and packed)


def _packed_forward() -> bool:
    """Whether the packed forward is the default here (torch-free: the CLI checks options
    before importing torch; decoding.forward.packed falls back to eager where oneDNN lacks it)."""
    return os.environ.get("SPECSTOP_FORWARD", "").strip() != "eager"


@lru_cache(maxsize=2)
def _cpuinfo_prefers_bf16(packed: bool) -> bool:
    try:
        return cpu_prefers_bf16(Path("/proc/cpuinfo").read_text(), packed)
    except OSError:
        return False


def resolve_dtype(dtype: str, device: str) -> tuple[str, str]:
    """`auto`: bfloat16 on CUDA, a CPU with AMX, or one with AVX512-BF16 and the packed forward, else float32 (cpu_prefers_bf16 says why),
    so a benchmark measures the strategies in the dtype a user would pick, not a slow one."""
    if dtype != "auto":
        return dtype, "config"
    if device.startswith("cuda"):
        return "bfloat16", "auto: cuda"
    if cpu_prefers_bf16():
        return "bfloat16", "auto: the CPU has AMX-BF16, or AVX512-BF16 with the packed forward"
    return "float32", "auto: the CPU has neither AMX nor AVX512-BF16 with the packed forward"


def device_kind(device: str = "cpu") -> str:
    if str(device).startswith("cuda"):
        return "cuda"
    return "cpu-bf16" if cpu_prefers_bf16() else "cpu"


def run_kind(device: str, dtype: str) -> str:
    """The entry a bench run's pick belongs to: on a CPU its dtype decides, not the CPU (an fp32
    run on an AMX CPU measures the `cpu` entry; writing it into the bf16 entry this CPU loads
    would switch that entry to fp32)."""
    if str(device).startswith("cuda"):
        return "cuda"
    return "cpu-bf16" if dtype == "bfloat16" else "cpu"


def load_defaults(path: str | os.PathLike | None = None) -> dict[str, dict]:
    """The raw entries, checked: unknown keys are an error naming the file."""
    p = Path(path or DEFAULTS_PATH)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read the defaults file {p}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"defaults file {p}: expected a mapping of device kind -> options")
    for kind, entry in data.items():
        bad = set(entry) - _FIELDS
        if bad:
            raise ValueError(f"defaults file {p}: entry {kind} has unknown keys {', '.join(sorted(bad))}")
    return data


def defaults_for(device: str = "cpu", shipped: bool = True, path=None) -> Defaults:
    """The entry for this device kind (shipped pair) or `other-pairs`; built-in values when absent."""
    data = load_defaults(path)
    kind = device_kind(device) if shipped else OTHER
    entry = data.get(kind)
    if entry is None and kind == "cpu-bf16":
        entry = data.get("cpu")
    return Defaults(**(entry or {"source": "built-in (no entry in the defaults file)"}))


def is_shipped_pair(target, draft) -> bool:
    """The pair the defaults were measured on: the embedded target with the shipped draft."""
    if target not in (None, DEFAULT_TARGET):
        return False
    return draft is None or (isinstance(draft, (str, Path)) and Path(draft).resolve() == DEFAULT_DRAFT.resolve())


SHAPE_KEYS = ("gamma", "k_config", "width", "depth")
"""Options that name a strategy's shape: setting one (or the strategy) opts out of the entry."""
_STRATEGY_KEYS = (*SHAPE_KEYS, "stop", "confidence_threshold", "confidence_rule", "max_nodes", "grow_cost")


def names_strategy(strategy: str | None, options: dict) -> bool:
    """Whether the user named a strategy or a shape: then the entry fills nothing of the
    strategy (its stop rule included), so `--strategy sd --gamma 3` is sd g3 at fixed depth."""
    return strategy is not None or any(options.get(k) is not None for k in SHAPE_KEYS)


def strategy_config(d: Defaults, strategy: str | None, options: dict) -> StrategyConfig:
    """The StrategyConfig of the given options (None = unset) over the entry's, when the user
    named neither a strategy nor a shape; over the strategy's own built-in values (fixed depth
    unless `stop` is given) when they did. Raises ValueError on a bad value. Torch-free, so a
    CLI checks its options before heavy imports."""
    given = {k: v for k, v in options.items() if v is not None}
    if names_strategy(strategy, options):
        return StrategyConfig(strategy=strategy or d.strategy, **given)
    base = {k: getattr(d, k) for k in _STRATEGY_KEYS}
    return StrategyConfig(strategy=d.strategy, **{**base, **given})


def _spec_entry(spec: dict, row: dict) -> dict | None:
    """The options that reproduce a bench row; None when they cannot be recovered. (A grow row
    timed with `measure` keeps it: outside benchmarks the timed curve is stored per machine,
    pair, dtype and thread count by decoding.forward.cost_cache, so only the first load pays.)"""
    spec = {**asdict(Defaults()), "rule": None, **spec}  # older reports omit defaulted keys
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
        e["decider_rule"] = setting.get("rule") or spec.get("rule")
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
    bad = set(entry) - _FIELDS
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
