"""Choose a decider's stop rule and threshold by replaying VAL traces under a cost model,
then report every policy on the TEST prompts (fixed depths, confidence, oracle, deciders).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from decoding.decider.policy import THRESHOLD_RULES as RULES  # grow has no threshold to choose
from decoding.decider.policy import uses_hidden

from training.decider.datamodule import Split
from training.decider.grow_replay import grow_policy
from training.decider.replay import (
    Q_TOKEN,
    CostModel,
    ReplaySet,
    baseline_table,
    calibrate,
    confidence_policy,
    confidence_tree_policy,
    decider_policy,
    oracle_share,
    replay,
    sweep,
)


def _grid() -> list[float]:
    return [round(float(t), 3) for t in np.linspace(0.05, 0.95, 37)]


@dataclass
class ReplayConfig:
    """How the threshold is chosen: replayed tokens/s on the validation prompts."""

    cost_model: str = "measure"
    """measure: time the target/draft on this machine (replay.calibrate); default: a fixed
    illustrative cost model (tests, quick runs); or a path to a CostModel JSON file."""
    target: str | None = None
    """Target model dir for `measure` (None = the default target); must match the traces."""
    draft: str | None = None
    """Draft model dir for `measure` (None = the shipped default draft)."""
    dtype: str = "auto"
    """Dtype of the timed models (auto: bfloat16 only where the CPU or GPU computes it natively)."""
    rule: str = "auto"
    """auto: the rule (paper, specdecpp or tree) with the best val tokens/s; or force one."""
    grid: list[float] = field(default_factory=_grid)
    """Thresholds tried for each rule."""
    decider_ms: float | None = None
    """Decider cost per drafted level (features + net) charged in replay; None = measure it."""
    baselines: bool = True
    """Also replay the scikit-learn baselines as deciders (same rules, val-chosen thresholds)."""

    def __post_init__(self):
        if self.rule not in ("auto", *RULES):
            raise ValueError(f"replay.rule must be auto or one of {', '.join(RULES)} (got {self.rule!r})")
        if not self.grid or not all(0.0 <= t <= 1.0 for t in self.grid):
            raise ValueError("replay.grid must be a non-empty list of thresholds in [0, 1]")


# Illustrative only (NOT measured): a 135M-class target on CPU with a ~15x cheaper draft and
# a 32-node tree verified at ~1.4x a one-token step (the project's first bf16 trial on a CPU;
# the measured cost model in a decider checkpoint puts it at 2-3x here, see the README's
# benchmark section). For tests and quick runs only; results use `measure`.
DEFAULT_COST = CostModel(sizes=[1, 2, 4, 8, 16, 32, 64], target_ms=[25.0, 25.5, 26.0, 27.0, 29.5, 34.0, 42.0],
                         draft_ms=[1.7, 1.75, 1.8, 1.9, 2.1, 2.5, 3.3], overhead_ms=0.5, unit="tokens",
                         source={k: "illustrative constant (training.decider.threshold.DEFAULT_COST), not measured"
                                 for k in ("target_ms", "draft_ms", "overhead_ms", "policy_ms")})


def load_cost(cfg: ReplayConfig, model_pair: dict, collect: dict | None = None) -> CostModel:
    """The replay's cost model; `collect` (the traces' collect block) picks the tree whose
    bookkeeping `measure` times."""
    if cfg.cost_model == "default":
        return DEFAULT_COST
    if cfg.cost_model == "measure":
        from decoding.models import fingerprint, same_model
        from decoding.models.session import Session

        try:
            sess = Session.open(cfg.target, cfg.draft, cfg.dtype, need_draft=True)
        except ValueError as e:  # ModelError: say which option needs the models
            raise ValueError(f"replay.cost_model measure: {e} (set replay.target / replay.draft, "
                             f"or use a cost model JSON)") from None
        for role, model in (("target", sess.target), ("draft", sess.draft)):
            want = model_pair.get(role)
            if want and not same_model(want, fingerprint(model)):
                raise ValueError(f"replay.{role} is not the {role} the traces were recorded with "
                                 f"({want.get('name')}): the cost model must time the same pair")
        return calibrate(sess.target, sess.draft, collect=collect)
    p = Path(cfg.cost_model)
    try:
        cost = CostModel(**json.loads(p.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"replay.cost_model: cannot read a CostModel from {p} ({e})") from None
    # a file without provenance (written before CostModel.source existed) says only where it was read
    cost.source = cost.source or {"all": f"read from {p} (no recorded source)"}
    return cost


@torch.inference_mode()
def policy_ms(net, vocab: int, width: int, repeats: int = 50) -> float:
    """Median ms of one decider decision at inference: features over `width` parents'
    full-vocabulary distributions, then the net (what DeciderStop does per level)."""
    from decoding.decider import features as F
    from decoding.stopping import DraftLevel

    q = torch.softmax(torch.randn(width, vocab), -1)
    hid = net.mean.numel() - (net.num_features if net.kind == "hybrid" else 0)
    h = torch.randn(width, hid) if uses_hidden(net.kind) else None
    level = DraftLevel(depth=2, nodes=list(range(width)), tokens=[0] * width, valid=[True] * width,
                       q_token=q[:, 0], parent_q=q, parent_of=list(range(width)),
                       parent_nodes=list(range(width)), branch=[0] * width,
                       path_logq=torch.zeros(width), parent_hidden=h, position=10)
    times = []
    for _ in range(repeats + 2):
        t = time.perf_counter()
        torch.sigmoid(net(F.node_features(level), F.node_hidden(level)))
        times.append(1000 * (time.perf_counter() - t))
    return float(np.median(times[2:]))


GROW_ENVELOPES = ("tree", "chain")
"""Where the replayed grow rule may put nodes: the traces' whole tree (the engine's grow with
that k-config as its envelope), or its first chain only (grow over sd)."""


def grow_rows(rs: ReplaySet, features: np.ndarray, scores: dict[str, np.ndarray], cost: CostModel,
              dcost: CostModel, table: dict) -> dict:
    """The grow rule over q and over every scorer, in each envelope. Decisions read `cost` (the
    cost model a decider checkpoint stores, which the engine's grow reads); a scorer's rows pay
    `dcost` (its inference per level), q's pay nothing extra."""
    envelopes = {"tree": None, "chain": (1,) * rs.max_depth}
    scorers = {"q": (features[:, Q_TOKEN], cost), **{n: (s, dcost) for n, s in scores.items()}}
    out = {}
    for name, (s, pay) in scorers.items():
        for env in GROW_ENVELOPES:
            res = replay(rs, grow_policy(s, cost, level_widths=envelopes[env]), pay)
            out[f"grow-{name}-{env}"] = {**res, "oracle_share": oracle_share(res["tokens_per_s"], table)}
    return out


class Replayer:
    """One split's rounds, ready for any number of policies."""

    def __init__(self, split: Split):
        self.rs = ReplaySet(split.table)

    def best(self, scores: np.ndarray, rule: str, grid, cost: CostModel) -> dict:
        t, res = sweep(self.rs, lambda th: decider_policy(scores, th, rule), cost, grid)
        return {**res, "threshold": float(t), "rule": rule}

    def at(self, scores: np.ndarray, rule: str, threshold: float, cost: CostModel) -> dict:
        res = replay(self.rs, decider_policy(scores, threshold, rule), cost)
        return {**res, "threshold": float(threshold), "rule": rule}


def select_and_report(val: Split, test: Split, val_scores: dict[str, np.ndarray],
                      test_scores: dict[str, np.ndarray], cost: CostModel, cfg: ReplayConfig,
                      decider_ms: float) -> dict:
    """Thresholds from VAL per scorer and rule; everything reported on TEST.
    `val_scores` / `test_scores`: {scorer: probability per row of the split table}."""
    rv, rt = Replayer(val), Replayer(test)
    rules = RULES if cfg.rule == "auto" else (cfg.rule,)
    dcost = replace(cost, policy_ms=cost.policy_ms + decider_ms)  # deciders pay for inference
    table = baseline_table(rt.rs, test.features, cost)
    chosen_val, policies = {}, {}
    for name, sv in val_scores.items():
        for rule in rules:
            v = rv.best(sv, rule, cfg.grid, dcost)
            chosen_val[f"{name}-{rule}"] = v
            res = rt.at(test_scores[name], rule, v["threshold"], dcost)
            policies[f"{name}-{rule}"] = {**res, "oracle_share": oracle_share(res["tokens_per_s"], table)}
    best_key = max((k for k in chosen_val if k.startswith("decider-")),
                   key=lambda k: chosen_val[k]["tokens_per_s"])
    # the confidence baselines get the same treatment as deciders: threshold from val
    confidence = {}
    for name, fam in (("confidence", confidence_policy), ("confidence-tree", confidence_tree_policy)):
        ct, cv = sweep(rv.rs, lambda t, fam=fam: fam(val.features, t), cost, cfg.grid)
        chosen_val[name] = {**cv, "threshold": float(ct)}
        res = replay(rt.rs, fam(test.features, ct), cost)
        hindsight = table.pop(name)  # baseline_table tunes it on the test rounds themselves
        confidence[name] = {**res, "threshold": float(ct), "oracle_share": oracle_share(res["tokens_per_s"], table)}
        confidence[f"{name}-test-tuned"] = {**hindsight,
                                            "oracle_share": oracle_share(hindsight["tokens_per_s"], table)}
    grow = grow_rows(rt.rs, test.features, test_scores, cost, dcost, table)
    base = table[table["best_fixed"]]["tokens_per_s"]
    return {
        "val": chosen_val,
        "test": {**table, **confidence, **policies, **grow},
        "chosen": {"rule": chosen_val[best_key]["rule"], "threshold": chosen_val[best_key]["threshold"],
                   # every rule's and the confidence baselines' val choice travel with the checkpoint
                   "thresholds": {r: chosen_val[f"decider-{r}"]["threshold"] for r in rules},
                   "confidence_thresholds": {"level": chosen_val["confidence"]["threshold"],
                                             "tree": chosen_val["confidence-tree"]["threshold"]},
                   "test_tokens_per_s": policies[best_key]["tokens_per_s"],
                   "test_speedup_vs_best_fixed": policies[best_key]["tokens_per_s"] / base,
                   "test_oracle_share": policies[best_key]["oracle_share"],
                   "test_oracle_depth_share": oracle_share(policies[best_key]["tokens_per_s"], table,
                                                           "oracle-depth"),
                   "test_speedup_vs_best_fixed_shape": (policies[best_key]["tokens_per_s"]
                                                        / table["best_fixed_shape"]["tokens_per_s"]),
                   "test_speedup_vs_confidence_tree": (policies[best_key]["tokens_per_s"]
                                                       / confidence["confidence-tree"]["tokens_per_s"]),
                   # the grow rule has no threshold: replayed on test as the engine runs it
                   "grow": {env: {"decider_tokens_per_s": grow[f"grow-decider-{env}"]["tokens_per_s"],
                                  "q_tokens_per_s": grow[f"grow-q-{env}"]["tokens_per_s"],
                                  "decider_vs_q": (grow[f"grow-decider-{env}"]["tokens_per_s"]
                                                   / grow[f"grow-q-{env}"]["tokens_per_s"]),
                                  "decider_oracle_share": grow[f"grow-decider-{env}"]["oracle_share"]}
                            for env in GROW_ENVELOPES}},
        "decider_ms_per_level": decider_ms,
        "val_rounds": len(rv.rs), "test_rounds": len(rt.rs),
        "walked": rt.rs.walks and rv.rs.walks,  # each policy's own rounds (a round at every position)
    }
