"""The grow rule over this decider's scores and over q, replayed on the held-out traces exactly
as the engine grows (training.decider.grow_replay), with the checkpoint's stored cost model.

A re-evaluation of the checkpoint (2026-11-26), kept beside its output (grow_replay.json):

    .venv/bin/python reports/decider/20261126-033710-da421d/grow_replay.py

It runs the fit's own evaluation (training.fit.evaluate: same splits, baselines and replay) on
the exported net; new fits report the same rows in their summary.md."""
import json, sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, ".")  # run from the repository root
import torch

torch.set_num_threads(2)
from decoding.decider import load_decider
from training.decider.datamodule import TraceDataModule
from training.decider.replay import CostModel
from training.decider.threshold import ReplayConfig
from training.fit import ExportConfig, _clean, evaluate

here = Path(__file__).parent
ckpt = Path("checkpoints/deciders") / here.name
net, dcfg = load_decider(ckpt)
m = json.loads((ckpt / "metrics.json").read_text())
d = m["config"]["data"]
dm = TraceDataModule(traces=d["traces"], test_traces=d["test_traces"], label=d["label"],
                     eval_target=d["eval_target"], val_fraction=d["val_fraction"],
                     test_fraction=d["test_fraction"], split_seed=d["split_seed"], with_hidden=d["with_hidden"])
dm.load()
cm = dcfg.cost_model
cost = CostModel(**{k: cm[k] for k in ("sizes", "target_ms", "draft_ms", "overhead_ms", "policy_ms")}, unit=cm["unit"])
rcfg = ReplayConfig(cost_model="default", decider_ms=m["replay"]["decider_ms_per_level"])
res, _ = evaluate(net, dm, rcfg, ExportConfig(), cost)
test = res["replay"]["test"]
out = {"checkpoint": str(ckpt), "cost_model": asdict(cost), "decider_ms_per_level": rcfg.decider_ms,
       "best_fixed_shape": test["best_fixed_shape"], "oracle": test["oracle"],
       "grow": {k: v for k, v in test.items() if k.startswith("grow-")},
       "summary": res["replay"]["chosen"]["grow"],
       "roc_auc": {k: v["roc_auc"] for k, v in res["classification"]["test"].items()}}
(here / "grow_replay.json").write_text(json.dumps(_clean(out), indent=1))
print(json.dumps(_clean(out["summary"]), indent=1))
