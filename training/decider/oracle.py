"""The oracle-stop upper bound of a trace set, for the benchmark to read.

    python -m training.decider.oracle --traces DIR [--cost-model measure|decider|FILE.json]
                                      [--target DIR --draft DIR] [--decider DIR] [--out FILE]

Replays the traces (training.decider.collect) under a cost model with perfect knowledge of which
drafted tokens the target accepts, beside every fixed depth, and writes the table to
DIR/oracle.json (atomic). It is a BOUND computed by replay, never a measurement.
`python -m decoding.bench` with `oracle.traces: DIR` (or `--oracle-traces DIR`) reads that
file and labels its row as a bound; inference never imports this training code, so the
bench only points at this command when DIR/oracle.json is missing.

--cost-model: measure (time --target/--draft here, ~30 s; default: the shipped pair), decider (the cost model saved with --decider), or a CostModel JSON file.
Exit codes: 0 written; 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from decoding.bench.oracle import ORACLE_FILE  # the file the bench reads
from decoding.options import add_option


def replay_bound(traces: str, cost_model: str = "measure", target=None, draft=None,
                 decider: str | None = None) -> dict:
    """{"source", "collect", "model_pair", "table", "deciders", "cost_model", "cost_model_from"}
    of the traces in `traces`; ValueError on bad input."""
    from decoding.models import fingerprint, same_model

    from training.decider.replay import CostModel, ReplaySet, baseline_table, calibrate, cost_dict
    from training.decider.traces import feature_matrix, load_traces

    manifest, table = load_traces(traces)
    pair = manifest.get("model_pair") or {}
    for role, model in (("target", target), ("draft", draft)):
        want = pair.get(role)
        if want and model is not None and not same_model(want, fingerprint(model)):
            raise ValueError(f"traces {traces} were recorded with another {role} ({want.get('name')})")
    if cost_model == "measure":
        if target is None or draft is None:
            raise ValueError("--cost-model measure times the pair: give --target and --draft")
        cost = calibrate(target, draft, collect=manifest.get("collect"))
    elif cost_model == "decider":
        from decoding.decider.policy import resolve_decider_dir

        cost = CostModel(**json.loads((resolve_decider_dir(decider) / "config.json").read_text())["cost_model"])
    else:
        cost = CostModel(**json.loads(Path(cost_model).read_text()))
    tab = baseline_table(ReplaySet(table), feature_matrix(table), cost)
    return {"source": f"traces {traces}", "collect": manifest.get("collect") or {}, "model_pair": pair,
            "table": tab, "deciders": {}, "cost_model": cost_dict(cost), "cost_model_from": cost_model}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.decider.oracle", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(ap, "traces", required=True)
    add_option(ap, "cost_model")
    add_option(ap, "target")
    add_option(ap, "draft")
    add_option(ap, "decider")
    add_option(ap, "dtype", default="float32", only=("float32", "bfloat16"))
    add_option(ap, "out", unset="TRACES/" + ORACLE_FILE)
    a = ap.parse_args(argv)
    from decoding.models import ModelError
    from decoding.models.session import Session

    from training.shards import write_json

    try:
        target = draft = None
        if a.cost_model == "measure" or a.target or a.draft:  # the pair, as the bench opens it
            sess = Session.open(a.target, a.draft, a.dtype, need_draft=a.cost_model == "measure")
            target, draft = sess.target, sess.draft
        bound = replay_bound(a.traces, a.cost_model, target, draft, a.decider)
        out = Path(a.out) if a.out else Path(a.traces) / ORACLE_FILE
        write_json(out, bound)
    except (ModelError, ValueError, OSError, KeyError, TypeError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"wrote {out}: oracle {bound['table']['oracle']['tokens_per_s']:.1f} tok/s (replayed bound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
