"""The oracle-stop upper bound: recorded traces replayed under a cost model with perfect
knowledge of which drafted tokens the target accepts. It is a BOUND computed by replay,
never a measurement. The training stack is imported here, lazily: inference (and the rest
of the benchmark) runs without it.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import OracleConfig

LABEL = "oracle-stop BOUND (replay, not measured)"


def _from_metrics(decider) -> dict:
    """The replay the decider's fit stored in its metrics.json (its TEST prompts)."""
    from ..decider import resolve_decider_dir

    d = resolve_decider_dir(decider)
    try:
        m = json.loads((d / "metrics.json").read_text())
        table = m["replay"]["test"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"no replay results in {d / 'metrics.json'}") from None
    deciders = {k: v for k, v in table.items() if k.startswith("decider-") and isinstance(v, dict)}
    return {"source": f"replay stored with decider {d.name} (its test prompts)",
            "collect": (m.get("traces") or {}).get("collect") or {}, "table": table,
            "deciders": deciders, "cost_model": m["replay"].get("cost_model")}


def _from_traces(cfg: OracleConfig, sess, decider) -> dict:
    from training.decider.replay import CostModel, ReplaySet, baseline_table, calibrate, cost_dict
    from training.decider.traces import feature_matrix, load_traces

    from ..models import fingerprint, same_model

    manifest, table = load_traces(cfg.traces)
    for role, model in (("target", sess.target), ("draft", sess.draft)):
        want = (manifest.get("model_pair") or {}).get(role)
        if want and model is not None and not same_model(want, fingerprint(model)):
            raise ValueError(f"traces {cfg.traces} were recorded with another {role} ({want.get('name')})")
    if cfg.cost_model == "measure":
        cost = calibrate(sess.target, sess.draft, collect=manifest.get("collect"))
    elif cfg.cost_model == "decider":
        from ..decider import resolve_decider_dir

        cost = CostModel(**json.loads((resolve_decider_dir(decider) / "config.json").read_text())["cost_model"])
    else:
        cost = CostModel(**json.loads(Path(cfg.cost_model).read_text()))
    tab = baseline_table(ReplaySet(table), feature_matrix(table), cost)
    return {"source": f"traces {cfg.traces}", "collect": manifest.get("collect") or {}, "table": tab,
            "deciders": {}, "cost_model": cost_dict(cost)}


def oracle_bound(cfg: OracleConfig, sess, decider) -> dict:
    """{"status", "label", "source", "collect", "replay_tokens_per_s", "oracle_over_full_depth",
    "oracle_over_best_fixed", "deciders"}; status 'skipped: ...' when there is nothing to replay
    (disabled, or the decider stores no replay); traces named in the config that cannot be
    replayed are an error."""
    if not cfg.enabled:
        return {"status": "skipped: disabled in the config", "label": LABEL}
    try:
        if cfg.traces:
            r = _from_traces(cfg, sess, decider)
        elif decider is None:
            return {"status": "skipped: no traces and no decider configured", "label": LABEL}
        else:
            r = _from_metrics(decider)
    except ImportError as e:
        return {"status": f"skipped: the training stack is not importable ({e})", "label": LABEL}
    except (ValueError, OSError, KeyError, TypeError) as e:
        if cfg.traces:  # asked for by name: a bound that cannot be computed fails the run
            raise ValueError(f"oracle.traces {cfg.traces}: {str(e).splitlines()[0]}") from e
        return {"status": f"skipped: {str(e).splitlines()[0]}", "label": LABEL}
    tab = r["table"]
    fixed = {k: v["tokens_per_s"] for k, v in tab.items() if k.startswith("fixed-") and isinstance(v, dict)}
    if not fixed or "oracle" not in tab:
        return {"status": "skipped: replay table has no fixed-depth / oracle rows", "label": LABEL}
    full = max(fixed, key=lambda k: int(k.split("-")[1]))
    oracle = tab["oracle"]["tokens_per_s"]
    return {"status": "ok", "label": LABEL, "source": r["source"], "collect": r["collect"],
            "cost_model": r["cost_model"],
            "replay_tokens_per_s": {**fixed, "oracle": oracle},
            "full_depth": full, "best_fixed": tab.get("best_fixed") or max(fixed, key=fixed.get),
            "oracle_over_full_depth": oracle / fixed[full],
            "oracle_over_best_fixed": oracle / max(fixed.values()),
            "deciders": {k: {"tokens_per_s": v.get("tokens_per_s"), "oracle_share": v.get("oracle_share"),
                             "threshold": v.get("threshold")} for k, v in r["deciders"].items()}}


def reference_row(bound: dict, specs) -> str | None:
    """The measured fixed-depth row that drafts the tree the traces were recorded with:
    the bound's tokens/s estimate is that row's measured tokens/s x oracle / full depth."""
    c = bound.get("collect") or {}
    for s in specs:
        if s.peer or s.stop != "fixed" or s.mode != "lossless" or s.strategy != c.get("strategy"):
            continue
        if s.strategy == "ti-mcsd" and (s.width, s.depth) == (c.get("width"), c.get("depth")):
            return s.name
        if s.strategy == "mcsd" and s.engine_config().k_config == str(c.get("k_config", "")).replace(" ", ""):
            return s.name
        if s.strategy == "sd" and s.gamma == c.get("gamma"):
            return s.name
    return None
