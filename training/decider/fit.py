"""Train a stop decider on recorded traces, choose its threshold by replay, export it.

    python -m training.fit --config configs/fit_decider.yaml [--model.kind hidden ...]

LightningCLI (run=False): `model.*` DeciderModule, `data.*` TraceDataModule, `trainer.*`,
`checkpoint.*` (best-val ModelCheckpoint), `replay.*` (cost model, threshold grid) and
`export.*` (output root, reports). After training, the global-zero process scores the
splits, fits the scikit-learn baselines, replays thresholds on VAL, reports on TEST, writes
`<export.out>/<run-id>/` via decoding.decider.policy.save_decider and registers it in
`<export.out>/registry.json` (as `latest` unless --export.promote false). The default root is
runs/deciders; only `--export.out checkpoints/deciders` changes the shipped pair's.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only

from decoding.decider.policy import RUNS_DECIDERS, DeciderConfig, DeciderNet, save_decider, uses_hidden
from decoding.decider.features import FEATURE_GROUPS, FEATURE_SCHEMA_VERSION, NUM_FEATURES
from decoding.options import add_option

from training.decider import metrics as M
from training.decider.datamodule import Split, TraceDataModule
from training.decider.module import DeciderModule
from training.decider.registry import register
from training.decider.replay import PATH_LOGQ, Q_TOKEN, CostModel, ReplaySet, cost_dict
from training.decider.threshold import ReplayConfig, load_cost, policy_ms, select_and_report


@dataclass
class ExportConfig:
    """Where the trained decider and its report go."""

    out: str = RUNS_DECIDERS
    """Deciders root: <out>/<run-id>/ and <out>/registry.json (`--decider <out>` reads its
    latest). checkpoints/deciders is the shipped pair's, what `--decider latest` reads."""
    reports: str | None = None
    """Plots and summary.md go to <reports>/<run-id>/ (null: into the run directory)."""
    run_id: str | None = None
    """Default: <UTC timestamp>-<6 hex of the config and trace identity>."""
    promote: bool = True
    """Make this run `latest` in registry.json."""
    baseline_max_rows: int = 200_000
    """Train rows used to fit the scikit-learn baselines (subsampled above this)."""


class FitCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.monitor": "val_loss", "checkpoint.mode": "min",
                             "checkpoint.save_weights_only": True, "checkpoint.filename": "best-{epoch}"})
        parser.add_class_arguments(ReplayConfig, "replay")
        parser.add_class_arguments(ExportConfig, "export")
        add_option(parser, "threads")
        # only the hidden-state kinds need the (large) hidden column
        parser.link_arguments("model.kind", "data.with_hidden", compute_fn=uses_hidden)


def make_cli(argv) -> FitCLI:
    return FitCLI(DeciderModule, TraceDataModule, args=argv, run=False, save_config_callback=None,
                  seed_everything_default=0,
                  trainer_defaults={"max_epochs": 10, "accelerator": "cpu", "devices": 1,
                                    "enable_model_summary": False},
                  parser_kwargs={"prog": "python -m training.fit", "description": __doc__.split("\n")[0]})


@torch.inference_mode()
def score(net: DeciderNet, split: Split, chunk: int = 65536) -> np.ndarray:
    """Acceptance probability for EVERY row of the split (replay needs invalid nodes too)."""
    out = []
    for i in range(0, split.table.num_rows, chunk):
        h = torch.from_numpy(split.hidden[i:i + chunk]) if split.hidden is not None else None
        out.append(torch.sigmoid(net(torch.from_numpy(split.features[i:i + chunk]), h)).double().numpy())
    return np.concatenate(out)


def _clean(obj):
    """JSON-safe: NaN -> None, numpy scalars -> Python."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return None if math.isnan(float(obj)) else float(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def evaluate(net: DeciderNet, dm: TraceDataModule, rcfg: ReplayConfig, ecfg: ExportConfig,
             cost: CostModel) -> tuple[dict, dict]:
    """(metrics, plot curves): classification table on val/test, replay selection and report."""
    sp = dm.splits
    scores = {s: {"decider": score(net, sp[s])} for s in ("val", "test")}
    tr = sp["train"]
    baselines = M.fit_baselines(tr.features[tr.rows], tr.label[tr.rows], ecfg.baseline_max_rows)
    for s in ("val", "test"):
        for name, clf in baselines.items():
            scores[s][name] = M.predict(clf, sp[s].features)
    te = sp["test"].valid & (sp["test"].target >= 0)
    ablation = M.feature_ablation(tr.features[tr.rows], tr.label[tr.rows], sp["test"].features[te],
                                  sp["test"].target[te], FEATURE_GROUPS, ecfg.baseline_max_rows)
    classification, path_classification, curves = {}, {}, {}
    for s in ("val", "test"):
        keep = sp[s].valid & (sp[s].target >= 0)
        y = sp[s].target[keep]
        named = {**scores[s], "confidence_q_token": sp[s].features[:, Q_TOKEN].astype(np.float64)}
        classification[s] = {n: M.classification(y, p[keep]) for n, p in named.items()}
        if s == "test":
            curves = {n: (y, p[keep]) for n, p in named.items()}
        # what the specdecpp / tree rules threshold: P(the whole path down to a node is accepted)
        rs, valid = ReplaySet(sp[s].table), sp[s].valid
        acc = sp[s].table.column("accepted").to_numpy(zero_copy_only=False)[valid].astype(np.float64)
        paths = {n: rs.path(p)[valid] for n, p in scores[s].items()}
        paths["confidence_path_q"] = np.exp(sp[s].features[:, PATH_LOGQ].astype(np.float64))[valid]
        path_classification[s] = {n: M.classification(acc, p) for n, p in paths.items()}
    vocab = int(dm.manifest.get("model_pair", {}).get("draft", {}).get("vocab_size") or 32000)
    levels = sp["val"].table.group_by(["prompt_id", "round", "depth"]).aggregate([("node", "count")])
    width = int(np.max(levels.column("node_count").to_numpy()))  # widest level = parents to score
    dms = rcfg.decider_ms if rcfg.decider_ms is not None else policy_ms(net, vocab, max(width, 1))
    replay_scores = {s: (v if rcfg.baselines else {"decider": v["decider"]}) for s, v in scores.items()}
    rep = select_and_report(sp["val"], sp["test"], replay_scores["val"], replay_scores["test"],
                            cost, rcfg, dms)
    return {"classification": classification, "path_classification": path_classification,
            "feature_ablation": ablation, "replay": {**rep, "cost_model": cost_dict(cost)}}, curves


def _num(v, fmt: str = ".3f") -> str:
    return "n/a" if v is None else format(v, fmt)  # NaN was cleaned to None (e.g. no oracle gain)


def summary_md(run_id: str, metrics: dict) -> str:
    cls = metrics["classification"]["test"]
    rep = metrics["replay"]["test"]
    rows = {k: v for k, v in rep.items() if isinstance(v, dict)}
    ch = metrics["replay"]["chosen"]
    return "\n\n".join([
        f"# decider {run_id}",
        (f"kind `{metrics['decider']['kind']}`, label `{metrics['decider']['label']}`, eval target "
         f"`{metrics['eval_target']}`; rule `{ch['rule']}` at threshold {_num(ch['threshold'])} "
         f"(chosen on val replay); test: {_num(ch['test_tokens_per_s'], '.1f')} tok/s, "
         f"{_num(ch['test_speedup_vs_best_fixed'])}x best fixed depth ({rep['best_fixed']}), "
         f"{_num(ch.get('test_speedup_vs_best_fixed_shape'))}x best fixed shape "
         f"({rep.get('best_fixed_shape', {}).get('shape')}), "
         f"{_num(ch.get('test_speedup_vs_confidence_tree'))}x the draft-confidence tree; "
         f"share of the node oracle's gain {_num(ch['test_oracle_share'])}, "
         f"of the depth oracle's {_num(ch.get('test_oracle_depth_share'))}"),
        "## Classification (test prompts): each node, will its token match the target's?",
        M.markdown_table(cls, ["roc_auc", "pr_auc", "brier", "ece", "n", "positive_rate"]),
        ("## Path classification (test prompts): predicted probability that the whole path down "
         "to a node is accepted (product of node scores; what the specdecpp and tree rules "
         "threshold) against whether the round accepted that node"),
        M.markdown_table(metrics.get("path_classification", {}).get("test", {}),
                         ["roc_auc", "pr_auc", "brier", "ece", "n", "positive_rate"]),
        ("## Which features carry signal (test prompts): ROC-AUC of a logistic regression on "
         "each group alone and on every feature but the group (`all`: every feature; the "
         "decider above adds the draft's hidden state when it is a hidden-state decider)"),
        M.markdown_table({k: v if "alone" in v else {"alone": v["roc_auc"]}
                          for k, v in metrics.get("feature_ablation", {}).items()}, ["alone", "without"]),
        ("## Replay (test prompts; thresholds chosen on val; best fixed depth and "
         "confidence-test-tuned are hindsight choices on test; "
         + ("each policy walks its own rounds, the traces having a round at every position)"
            if metrics["replay"].get("walked") else "every policy is scored on the rounds the recorded tree left)")),
        M.markdown_table(rows, ["tokens_per_s", "tokens_per_round", "mean_depth", "mean_nodes", "threshold",
                                "oracle_share"]),
        ("## The grow rule (test prompts, no threshold: replayed as the engine grows, in the traces' "
         "tree or its first chain; oracle share against the best fixed shape)"),
        M.markdown_table(ch.get("grow", {}), ["decider_tokens_per_s", "q_tokens_per_s", "decider_vs_q",
                                              "decider_oracle_share"]),
    ]) + "\n"


def run_id_for(config: dict, manifest: dict) -> str:
    ident = json.dumps({"config": config, "pair": manifest.get("model_pair"), "t": time.time_ns()},
                       sort_keys=True, default=str)
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + hashlib.sha256(ident.encode()).hexdigest()[:6]


def export(model: DeciderModule, dm: TraceDataModule, rcfg: ReplayConfig, ecfg: ExportConfig,
           cost: CostModel, config: dict, training: dict) -> tuple[Path, dict]:
    net = model.calibrated_net()
    results, curves = evaluate(net, dm, rcfg, ecfg, cost)
    run_id = ecfg.run_id or run_id_for(config, dm.manifest)
    chosen = results["replay"]["chosen"]
    dcfg = DeciderConfig(kind=model.kind, num_features=NUM_FEATURES, hidden_size=dm.hidden_size,
                         feature_schema=dm.manifest.get("feature_schema", FEATURE_SCHEMA_VERSION),
                         threshold=chosen["threshold"], rule=chosen["rule"],
                         model_pair=dm.manifest.get("model_pair", {}),
                         cost_model=results["replay"]["cost_model"], label=dm.label,
                         thresholds=chosen["thresholds"], confidence_thresholds=chosen["confidence_thresholds"])
    sizes = {s: {"prompts": len(v.prompts), "rows": len(v.rows)} for s, v in dm.splits.items()}
    metrics = _clean({"run_id": run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "decider": asdict(dcfg) | {"cost_model": None}, "eval_target": dm.eval_target,
                      "traces": {"path": dm.traces, "test_path": dm.test_traces,
                                 "collect": dm.manifest.get("collect"), "splits": sizes},
                      "training": training, **results, "config": config})
    out_root = Path(ecfg.out or RUNS_DECIDERS)
    run_dir = save_decider(out_root / run_id, net, dcfg, metrics)
    rep_dir = Path(ecfg.reports) / run_id if ecfg.reports else run_dir
    rep_dir.mkdir(parents=True, exist_ok=True)
    M.plot_roc(curves, rep_dir / "roc.png", f"ROC, test prompts ({metrics['eval_target']})")
    M.plot_calibration(curves, rep_dir / "calibration.png", "Reliability, test prompts (15 bins)")
    (rep_dir / "summary.md").write_text(summary_md(run_id, metrics))
    test = metrics["classification"]["test"]["decider"]
    register(out_root, run_id, {
        "created": metrics["created"], "kind": dcfg.kind, "rule": dcfg.rule, "threshold": dcfg.threshold,
        "label": dcfg.label, "model_pair": {k: v.get("name") for k, v in dcfg.model_pair.items()},
        "metrics": {"roc_auc": test["roc_auc"], "ece": test["ece"],
                    "tokens_per_s": chosen["test_tokens_per_s"],
                    "speedup_vs_best_fixed": chosen["test_speedup_vs_best_fixed"],
                    "oracle_share": chosen["test_oracle_share"]},
        "reports": str(rep_dir)}, promote=ecfg.promote)
    return run_dir, metrics


def _leave_group() -> None:
    """A DDP worker leaves its process group before it exits: left to the interpreter's teardown,
    gloo's threads aborted a worker ("terminate called without an active exception"), and the
    launcher then killed rank 0 in the middle of its export."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*number of training batches.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")  # lightning internals on torch 2.13
    warnings.filterwarnings("ignore", ".*args parameter is intended.*")  # main(argv) in-process
    try:
        cli = make_cli(argv)
    except ValueError as e:  # raised by a component's __init__ (bad option value)
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    cfg = cli.config
    if cfg.get("threads"):
        torch.set_num_threads(cfg.threads)
    dm, model, trainer = cli.datamodule, cli.model, cli.trainer
    rcfg, ecfg = cli.config_init.replay, cli.config_init.export
    try:
        taken = Path(ecfg.out or RUNS_DECIDERS) / ecfg.run_id if ecfg.run_id else None
        if taken is not None and taken.exists():  # decider dirs are write-once: refuse before training
            raise ValueError(f"{taken} already exists: decider checkpoints are write-once, pick another export.run_id")
        dm.load()  # fail on bad traces before any process is launched
        # rank 0 (the launching process) times the models now: fails fast, and nothing else
        # competes for the CPU while it measures; DDP workers never need the cost model
        cost = (load_cost(rcfg, dm.manifest.get("model_pair", {}), dm.manifest.get("collect"))
                if rank_zero_only.rank == 0 else None)
        trainer.fit(model, datamodule=dm)
        if not trainer.is_global_zero:
            _leave_group()
            return 0  # DDP workers: rank 0 evaluates and exports
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and ckpt.best_model_path:
            model.load_best(ckpt.best_model_path)
        score_ = ckpt.best_model_score if ckpt is not None else None
        training = {"epochs": trainer.current_epoch, "best_checkpoint": getattr(ckpt, "best_model_path", None),
                    "best_" + str(getattr(ckpt, "monitor", "score")): None if score_ is None else float(score_),
                    "world_size": trainer.world_size, "pos_weight": model.pos_weight}
        config = json.loads(json.dumps(cfg.as_dict(), default=str))
        run_dir, metrics = export(model, dm, rcfg, ecfg, cost, config, training)
    except ValueError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a full disk during export: nothing half-written, registry untouched
        print(f"error: cannot write the decider: {e}", file=sys.stderr)
        return 1
    ch = metrics["replay"]["chosen"]
    print(json.dumps({"run_dir": str(run_dir), "test_roc_auc": metrics["classification"]["test"]["decider"]["roc_auc"],
                      "test_ece": metrics["classification"]["test"]["decider"]["ece"], **ch}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
