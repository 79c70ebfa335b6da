"""The oracle-stop upper bound: recorded traces replayed under a cost model with perfect
knowledge of which drafted tokens the target accepts. It is a BOUND computed by replay,
never a measurement. The replay belongs to the training stack, which inference never
imports: the bench reads what it wrote, either the replay stored with the decider
(metrics.json) or TRACES/oracle.json from `python -m training.decider.oracle --traces TRACES`.
"""

from __future__ import annotations

import json
from pathlib import Path

from decoding.bench.config import OracleConfig

LABEL = "oracle-stop BOUND (replay, not measured)"


def _from_metrics(decider) -> dict:
    """The replay the decider's fit stored in its metrics.json (its TEST prompts)."""
    from decoding.decider.policy import resolve_decider_dir

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


ORACLE_FILE = "oracle.json"  # written by python -m training.decider.oracle


def require_replay(cfg: OracleConfig) -> None:
    """Named traces without their replayed bound: refused before the (long) run, with the
    command that computes it."""
    if cfg.enabled and cfg.traces and not (Path(cfg.traces) / ORACLE_FILE).is_file():
        raise ValueError(f"oracle.traces {cfg.traces}: no replayed bound in {ORACLE_FILE}; compute it with "
                         f"the training stack first: python -m training.decider.oracle --traces {cfg.traces} "
                         f"--cost-model {cfg.cost_model} [--target DIR --draft DIR | --decider DIR]")


def _from_traces(cfg: OracleConfig, sess) -> dict:
    """The replay training.decider.oracle wrote beside the traces, checked against this pair."""
    from decoding.models import fingerprint, same_model

    require_replay(cfg)
    r = json.loads((Path(cfg.traces) / ORACLE_FILE).read_text())
    for role, model in (("target", getattr(sess, "target", None)), ("draft", getattr(sess, "draft", None))):
        want = (r.get("model_pair") or {}).get(role)
        if want and model is not None and not same_model(want, fingerprint(model)):
            raise ValueError(f"traces {cfg.traces} were recorded with another {role} ({want.get('name')})")
    return r


def oracle_bound(cfg: OracleConfig, sess, decider) -> dict:
    """{"status", "label", "source", "collect", "replay_tokens_per_s", "oracle_over_full_depth",
    "oracle_over_best_fixed", "deciders"}; status 'skipped: ...' when there is nothing to replay
    (disabled, or the decider stores no replay); traces named in the config that cannot be
    replayed are an error."""
    if not cfg.enabled:
        return {"status": "skipped: disabled in the config", "label": LABEL}
    try:
        if cfg.traces:
            r = _from_traces(cfg, sess)
        elif decider is None:
            return {"status": "skipped: no traces and no decider configured", "label": LABEL}
        else:
            r = _from_metrics(decider)
    except (ValueError, OSError, KeyError, TypeError) as e:
        if cfg.traces:  # asked for by name: a bound that cannot be computed fails the run
            msg = str(e).splitlines()[0]
            raise ValueError(msg if msg.startswith("oracle.traces") else f"oracle.traces {cfg.traces}: {msg}") from e
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
