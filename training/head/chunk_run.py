"""A run's committed chunks (training.head.chunks) during and between sessions.

ChunkWriter writes the latest chunk every `every_minutes` of training and when the session ends
(run.session_minutes, trainer.max_steps or max_time), right after an optimizer step (Lightning's
on_train_batch_end: the state ModelCheckpoint's every_n_train_steps saves too). Each chunk is
scored on a fixed held-out subset (the first `heldout_rows` rows of the data's validation slice,
never trained on) beside the shipped head on the same rows (training.bench.head.agreement,
paired bootstrap intervals); the best chunk by held-out step-1 agreement is exported as a head
to <run>/best/. The shipped head is never replaced here: only the gate promotes
(python -m training.head.redistill, training/export/gate.py).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from training.head import chunks as C
from training.shards import write_text

BEST = "best"
LATEST = "latest"


def heldout_rows(data, n: int) -> list[dict]:
    """The first n rows of the validation slice as training.bench.head rows (prompt and target
    completion ids; index ids, so two heads are paired on the same rows)."""
    out = []
    for i, r in enumerate(data.val_rows[:n]):
        x = data._load(r)
        ids, s = x["ids"].tolist(), int(x["label_start"])
        out.append({"prompt_id": f"val-{i}", "prompt_ids": ids[: s + 1], "completion_ids": ids[s + 1:]})
    return out


def score(target, head, rows: list[dict], layers: list[int], steps: int) -> dict:
    from training.bench.head import agreement, bootstrap

    was = head.training
    head.eval()
    try:
        res = agreement(target, head, rows, layers, steps=steps)
    finally:
        head.train(was)
    return res | {"ci95": bootstrap(res)}


def _short(res: dict) -> dict:
    return {k: v for k, v in res.items() if k != "per_prompt"}


class ChunkWriter(Callback):
    def __init__(self, folder: Path, identity: dict, meta: dict, every_minutes: float | None = None,
                 session_minutes: float | None = None, session_steps: int | None = None, moments: str = "float32", shard_mib: float = 15,
                 heldout: int = 64, baseline: str | None = None, log=print):
        self.folder, self.identity, self.meta = Path(folder), identity, meta
        self.session_steps = session_steps
        self.every, self.session, self.moments, self.shard_mib = every_minutes, session_minutes, moments, shard_mib
        self.heldout, self.baseline, self.say = heldout, baseline, log
        self.t0 = self.last = None
        self.written_step = -1
        self._rows, self._base = None, None

    # --- when ------------------------------------------------------------------------------------
    def on_train_start(self, trainer, module) -> None:
        self.t0 = self.last = time.monotonic()
        self.written_step = self.start_step = trainer.global_step  # the state it started from is written already

    def _ending(self, trainer) -> bool:
        from lightning.pytorch.callbacks import Timer

        if self.session is not None and time.monotonic() - self.t0 >= self.session * 60:
            trainer.should_stop = True  # the session's minutes, not the run's: the next session continues
            return True
        if self.session_steps is not None and trainer.global_step - self.start_step >= self.session_steps:
            trainer.should_stop = True
            return True
        if 0 < trainer.max_steps <= trainer.global_step:
            return True
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        return trainer.should_stop or (timer is not None and timer._duration is not None
                                       and (timer.time_remaining("train") or 0) <= 0)

    def on_train_batch_end(self, trainer, module, outputs, batch, idx) -> None:
        ending = self._ending(trainer)
        due = self.every is not None and time.monotonic() - self.last >= self.every * 60
        if (ending or due) and trainer.global_step > self.written_step:
            self.write(trainer, module)

    def on_train_end(self, trainer, module) -> None:
        if trainer.global_step > self.written_step:  # stopped elsewhere (an epoch limit)
            self.write(trainer, module)

    # --- what ------------------------------------------------------------------------------------
    def evaluate(self, trainer, module) -> dict | None:
        if not self.heldout:
            return None
        from training.bench.head import bootstrap

        dm, steps = trainer.datamodule, min(4, module.hp["steps"])
        target = module.target()
        target.to(module.head.used_ids.device)
        if self._rows is None:
            self._rows = heldout_rows(dm, self.heldout)
        res = score(target, module.head, self._rows, dm.layers, steps)
        out = {"rows": len(self._rows), "steps": steps, "source": "the first rows of the validation slice",
               "chunk": res}
        if self.baseline and Path(self.baseline).is_dir():
            if self._base is None:  # the shipped head does not change during a run: scored once
                from decoding.drafts.io import load_feature_draft

                head = load_feature_draft(self.baseline, target, device=str(target.device)).float()
                self._base = score(target, head, self._rows, list(head.config.aux_layers), steps)
            out["shipped"] = {"head": self.baseline} | self._base
            out["vs_shipped"] = bootstrap(res, self._base)
        return out

    def write(self, trainer, module) -> Path:
        t = time.monotonic()
        held = self.evaluate(trainer, module)
        ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        loader = (ckpt.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader") or [{}])[0]
        meta = self.meta | {"identity": self.identity, "global_step": trainer.global_step,
                            "epoch": trainer.current_epoch, "data_position": loader,
                            "written": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                            "device": str(module.device), "precision": str(trainer.precision),
                            "heldout": held}
        out = C.write_chunk(self.folder / LATEST, ckpt, meta, self.moments, self.shard_mib)
        self.written_step, self.last = trainer.global_step, time.monotonic()
        best = self.keep_best(module, meta) if held else False
        a1 = held and held["chunk"]["agree_step1"]
        self.say(f"chunk: step {trainer.global_step} -> {out}" + (f" (held-out step-1 agreement {a1:.4f}"
                 + (", the best so far" if best else "") + ")" if held else "")
                 + f" in {time.monotonic() - t:.0f} s")
        return out

    def keep_best(self, module, meta: dict) -> bool:
        """Export the chunk's head to <run>/best/ when its held-out step-1 agreement beats the
        best chunk's so far (best.json says which chunk that is)."""
        from decoding.drafts.io import save_feature_draft

        pointer = self.folder / f"{BEST}.json"
        now = meta["heldout"]["chunk"]["agree_step1"]
        old = json.loads(pointer.read_text()) if pointer.is_file() else None
        if old is not None and old.get("agree_step1", -1) >= now:
            return False
        head = copy.deepcopy(module.head).to("cpu", torch.bfloat16).eval()
        dm = module.trainer.datamodule
        info = {"dtype": "bfloat16", "corpus_target": self.identity["target"],
                "data": {"corpora": dm.corpora, "vocab_sha256": dm.vocab.sha256(),
                         "vocab_coverage": dm.vocab.coverage, "window": dm.window},
                "training": module.hp | {"chunk_step": meta["global_step"]},
                "metrics": {"heldout": {k: _short(v) if isinstance(v, dict) and "per_prompt" in v else v
                                        for k, v in meta["heldout"].items()}}}
        save_feature_draft(head, self.folder / BEST, module.target(), info)
        short = {k: v for k, v in meta["heldout"].items() if k in ("rows", "steps")}
        write_text(pointer, json.dumps({"global_step": meta["global_step"], "agree_step1": now,
                                        "dir": BEST, "heldout": short,
                                        "vs_shipped": meta["heldout"].get("vs_shipped")}, indent=1) + "\n")
        return True


def resume_path(chunk: Path, last: Path, identity: dict) -> str | None:
    """The checkpoint a run continues from: its last.ckpt (this machine's session) or the
    committed chunk, whichever is further; the chunk must be this run's (ChunkError)."""
    from training.config_flags import ckpt_metrics

    doc = C.read_meta(chunk)
    if doc is not None:
        C.check_identity(doc, identity, chunk)
        was, now = (d.get("trainer", {}).get("max_steps") for d in (doc.get("identity") or {}, identity))
        if was != now:
            print(f"distill: the wsd run {chunk.parent.name} goes on as {now} steps (planned as {was}; "
                  f"step {doc['global_step']} is before the decay under both)", file=sys.stderr)
    here = ckpt_metrics(str(last))["global_step"] if last.exists() else -1
    if doc is None or doc["global_step"] <= here:
        return str(last) if last.exists() else None
    print(f"distill: continuing from the committed chunk {chunk} (step {doc['global_step']})",
          file=sys.stderr)
    return str(C.to_lightning(chunk, last.with_name("chunk-resume.ckpt")))
