"""The default decoding configuration: the measured-best lossless one for the shipped pair.

`decoding/defaults.yaml` holds one entry per device kind (`cpu`: float32; `cpu-bf16`: AMX, or
AVX512-BF16 with the packed forward; `cuda`) plus `other-pairs` for any pair but the shipped one (the benchmark
measured only the shipped pair, so another pair gets the plain historical default). Each entry
names the report it came from. The maintainer's `make defaults REPORT=DIR` rewrites one entry
from a kept report (decoding.bench.pick_defaults); a benchmark run never does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from decoding.forward import cpu
from decoding.options import (  # noqa: F401 (DEFAULT_TARGET re-exported)
    DEFAULT_TARGET, SamplingConfig, StrategyConfig, StrategyOptions, check_threshold,
)

DEFAULT_DRAFT = Path(__file__).resolve().parent.parent / "checkpoints" / "drafts" / "smollm2-135m-eagle3"
"""The shipped feature (EAGLE-3) head, used when no draft is named and the target is the embedded
one: on held-out prompts it is the faster of the two shipped drafts (reports/drafts-bench-2026-11-25).
The stand-alone draft, checkpoints/drafts/smollm2-135m-draft, serves HF's assisted generation."""
DEFAULTS_PATH = Path(__file__).with_name("defaults.yaml")
KINDS = ("cpu", "cpu-bf16", "cuda")
OTHER = "other-pairs"
INFO_KEYS = ("source", "measured")
"""Keys of an entry that document it and configure nothing."""



@dataclass
class Defaults(StrategyOptions):
    """One entry: the options a user does not set come from here (an entry's missing keys take
    StrategyOptions' values; a file without the device's entry gives plain `ar`)."""

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


FIELDS = {f.name for f in fields(Defaults)}


def resolve_dtype(dtype: str, device: str) -> tuple[str, str]:
    """`auto`: bfloat16 on CUDA, a CPU with AMX, or one with AVX512-BF16 and the packed forward, else float32 (decoding.forward.cpu.prefers_bf16 says why),
    so a benchmark measures the strategies in the dtype a user would pick, not a slow one."""
    if dtype != "auto":
        return dtype, "config"
    if device.startswith("cuda"):
        return "bfloat16", "auto: cuda"
    if cpu.prefers_bf16():
        return "bfloat16", "auto: the CPU has AMX-BF16, or AVX512-BF16 with the packed forward"
    return "float32", "auto: the CPU has neither AMX nor AVX512-BF16 with the packed forward"


def device_kind(device: str = "cpu") -> str:
    if str(device).startswith("cuda"):
        return "cuda"
    return "cpu-bf16" if cpu.prefers_bf16() else "cpu"


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
        bad = set(entry) - FIELDS
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
_STRATEGY_KEYS = tuple(f.name for f in fields(StrategyOptions))


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
    return StrategyConfig(**{**base, **given})


def strategy_options(args) -> dict:
    """The StrategyOptions parsed flags set (None: unset), by field name (generate and serve)."""
    opts = {f.name: getattr(args, f.name) for f in fields(StrategyOptions) if f.name != "strategy"}
    return opts | {"replacement": args.replacement or None}  # a store_true flag: unset is None


def check_options(args) -> None:
    """Every option value of parsed flags, checked before torch and transformers are imported
    (those take seconds; a typo should not)."""
    SamplingConfig(args.temperature, args.top_p)
    if args.decider_threshold is not None:
        check_threshold("--decider-threshold", args.decider_threshold)
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    d = defaults_for(args.device, is_shipped_pair(args.target, args.draft))
    strategy_config(d, args.strategy, strategy_options(args))
