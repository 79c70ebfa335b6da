"""Typed configuration of the comparison benchmark (`configs/bench.yaml`)."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

from decoding.decider.policy import RULES
from decoding.stopping import CONFIDENCE_RULES
from decoding.options import StrategyOptions
from decoding.strategies import StrategyConfig
from decoding.tree import layout_from_k_config

PEERS = ("hf-assisted", "hf-prompt-lookup")
"""Hugging Face `generate` peers; every other strategy name runs on our engine."""


@dataclass
class StrategySpec(StrategyOptions):
    """One row of the table: our engine with StrategyOptions, or a Hugging Face peer
    (`strategy` hf-assisted | hf-prompt-lookup)."""

    name: str = ""
    """Row label (default: the strategy)."""
    confidence_threshold: float | str = 0.4
    """A draft-probability threshold, or `tuned`: the one the decider's fit chose for this
    confidence_rule on its validation replay (the same procedure as the decider's own)."""
    decider_rule: str | None = None
    """Decider stop rule (paper | specdecpp | tree | grow); null = the checkpoint's."""
    decider_threshold: float | None = None
    """Decider threshold; null = the one validated for `decider_rule` at fit time."""
    prompt_lookup_num_tokens: int = 10
    """hf-prompt-lookup: n-gram continuation length (draft-free)."""
    draft: str | None = None
    """This row's draft dir (checked against the target); null = the config's. Rows with
    different drafts share one interleaved run: how two drafts are compared."""
    decider: str | None = None
    """This row's decider (dir or 'latest'; its pair must be this row's); null = the config's."""

    def __post_init__(self):
        self.name = self.name or self.strategy

    @property
    def peer(self) -> bool:
        return self.strategy in PEERS

    @property
    def grows(self) -> bool:
        """A cost-aware growth row (decoding.growth): its tree is sized per round."""
        return (self.stop == "decider" and self.decider_rule == "grow") or \
            (self.stop == "confidence" and self.confidence_rule == "grow")

    @property
    def tuned(self) -> bool:
        """A confidence row whose threshold comes from the decider checkpoint."""
        return self.stop == "confidence" and self.confidence_threshold == "tuned"

    def engine_config(self, tuned_threshold: float | None = None) -> StrategyConfig:
        """tuned_threshold: the resolved threshold of a `tuned` row (required for one)."""
        t = self.confidence_threshold
        if self.tuned:
            if tuned_threshold is None:
                raise ValueError(f"strategy {self.name}: the tuned confidence threshold was not resolved")
            t = tuned_threshold
        return StrategyConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(StrategyOptions)}
                              | {"confidence_threshold": t})

    def shape_config(self) -> StrategyConfig:
        """The engine config for its tree shape (a tuned threshold does not change the shape)."""
        return self.engine_config(0.0 if self.tuned else None)

    @property
    def tree_nodes(self) -> int | None:
        """Largest tree a round verifies (None for peers)."""
        if self.peer:
            return None
        if self.grows:
            return self.max_nodes
        levels = self.shape_config().k_levels
        return layout_from_k_config(levels).size if levels else 0

    def validate(self) -> None:
        t = self.confidence_threshold
        if not (t == "tuned" or (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t <= 1)):
            raise ValueError(f"strategy {self.name}: confidence_threshold must be in [0, 1] or 'tuned' (got {t!r})")
        if t == "tuned" and self.stop != "confidence":
            raise ValueError(f"strategy {self.name}: confidence_threshold 'tuned' belongs to stop: confidence")
        if not self.peer:
            self.shape_config()  # raises ValueError on a bad strategy / mode / k-config
        if self.decider_rule not in (None, *RULES):
            raise ValueError(f"strategy {self.name}: decider_rule must be one of {', '.join(RULES)}")
        if self.confidence_rule not in CONFIDENCE_RULES:
            raise ValueError(f"strategy {self.name}: confidence_rule must be one of {', '.join(CONFIDENCE_RULES)}")
        if self.prompt_lookup_num_tokens < 1:
            raise ValueError(f"strategy {self.name}: prompt_lookup_num_tokens must be >= 1")


@dataclass
class SweepConfig:
    """Tokens/s vs tree size: a few tree shapes on a few prompts (greedy)."""

    enabled: bool = True
    prompt_set: str = "general"
    prompts: int = 2
    max_new_tokens: int = 48
    repeats: int = 1
    ti_mcsd: list[list[int]] = field(default_factory=lambda: [[2, 4], [4, 4], [4, 6], [8, 6], [4, 8]])
    """[width, depth] fork trees (fixed depth)."""
    mcsd: list[str] = field(default_factory=lambda: ["2,2,1", "4,2,1", "4,2,2,1", "8,2,2,1"])
    """k-configs."""


@dataclass
class OracleConfig:
    """The oracle-stop upper bound, replayed from recorded traces (a BOUND, not a measurement)."""

    enabled: bool = True
    traces: str | None = None
    """Trace dir (training.decider.collect) holding the replayed bound, oracle.json, that
    `python -m training.decider.oracle --traces DIR` writes; null = the replay stored in the
    decider's metrics.json."""
    cost_model: str = "measure"
    """With `traces`: the --cost-model the bench names when DIR/oracle.json is missing:
    measure (time the pair, ~30 s) | decider (the cost model saved with the decider) | a
    CostModel JSON file. The report shows the cost model the replay used."""


@dataclass
class GoalsConfig:
    """Targets the greedy lossless rows are read against."""

    vs_ar: float = 2.0
    dynamic_vs_mcsd: float = 1.25
    mcsd_reference: str = "4,2,2,1"
    """k-config of the fixed-depth mcsd row the dynamic strategies are compared with."""
    vs_hf_assisted: float = 1.3
    dynamic_vs_best_fixed: float = 1.1
    """Best stop policy over the fastest fixed-shape row of our engine."""
    learned_vs_best_fixed: float | None = None
    """Best decider row over the fastest fixed shape; null = not checked."""
    learned_vs_confidence: float | None = None
    """Best decider row over the best draft-confidence row, each at its tuned setting."""


@dataclass
class BenchConfig:
    target: str | None = None
    """Target model dir; null = the embedded SmolLM2-135M-Instruct."""
    draft: str | None = None
    """Draft model dir; null = the shipped default draft."""
    dtype: str = "auto"
    """float32 | bfloat16 | auto (bf16 only where the device computes it natively)."""
    device: str = "cpu"
    threads: int | None = 2
    """torch threads; null = torch's default."""
    seed: int = 0
    """Prompt i is generated with seed + i (same for every strategy and repeat)."""
    prompt_sets: dict[str, str] = field(default_factory=lambda: {
        "general": "data/prompts/heldout_general.jsonl", "code": "data/prompts/heldout_code.jsonl"})
    prompts_per_set: int = 6
    """The first N prompts of each set: the unit the speedup's confidence interval resamples."""
    chat: bool = True
    """Apply the tokenizer's chat template to each prompt."""
    max_new_tokens: int = 64
    repeats: int = 3
    """Interleaved passes over all rows; the speedup is the median over them."""
    bootstrap_resamples: int = 2000
    """Resamples of the prompts for each speedup's 95% confidence interval (seeded by `seed`)."""
    warmup_tokens: int = 8
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    top_p: float = 1.0
    stop_at_eos: bool = True
    decider: str | None = "latest"
    """Decider checkpoint dir or 'latest': the decider rows' model and thresholds, and the
    `tuned` confidence thresholds. null only without such rows (a config error otherwise)."""
    strategies: list[StrategySpec] = field(default_factory=list)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    oracle: OracleConfig = field(default_factory=OracleConfig)
    goals: GoalsConfig = field(default_factory=GoalsConfig)
    out: str = "reports/bench-{date}"
    """Output dir; {date} = today (YYYY-MM-DD)."""

    def validate(self) -> None:
        for k in ("prompts_per_set", "max_new_tokens", "repeats", "bootstrap_resamples"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1")
        if not self.strategies or self.strategies[0].strategy != "ar":
            raise ValueError("strategies must start with ar (the 1.0x reference)")
        names = [s.name for s in self.strategies]
        if len(set(names)) != len(names):
            raise ValueError("strategy names must be unique")
        for s in self.strategies:
            s.validate()
        needs = [s.name for s in self.strategies if s.decider is None
                 and (s.stop == "decider" or s.tuned or (s.grows and s.grow_cost == "decider"))]
        if needs and self.decider is None:
            raise ValueError(f"decider is null but row(s) {', '.join(needs)} need a decider checkpoint "
                             "(set decider: latest or a dir, or remove the rows)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16 (got {self.dtype!r})")
        if any(t < 0 for t in self.temperatures) or not self.temperatures:
            raise ValueError("temperatures must be a non-empty list of values >= 0")
        if self.sweep.enabled and self.sweep.prompt_set not in self.prompt_sets:
            raise ValueError(f"sweep.prompt_set {self.sweep.prompt_set!r} is not in prompt_sets")
        for w_d in self.sweep.ti_mcsd:
            if len(w_d) != 2:
                raise ValueError(f"sweep.ti_mcsd entries are [width, depth] (got {w_d})")


def _build(cls, data, where: str):
    """Dataclass from a dict, recursively; unknown keys are an error (typos must not pass)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping")  # noqa: TRY004  (a config error)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{where or 'config'}: unknown key(s) {', '.join(sorted(unknown))}")
    kw = {}
    for k, v in data.items():
        hint = hints[k]
        if dataclasses.is_dataclass(hint):
            v = _build(hint, v or {}, f"{where}{k}.")
        elif k == "strategies":
            if not isinstance(v, list):
                raise ValueError("strategies: expected a list")
            v = [_build(StrategySpec, s, f"strategies[{i}].") for i, s in enumerate(v)]
        kw[k] = v
    try:
        return cls(**kw)
    except TypeError as e:
        raise ValueError(f"{where or 'config'}: {e}") from None


def load_config(path: str | Path | None) -> BenchConfig:
    if path is None:
        cfg = BenchConfig(strategies=default_strategies())
    else:
        import yaml

        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
        cfg = _build(BenchConfig, data, "")
        if not cfg.strategies:
            cfg.strategies = default_strategies()
    cfg.validate()
    return cfg


def default_strategies() -> list[StrategySpec]:
    S = StrategySpec
    return [S("ar"), S("hf-assisted"), S("hf-prompt-lookup"),
            S("sd", gamma=4), S("mcsd", k_config="4,2,2,1"),
            S("ti-mcsd", width=4, depth=6),
            S("ti-mcsd", name="ti-mcsd+confidence (HF default 0.4)", width=4, depth=8, stop="confidence",
              confidence_threshold=0.4),
            S("ti-mcsd", name="ti-mcsd+confidence (tuned)", width=4, depth=8, stop="confidence",
              confidence_threshold="tuned"),
            S("ti-mcsd", name="ti-mcsd+decider(paper)", width=4, depth=8, stop="decider", decider_rule="paper"),
            S("ti-mcsd", name="ti-mcsd+decider(specdecpp)", width=4, depth=8, stop="decider", decider_rule="specdecpp"),
            S("ti-mcsd", name="ti-mcsd+confidence(tree, tuned)", width=4, depth=8, stop="confidence",
              confidence_rule="tree", confidence_threshold="tuned"),
            S("ti-mcsd", name="ti-mcsd+decider(tree)", width=4, depth=8, stop="decider", decider_rule="tree"),
            S("ti-mcsd", name="ti-mcsd longest-branch (LOSSY)", width=4, depth=6, mode="longest-branch")]


def as_dict(cfg: BenchConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def load_prompts(path: str, n: int) -> list[dict]:
    """The first n rows of a prompt JSONL file ({"id", "kind", "prompt"})."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompt file not found: {p}")
    rows = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip() and len(rows) < n:
            try:
                row = json.loads(line)
                rows.append({"id": str(row["id"]), "prompt": row["prompt"]})
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{p}:{i}: not a prompt row ({e!r})") from None
    if not rows:
        raise ValueError(f"{p}: no prompts")
    return rows


def whole_window_catch_up(decoder) -> None:
    """`decoder`'s greedy engine builds a new prompt's head from the whole window
    (FeatureCache.catch_up None): the context gate as it ran before the request gate, whose rows
    the context and llama suites keep beside the default."""
    from decoding.sampling import SamplingConfig

    decoder.engine(SamplingConfig()).proposer.model.catch_up = None
