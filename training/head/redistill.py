"""Re-distil the feature (EAGLE-3) head on logged prompts, behind a promotion gate (the Online
Speculative Decoding idea: the head keeps learning the traffic it serves).

    python -m training.head.redistill --config configs/redistill_eagle3.yaml

1. The logged prompts (`data/logged/*.jsonl`, read as training.decider.retrain reads them) split by
   `is_heldout(id, heldout_fraction)`. The target continues the training part (a corpus in
   the run dir, training.corpus.teacher.build_corpus: resumable) and, greedily, the held-out part.
2. A challenger is trained by training.draft.distill's eagle3 path (the Lightning module and data
   module, no other loop), warm-started from the champion (`model.warm_start`), on the new
   corpus plus `extra_corpora`, time-boxed (max_minutes / max_steps). The feature cache
   covers the corpora with THE CHAMPION'S vocabulary (`data.vocab_from`). The generated
   training config is `<run dir>/distill.yaml` (it runs by hand too).
3. Gate: both heads on the same held-out continuations, teacher-forced
   (training.bench.head.agreement, steps 1..depth). Score = mean accepted length of a greedy chain
   of depth `depth`, counted per position as the leading run of agreeing steps (conditioned
   exactly, not the product of per-step agreements, which assumes independence; exact for
   greedy continuations). Promote when the score is above the champion's and at least
   (1 + margin) times it, and step-1 agreement is at most step1_tolerance below. Then the
   serve gate (training/export/gate.py; decision.json's serve_check): vLLM must serve it as specstop.
4. Promotion: decision.pending.json, then the champion directory is swapped for a copy of the
   challenger (training.swap.replace_dir) if it still holds the head it was judged against,
   then decision.json. A re-run that finds a pending record completes it, never re-compares.
   The promoted head's marker records `redistilled_from` (the champion's fingerprint), so
   training.decider.retrain knows the decider fit for it belongs to the head it replaced.

Run dir: `<work>/<inputs>-<champion>/`: a hash of the prompts, this config, the target and
the extra corpora's manifests, then a hash of the champion directory's files. A re-run on
the same inputs exits 11 (also after a promotion: the champion is then that run's
challenger); a killed run resumes (corpus shards, the training's last.ckpt, an exported
challenger). After export the run's training checkpoints and its corpus's feature-cache
shards are deleted (3.5 kB per position; the challenger stays in the run dir).

Exit codes (as training.decider.retrain): 0 promoted | 10 champion kept | 11 up to date | 2 bad input
(one `error:` line) | 75 another run holds the lock, or the champion changed since it was
judged (run again) | 1 unexpected failure. The champion is untouched by every non-zero exit.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from training.head.redistill_config import RedistillConfig

EXIT_PROMOTED, EXIT_KEPT, EXIT_UP_TO_DATE, EXIT_BAD_INPUT, EXIT_LOCKED = 0, 10, 11, 2, 75
PENDING, DECISION, CHALLENGER = "decision.pending.json", "decision.json", "challenger"


def dir_sha(path: Path) -> str:
    """Hash of a directory's files (names and bytes): which head is there."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}\0".encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def inputs_key(cfg: RedistillConfig, prompts, target_info: dict) -> str:
    extra = {c: _file_sha(Path(c) / "manifest.json") for c in cfg.extra_corpora}
    ident = {"config": asdict(cfg), "prompts": [(p.id, p.text) for p in prompts],
             "target": target_info, "extra": extra}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def stored_dtype(head_dir: Path) -> str:
    """The dtype a head's weights are stored in (the challenger is exported in it too)."""
    from safetensors import safe_open

    with safe_open(str(head_dir / "model.safetensors"), framework="pt") as f:
        kind = f.get_slice("lm_head.weight").get_dtype()
    return {"F32": "float32", "F16": "float16"}.get(kind, "bfloat16")


def prior_run(work: Path, ikey: str, champ_sha: str) -> tuple[Path, str] | None:
    """(run dir, record name) of a run for these inputs that judged this champion, or whose
    promoted challenger it is (so a re-run after a promotion, or after a crash past the swap,
    finds its run although the champion's hash changed)."""
    for d in sorted(work.glob(f"{ikey}-*")):
        for name in (DECISION, PENDING):
            if (d / name).exists():
                dec = json.loads((d / name).read_text())
                if champ_sha == dec.get("champion_sha") or (
                        dec.get("promoted") and champ_sha == dec.get("challenger_sha")):
                    return d, name
    return None


def _hms(minutes: float) -> str:
    s = max(1, round(60 * minutes))
    return f"{s // 86400:02d}:{s % 86400 // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def distill_conf(cfg: RedistillConfig, run_dir: Path, corpus: Path, head) -> dict:
    """The base training config with this run's inputs and outputs pinned."""
    import yaml

    path = Path(cfg.distill_config)
    if not path.is_file():
        raise ValueError(f"distill config not found: {path}")
    conf = copy.deepcopy(yaml.safe_load(path.read_text()) or {})
    out = run_dir / "distill"
    run = conf.setdefault("run", {})
    run |= {"kind": "eagle3", "name": CHALLENGER, "drafts": str(run_dir), "export": True,
            "resume": True, "dtype": stored_dtype(Path(cfg.draft))}  # judged as it would serve
    if cfg.threads:
        run["threads"] = cfg.threads
    conf.setdefault("model", {}).update(target=cfg.target, warm_start=cfg.draft,
                                        rope_theta=float(head.config.rope_theta))
    conf.setdefault("data", {}).update(target=cfg.target, corpora=[str(corpus), *cfg.extra_corpora],
                                       vocab_from=cfg.draft, layers=list(head.config.aux_layers))
    tr = conf.setdefault("trainer", {})
    if cfg.max_minutes is not None:
        tr["max_time"] = _hms(cfg.max_minutes)
    if cfg.max_steps is not None:
        tr["max_steps"] = cfg.max_steps
    tr["default_root_dir"] = str(out)
    if isinstance(tr.get("logger"), dict) and "save_dir" in tr["logger"].get("init_args", {}):
        tr["logger"]["init_args"] |= {"save_dir": str(out), "name": CHALLENGER}
    ckpt = {"dirpath": str(out / "checkpoints"), "save_last": True, "enable_version_counter": False}
    cbs = [c for c in tr.get("callbacks") or [] if str(c.get("class_path", "")).endswith("ModelCheckpoint")]
    for c in cbs:
        c.setdefault("init_args", {}).update(ckpt)
    if not cbs:
        tr["callbacks"] = [*(tr.get("callbacks") or []), {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": ckpt | {"filename": "best", "monitor": "val/agree", "mode": "max"}}]
    return conf


def train_challenger(cfg: RedistillConfig, run_dir: Path, corpus: Path, head, log) -> int:
    """Train and export <run dir>/challenger (training.draft.distill's eagle3 path); 0 when done."""
    import yaml

    from training.head.train import fit

    conf = distill_conf(cfg, run_dir, corpus, head)
    path = run_dir / "distill.yaml"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(yaml.safe_dump(conf, sort_keys=False))
    os.replace(tmp, path)
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when it also sees our flags
    try:
        fit(["--config", str(path), *cfg.distill_overrides])
    except SystemExit as e:  # usage_error / the CLI already printed its line
        return EXIT_BAD_INPUT if e.code == 2 else 1
    finally:
        sys.argv = argv
    if not (run_dir / CHALLENGER / "specstop_draft.json").exists():
        log(f"error: training exported no challenger to {run_dir / CHALLENGER}")
        return 1
    shutil.rmtree(run_dir / "distill" / "checkpoints", ignore_errors=True)  # never resumed now
    root = Path((conf["data"].get("cache_root")) or ".cache/features")
    for d in root.glob(f"*/{corpus.name}-*"):  # this run's states: only its training read them
        shutil.rmtree(d, ignore_errors=True)
    return 0


def mark_lineage(challenger: Path, champion_fp: dict, run_name: str) -> None:
    """Record in the challenger's marker which head it was re-distilled from."""
    marker = challenger / "specstop_draft.json"
    meta = json.loads(marker.read_text())
    if "redistilled_from" not in meta:
        meta |= {"redistilled_from": champion_fp, "redistill_run": run_name}
        tmp = marker.with_name(f".{marker.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, marker)


def heldout_rows(corpus: Path) -> list[dict]:
    from training.corpus.teacher import load_corpus

    return [{"prompt_ids": r["prompt_ids"], "completion_ids": r["completion_ids"]}
            for r in load_corpus(corpus)]


def decide(champ: dict, chall: dict, cfg: RedistillConfig) -> tuple[bool, str]:
    a, b = champ["accepted_length"], chall["accepted_length"]
    if not (b > a and b >= a * (1 + cfg.margin)):
        return False, f"mean accepted length {b:.3f} is not {cfg.margin:.0%} above the champion's {a:.3f}"
    if chall["agree_step1"] < champ["agree_step1"] - cfg.step1_tolerance:
        return False, (f"step-1 agreement {chall['agree_step1']:.3f} below the champion's "
                       f"{champ['agree_step1']:.3f}")
    return True, "beats the champion on held-out prompts"


def load_target(cfg: RedistillConfig, teacher):
    """The teacher (writes the corpora) and the fp32 target the gate runs."""
    import torch

    from decoding.models import load_model

    from training.corpus.teacher import CorpusConfig, load_teacher
    from training.corpus.teacher import target_fingerprint

    if teacher is None:
        teacher = load_teacher(CorpusConfig(target=cfg.target, dtype=cfg.dtype))
        if cfg.dtype != "bfloat16":  # corpus manifests carry the bf16 load's identity
            teacher = replace(teacher, info=target_fingerprint(cfg.target))
    fp32 = next(teacher.model.parameters()).dtype == torch.float32
    return teacher, teacher.model if fp32 else load_model(cfg.target, "float32")


def run(cfg: RedistillConfig, teacher=None, log=print, prompts=None) -> int:  # prompts: a retrain's new ones
    from decoding.drafts.io import load_feature_draft
    from decoding.models import ModelError, fingerprint

    from training.corpus.teacher import CorpusConfig, build_corpus
    from training.logged import is_heldout, read_logged
    from training.export.gate import gate_promotion
    from training.shards import write_json
    from training.bench.head import agreement

    prompts = prompts if prompts is not None else read_logged(Path(cfg.new_prompts))
    champ = Path(cfg.draft)
    if not champ.is_dir():
        raise ModelError(f"champion head not found: {champ}")
    if not 1 <= cfg.depth <= 16:
        raise ValueError(f"depth must be in 1..16 (got {cfg.depth})")
    work = Path(cfg.work)
    work.mkdir(parents=True, exist_ok=True)
    with open(work / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            log(f"error: another redistill run holds {work / '.lock'}")
            return EXIT_LOCKED
        teacher, target = load_target(cfg, teacher)
        head = load_feature_draft(champ, target)  # refuses a non-head or another target's head
        champ_sha, ikey = dir_sha(champ), inputs_key(cfg, prompts, teacher.info)
        prior = prior_run(work, ikey, champ_sha)
        if prior is not None and prior[1] == DECISION:
            log(f"up to date: {prior[0]} already decided for these inputs")
            return EXIT_UP_TO_DATE
        if prior is not None:  # a promotion cut short: finish it, never re-compare
            return finish_promotion(champ, prior[0], json.loads((prior[0] / PENDING).read_text()), log)
        run_dir = work / f"{ikey}-{champ_sha[:12]}"
        held = [p for p in prompts if is_heldout(p.id, cfg.heldout_fraction)]
        train = [p for p in prompts if not is_heldout(p.id, cfg.heldout_fraction)]
        if not held or not train:
            raise ValueError(f"{len(prompts)} logged prompts give an empty train or held-out part: log more")
        run_dir.mkdir(exist_ok=True)
        write_json(run_dir / "config.json", {"config": asdict(cfg), "prompts": len(prompts),
                                             "champion": str(champ), "champion_sha": champ_sha})
        gen = CorpusConfig(target=cfg.target, dtype=cfg.dtype, batch_size=cfg.batch_size,
                           shard_size=cfg.shard_size, max_new_tokens=cfg.max_new_tokens)
        # named by the run: the feature cache keys shards by the corpus folder's name
        corpus, held_corpus = run_dir / f"logged-{ikey}", run_dir / "heldout"
        stats = {"train": build_corpus(replace(gen, out=str(corpus), temperature=cfg.temperature),
                                       teacher, train, progress=False),
                 "heldout": build_corpus(replace(gen, out=str(held_corpus), temperature=0.0),
                                         teacher, held, progress=False)}
        if not (run_dir / CHALLENGER / "specstop_draft.json").exists():
            rc = train_challenger(cfg, run_dir, corpus, head, log)
            if rc:
                return rc
        mark_lineage(run_dir / CHALLENGER, fingerprint(head), run_dir.name)
        rows, layers = heldout_rows(held_corpus), list(head.config.aux_layers)
        champ_m = agreement(target, head, rows, layers, cfg.depth)
        chall_m = agreement(target, load_feature_draft(run_dir / CHALLENGER, target), rows, layers, cfg.depth)
        promote, reason = decide(champ_m, chall_m, cfg)
        promote, reason, serve = gate_promotion(cfg, run_dir / CHALLENGER, rows, promote, reason, log)
        decision = {"promoted": promote, "reason": reason, "champion": str(champ),
                    "champion_sha": champ_sha, "challenger": str(run_dir / CHALLENGER),
                    "challenger_sha": dir_sha(run_dir / CHALLENGER), "champion_metrics": champ_m,
                    "challenger_metrics": chall_m, "serve_check": serve,
                    "prompts": {"train": len(train), "heldout": len(held)},
                    "corpus": stats, "decided": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if promote:
            write_json(run_dir / PENDING, decision)  # recorded before the swap it describes
            return finish_promotion(champ, run_dir, decision, log)
        write_json(run_dir / DECISION, decision)
        log(json.dumps({"promoted": False, "reason": reason, "run_dir": str(run_dir)}))
        return EXIT_KEPT


def finish_promotion(champ: Path, run_dir: Path, decision: dict, log=print) -> int:
    """Swap the champion directory for a copy of the challenger if it still holds the head it
    was judged against (already done when a crash came after the swap), then turn the pending
    record into decision.json."""
    from training.swap import replace_dir

    pending, now = run_dir / PENDING, dir_sha(champ) if champ.is_dir() else None
    if now != decision["challenger_sha"]:
        if now != decision["champion_sha"]:
            pending.unlink()  # judged against a head that is gone: the next run re-compares
            log(f"error: {champ} changed since it was judged; nothing promoted, run again")
            return EXIT_LOCKED
        tmp = Path(tempfile.mkdtemp(dir=champ.parent, prefix=f".{champ.name}.tmp-"))
        try:
            shutil.copytree(run_dir / CHALLENGER, tmp, dirs_exist_ok=True)
            os.chmod(tmp, 0o755)  # mkdtemp makes 0700: the head is a shared artifact
            replace_dir(tmp, champ)  # readers see the old head or the new one, never neither
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    os.replace(pending, run_dir / DECISION)
    log(json.dumps({"promoted": True, "reason": decision["reason"], "run_dir": str(run_dir)}))
    return EXIT_PROMOTED


def _log(msg: str) -> None:
    print(msg, file=sys.stderr if msg.startswith("error:") else sys.stdout)


def execute(cfg: RedistillConfig, teacher=None, log=_log, prompts=None) -> int:
    """run() with bad input and failures turned into exit codes and one `error:` line."""
    from decoding.models import ModelError

    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    try:
        return run(cfg, teacher, log, prompts)
    except (ModelError, ValueError) as e:
        log(f"error: {str(e).splitlines()[0]}")
        return EXIT_BAD_INPUT
    except OSError as e:
        log(f"error: {e}")
        return 1


def load_config(path: str) -> RedistillConfig:
    """A redistill config file (ValueError with one line when it is unusable)."""
    from training.config_flags import parse_config

    try:
        return parse_config(RedistillConfig, ["--config", str(path)], "python -m training.head.redistill")
    except SystemExit as e:
        raise ValueError(str(e.code).removeprefix("error: ")) from None


def main(argv=None) -> int:
    from training.config_flags import parse_config

    cfg = parse_config(RedistillConfig, argv, "python -m training.head.redistill", __doc__.split("\n\n")[0])
    return execute(cfg)


if __name__ == "__main__":
    sys.exit(main())
