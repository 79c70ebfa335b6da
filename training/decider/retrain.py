"""Scheduled retraining: new prompts -> traces -> challenger decider -> compare -> promote.

    python -m training.retrain --config configs/retrain.yaml

A run reads only the logged files (`new_prompts`, or `--logged DIR`; rows described in
training.logged) that `<work>/cursor.json` does not list as consumed: whole files, each by name,
size and sha256. Once its decision is written (promoted or kept) those files join the cursor, so
a re-run with nothing new exits 11 and touches nothing. With fewer than `min_prompts` new prompts,
or prompts whose hashes leave the held-out part or the fit's train or val split empty, it exits 11
before any work and consumes nothing: they wait for more traffic.

Each run lives in `<work>/<input-key>/` (config.json, traces, decision.json), where the key
hashes the new prompts, this config and the model pair; a run killed midway resumes (collection
skips finished prompts, a finished fit is reused). The champion is the registry's `latest` (while
the root has none: the shipped `latest`, if it fits the pair; promotion still writes only this
root); the challenger is promoted only when it beats the champion on the SAME held-out traces by the
configured margin (replayed tokens/s, ROC-AUC not worse) and does not lose the live check.

Promotion is a compare-and-swap: the decision is written to decision.pending.json, then
`latest` is moved from the champion it was judged against to the challenger under the
registry lock (refused if `latest` moved meanwhile, e.g. a concurrent training.decider.fit), then
the record is renamed to decision.json. A re-run that finds a pending record completes it;
it never re-compares (after a crash past the swap the challenger would face itself).

Re-distilling the draft is recommended when acceptance on the held-out traces falls below
`redistill_below`. With `redistill: <training.head.redistill config>` and a feature (EAGLE-3)
head as the draft, the head is then re-distilled on the same logged prompts behind its own
gate (promoted only when it beats the head on held-out prompts; its new_prompts, target and
draft are this run's); otherwise `redistill_command` runs, if set. Its exit code and run go
into decision.json. A decider fit for the head a promoted head was re-distilled from (the
head's marker records it) cannot serve the new head: the next run judges its challenger
against no champion and replaces it (until then `--decider latest` refuses the new head).

Exit codes: 0 challenger promoted | 10 champion kept | 11 up to date (nothing to do) |
2 bad input (one `error:` line) | 75 another retrain holds the lock, or `latest` moved since
the comparison (run again) | 1 unexpected failure (e.g. a full disk); the registry is
untouched by every non-zero exit.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


from decoding.decider.policy import DECIDERS_DIR, RUNS_DECIDERS, load_decider, resolve_decider_dir, uses_hidden
from decoding.drafts.io import is_feature_draft
from decoding.models import ModelError, fingerprint, same_model

from training.config_flags import parse_config
from training.decider.collect import CollectConfig, collect
from training.corpus.teacher import Prompt
from training import logged as L
from training.logged import is_heldout, read_logged  # noqa: F401  (re-exported)
from training.decider.registry import LatestMoved, read_registry, register
from training.shards import write_json

EXIT_PROMOTED, EXIT_KEPT, EXIT_UP_TO_DATE, EXIT_BAD_INPUT, EXIT_LOCKED = 0, 10, 11, 2, 75
EXIT_LATEST_MOVED = EXIT_LOCKED  # EX_TEMPFAIL: try again
PENDING, DECISION = "decision.pending.json", "decision.json"


@dataclass
class RetrainConfig:
    new_prompts: str = "data/logged"
    """Directory of logged prompt files (*.jsonl; rows in training.logged), e.g. what
    `python -m decoding.serve --log-prompts DIR` writes (flag alias: --logged)."""
    min_prompts: int = 48
    """Fewest new prompts a run trains on (fewer: exit 11, nothing consumed). At 48, with the
    default held-out 0.25 and fit val 0.15, the fit's val split expects 5.4 prompts and is empty
    by chance 0.3% of the time (then the run waits too); it may not be below the count at which
    every part expects one prompt."""
    work: str = "runs/retrain"
    """Versioned run directories live here."""
    deciders: str = RUNS_DECIDERS
    """Deciders root with registry.json that challengers are written to and promoted in
    (checkpoints/deciders: the shipped pair's, what `--decider latest` reads)."""
    fit_config: str = "configs/fit_decider.yaml"
    """The fit's YAML (training.fit --config) the challenger is trained with."""
    fit_overrides: list[str] = field(default_factory=list)
    """Extra `training.decider.fit` flags, e.g. ["--replay.cost_model", "default"]."""
    heldout_fraction: float = 0.25
    """Share of the new prompts kept out of training: champion and challenger are compared on them."""
    margin: float = 0.02
    """Promote when challenger replay tokens/s >= champion's * (1 + margin) ..."""
    auc_tolerance: float = 0.01
    """... and its held-out ROC-AUC is at most this much below the champion's."""
    live_prompts: int = 2
    """Held-out prompts generated live with each decider (0 = skip the live check)."""
    live_tolerance: float = 0.10
    """The challenger may be at most this much slower live (noisy shared machines)."""
    target: str | None = None
    draft: str | None = None
    dtype: str = "auto"
    """auto: bfloat16 only where the CPU or GPU computes it natively, else float32."""
    strategy: str = "ti-mcsd"
    width: int = 4
    depth: int = 6
    temperature: float = 0.0
    max_new_tokens: int = 128
    chat: bool = True
    """Wrap each logged prompt in the tokenizer's chat template, as the server does."""
    hidden: bool = False
    """Also record the draft's hidden states (for a hidden-state decider)."""
    redistill_below: float | None = None
    """Recommend re-distilling the draft when acceptance on the new prompts falls below this."""
    redistill_command: list[str] = field(default_factory=list)
    """Run this command (e.g. python -m training.distill --config ...) when recommended."""
    redistill: str | None = None
    """A training.head.redistill config (configs/redistill_eagle3.yaml): when recommended and
    the draft is a feature head, re-distil it behind its gate instead of redistill_command."""
    threads: int | None = None


def input_key(cfg: RetrainConfig, prompts: list[Prompt], pair: dict) -> str:
    ident = {"config": asdict(cfg), "prompts": [(p.id, p.text) for p in prompts], "pair": pair}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def assess(decider_dir: Path, path: Path, cost, with_hidden: bool) -> dict:
    """A decider on held-out traces: ROC-AUC and replayed tokens/s at its own rule/threshold."""
    from training.decider import metrics as M
    from training.decider.datamodule import TraceDataModule
    from training.decider.fit import score
    from training.decider.threshold import Replayer

    net, dcfg = load_decider(decider_dir)
    _, split = TraceDataModule(traces=str(path), with_hidden=with_hidden).whole(str(path))
    s = score(net, split)
    keep = split.valid & (split.target >= 0)
    rep = Replayer(split).at(s, dcfg.rule, dcfg.threshold, cost)
    return {"roc_auc": M.roc_auc(split.target[keep], s[keep]), "tokens_per_s": rep["tokens_per_s"],
            "rule": dcfg.rule, "threshold": dcfg.threshold}


def live_tokens_per_s(session, decider_dir: Path, prompts: list[Prompt], cfg: RetrainConfig) -> float:
    from decoding.sampling import SamplingConfig
    from decoding.strategies import StrategyConfig

    scfg = StrategyConfig(strategy=cfg.strategy, width=cfg.width, depth=cfg.depth, stop="decider")
    eng = session.engine(scfg, SamplingConfig(cfg.temperature), decider=str(decider_dir))
    tokens = secs = 0.0
    for p in prompts:
        ids = session.encode(p.text, chat=cfg.chat and not p.raw, max_new_tokens=cfg.max_new_tokens, tree_depth=cfg.depth)
        _, st = eng.generate(ids, cfg.max_new_tokens, session.eos_token_id)
        tokens, secs = tokens + st.new_tokens, secs + st.wall_s
    return tokens / secs if secs else 0.0


def comparable_champion(decider_dir: Path, session, draft_dir) -> bool:
    """Whether the champion decider fits this pair. False for one fit for the head the current
    feature head was re-distilled from (its marker's `redistilled_from`): it can neither serve
    nor judge this pair, so the challenger replaces it. Corrupt, or for another model: raises."""
    try:
        load_decider(decider_dir, session.target, session.draft)
        return True
    except ModelError:
        _, dcfg = load_decider(decider_dir, session.target)  # corrupt or another target: raises
        marker = Path(draft_dir or "") / "specstop_draft.json"
        prev = json.loads(marker.read_text()).get("redistilled_from") if marker.is_file() else None
        if prev is None or not same_model(dcfg.model_pair.get("draft") or {}, prev):
            raise
        return False


def shipped_champion(root: Path, session) -> Path | None:
    """The shipped `latest` when it fits this pair: a root's first challenger is judged against it."""
    if root.resolve() == DECIDERS_DIR.resolve():
        return None
    try:
        d = resolve_decider_dir("latest")
        load_decider(d, session.target, session.draft)
    except ModelError:  # none shipped, or for another pair: the first challenger stands alone
        return None
    return d


def run_redistill(rd_cfg, cfg: RetrainConfig, session, prompts: list[Prompt], log) -> dict:
    """The head's re-distillation (training.head.redistill) on this run's prompts and pair."""
    from training.head import redistill as RD

    rd_cfg = replace(rd_cfg, new_prompts=cfg.new_prompts, target=cfg.target,
                     draft=str(getattr(session, "draft_dir", None) or cfg.draft))
    return {"config": cfg.redistill, "exit_code": RD.execute(rd_cfg, log=log, prompts=prompts)}


def decide(champ: dict | None, chall: dict, cfg: RetrainConfig) -> tuple[bool, str]:
    if champ is None:
        return True, "no champion yet"
    if chall["tokens_per_s"] < champ["tokens_per_s"] * (1 + cfg.margin):
        return False, (f"replay {chall['tokens_per_s']:.2f} tok/s is not {cfg.margin:.0%} above the "
                       f"champion's {champ['tokens_per_s']:.2f}")
    if (chall["roc_auc"] or 0) < (champ["roc_auc"] or 0) - cfg.auc_tolerance:
        return False, f"ROC-AUC {chall['roc_auc']:.3f} below the champion's {champ['roc_auc']:.3f}"
    if "live_tokens_per_s" in chall and chall["live_tokens_per_s"] < champ["live_tokens_per_s"] * (1 - cfg.live_tolerance):
        return False, "slower than the champion in the live check"
    return True, "beats the champion on held-out traces"


def run(cfg: RetrainConfig, session=None, log=print) -> int:
    root = Path(cfg.deciders or RUNS_DECIDERS)
    work = Path(cfg.work)
    ready = new_inputs(cfg, work, log)
    if isinstance(ready, int):
        return ready
    files, prompts = ready
    rd_cfg = None
    if cfg.redistill:  # a bad config fails now, not after the night's work
        from training.head.redistill import load_config

        rd_cfg = load_config(cfg.redistill)
    work.mkdir(parents=True, exist_ok=True)
    with open(work / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            log(f"error: another retrain run holds {work / '.lock'}")
            return EXIT_LOCKED
        if L.unconsumed(Path(cfg.new_prompts), work) != files:  # a run that held the lock consumed some
            ready = new_inputs(cfg, work, log)
            if isinstance(ready, int):
                return ready
            files, prompts = ready
        rc = decide_files(cfg, root, work, prompts, session, rd_cfg, log)
        if rc in (EXIT_PROMOTED, EXIT_KEPT, EXIT_UP_TO_DATE):  # decided: these files are done
            L.consume(work, files)
        return rc


def new_inputs(cfg: RetrainConfig, work: Path, log) -> tuple[list[dict], list[Prompt]] | int:
    """The unconsumed files and their prompts, or EXIT_UP_TO_DATE (said in one line) when there
    is nothing to do yet. ValueError: a missing directory, a bad row, a minimum below the floor."""
    folder = Path(cfg.new_prompts)
    if not folder.is_dir():
        raise ValueError(f"logged prompts directory not found: {folder}")
    val, seed = L.fit_split(cfg.fit_config, cfg.fit_overrides)
    floor = L.prompts_floor(cfg.heldout_fraction, val)
    if cfg.min_prompts < floor:
        raise ValueError(f"min_prompts {cfg.min_prompts} is below {floor}, the fewest at which the held-out "
                         f"part ({cfg.heldout_fraction}) and the fit's val split ({val}) expect a prompt each")
    files = L.unconsumed(folder, work)
    if not files:
        log(f"up to date: no new logged files in {folder} (every *.jsonl is in {work / L.CURSOR})")
        return EXIT_UP_TO_DATE
    prompts = read_logged(folder, [folder / e["name"] for e in files])
    if len(prompts) < cfg.min_prompts:
        log(f"up to date: {len(prompts)} new prompts in {len(files)} file(s), below min_prompts "
            f"{cfg.min_prompts}; nothing consumed")
        return EXIT_UP_TO_DATE
    empty = L.empty_part(prompts, cfg.heldout_fraction, val, seed)
    if empty:
        log(f"up to date: the {len(prompts)} new prompts leave the {empty} part empty; nothing consumed")
        return EXIT_UP_TO_DATE
    return files, prompts


def decide_files(cfg: RetrainConfig, root: Path, work: Path, prompts: list[Prompt], session, rd_cfg, log) -> int:
    """Collect, fit, judge and promote on `prompts` (the lock held)."""
    from decoding.models.session import Session
    from training.decider.replay import CostModel

    session = session or Session.open(cfg.target, cfg.draft, cfg.dtype, need_draft=True)
    pair = {"target": fingerprint(session.target), "draft": fingerprint(session.draft)}
    run_dir = work / input_key(cfg, prompts, pair)
    if (run_dir / DECISION).exists():
        log(f"up to date: {run_dir} already decided for these inputs")
        return EXIT_UP_TO_DATE
    if (run_dir / PENDING).exists():  # a promotion cut short: finish it, never re-compare
        return finish_promotion(root, run_dir, json.loads((run_dir / PENDING).read_text()), log)
    latest = read_registry(root).get("latest")
    champion = root / latest if latest else shipped_champion(root, session)
    champion_id = latest or (str(champion) if champion else None)
    draft_dir = getattr(session, "draft_dir", None) or cfg.draft
    # fail before any work on a corrupt or foreign champion
    comparable = champion is None or comparable_champion(champion, session, draft_dir)
    run_dir.mkdir(exist_ok=True)
    write_json(run_dir / "config.json", {"config": asdict(cfg), "prompts": len(prompts),
                                         "champion": champion_id})
    held = [p for p in prompts if is_heldout(p.id, cfg.heldout_fraction)]
    train = [p for p in prompts if not is_heldout(p.id, cfg.heldout_fraction)]
    ccfg = CollectConfig(strategy=cfg.strategy, width=cfg.width, depth=cfg.depth, dtype=cfg.dtype,
                         temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                         chat=cfg.chat, hidden=cfg.hidden, shard_size=8)
    stats = {name: collect(replace(ccfg, out=str(run_dir / name)), session, ps, progress=False)
             for name, ps in (("traces_train", train), ("traces_heldout", held))}
    challenger_id = f"retrain-{run_dir.name}"
    if not (root / challenger_id / "metrics.json").exists():
        from training.decider.fit import main as fit_main

        rc = fit_main(["--config", cfg.fit_config, "--data.traces", str(run_dir / "traces_train"),
                       "--data.test_traces", str(run_dir / "traces_heldout"), "--export.out", str(root),
                       "--export.run_id", challenger_id, "--export.promote", "false",
                       "--export.reports", str(run_dir / "reports"),
                       "--trainer.default_root_dir", str(run_dir / "fit"), *cfg.fit_overrides])
        if rc != 0:
            return rc
    chall_cfg = json.loads((root / challenger_id / "config.json").read_text())
    cost = CostModel(**chall_cfg["cost_model"])  # one cost model judges both deciders
    hidden = uses_hidden(chall_cfg["kind"])
    chall = assess(root / challenger_id, run_dir / "traces_heldout", cost, hidden)
    champ = None
    if champion_id and comparable:
        champ_hidden = uses_hidden(json.loads((champion / "config.json").read_text())["kind"])
        champ = assess(champion, run_dir / "traces_heldout", cost, champ_hidden)
    if champ is not None and cfg.live_prompts > 0:
        live = held[: cfg.live_prompts]
        champ["live_tokens_per_s"] = live_tokens_per_s(session, champion, live, cfg)
        chall["live_tokens_per_s"] = live_tokens_per_s(session, root / challenger_id, live, cfg)
    promote, reason = decide(champ, chall, cfg)
    if not comparable:
        reason = f"the champion {champion_id} was fit for the head this draft was re-distilled from"
    acceptance = stats["traces_heldout"]["acceptance_rate"]
    redistill = {"acceptance": acceptance, "below": cfg.redistill_below,
                 "recommended": cfg.redistill_below is not None and acceptance < cfg.redistill_below}
    if redistill["recommended"] and rd_cfg is not None and is_feature_draft(session.draft):
        redistill |= run_redistill(rd_cfg, cfg, session, prompts, log)
    elif redistill["recommended"] and cfg.redistill_command:
        redistill["exit_code"] = subprocess.run(cfg.redistill_command).returncode
    decision = {"promoted": promote, "reason": reason, "champion": champion_id, "root_latest": latest,
                "challenger": challenger_id, "champion_metrics": champ, "challenger_metrics": chall,
                "collect": stats, "redistill": redistill,
                "decided": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    decision = json.loads(json.dumps(decision, default=float))
    if promote:
        write_json(run_dir / PENDING, decision)  # recorded before the swap it describes
        return finish_promotion(root, run_dir, decision, log)
    write_json(run_dir / DECISION, decision)
    log(json.dumps({"promoted": False, "reason": reason, "run_dir": str(run_dir)}))
    return EXIT_KEPT


def finish_promotion(root: Path, run_dir: Path, decision: dict, log=print) -> int:
    """Swap `latest` from decision["champion"] to decision["challenger"] (compare-and-swap;
    already done when a crash came after it), then turn the pending record into decision.json."""
    chall, pending = decision["challenger"], run_dir / PENDING
    if read_registry(root).get("latest") != chall:
        info = next((r for r in read_registry(root)["runs"] if r.get("run_id") == chall), {})
        try:
            register(root, chall, {k: v for k, v in info.items() if k != "run_id"}, promote=True,
                     expect_latest=decision.get("root_latest", decision["champion"]))
        except LatestMoved as e:
            pending.unlink()  # judged against a champion that is gone: the next run re-compares
            log(f"error: {e}; nothing promoted, run again to compare against it")
            return EXIT_LATEST_MOVED
    os.replace(pending, run_dir / DECISION)
    log(json.dumps({"promoted": True, "reason": decision["reason"], "run_dir": str(run_dir)}))
    return EXIT_PROMOTED


def _log(msg: str) -> None:
    print(msg, file=sys.stderr if msg.startswith("error:") else sys.stdout)


def main(argv=None) -> int:
    cfg = parse_config(RetrainConfig, argv, "python -m training.retrain", __doc__.split("\n\n")[0],
                       aliases={"new_prompts": ["--logged"]})
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    try:
        return run(cfg, log=_log)
    except (ModelError, ValueError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
