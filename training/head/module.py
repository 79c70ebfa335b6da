"""LightningModule training the feature (EAGLE-3) head with training-time test.

Step j (0-based) of the unroll, at position t, reads the token t+1+j and (j = 0) the target's
fused three-layer state at t, or (j > 0) the head's own pre-norm output of step j-1, and
predicts the token t+2+j: its label is the target's distribution at position t+1+j,
restricted to the draft vocabulary (top-k soft labels). Loss = sum_j decay^j * soft
cross-entropy, masked where the target's argmax is outside the draft vocabulary. Logged per
step: top-1 agreement with the target's full-vocabulary argmax (train and validation,
general / code), which is the teacher-forced agreement of draft step j+1.
"""

from __future__ import annotations

import math
import time

import lightning as L
import torch
import torch.nn.functional as F

from training.draft.accept_metrics import LOSSES, combine, expected_acceptance, walk_sd


def shift(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x[:, t + n] at position t (dim 1), `fill` past the end."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def step_loss(head, h: torch.Tensor, batch: dict, j: int, skip: int = 0, loss: str = "soft_ce",
              temperature: float = 0.7, lk: tuple[float, float] = (1.0, 3.0)
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, per-position agreement [n], expected acceptance at `temperature` [n], their mask
    over the batch) for step j, whose pre-norm outputs `h` cover indices skip.. (0 for step 0).
    The output layer runs on the labelled rows only. loss: accept_metrics.LOSSES; lk: its
    (kl_scale, kl_decay)."""
    m = shift(batch["lab_mask"], 1 + j, False)
    if j:
        m[:, :skip] = False
    top1 = shift(batch["top1"], 1 + j, 0)[m]
    lq = F.log_softmax(head.head(h[m[:, skip if j else 0:]]).float(), -1)
    ids, lp = shift(batch["lab_ids"], 1 + j, 0)[m], shift(batch["lab_logp"], 1 + j, float("-inf"))[m]
    inside = head.t2d[top1]
    ce = -(lp.exp() * lq.gather(1, ids)).sum(-1)
    accept = expected_acceptance(ids, lp, lq, temperature)
    total = combine(loss, ce, accept, inside.float(), *lk)
    agree = (head.used_ids[lq.argmax(-1)] == top1).float()
    return total, agree, accept.detach(), m


def wsd_factor(step: int, total: int, warmup_steps: int, decay_steps: int, floor: float) -> float:
    """Warmup-stable-decay: linear up over `warmup_steps`, the full lr, then the last
    `decay_steps` of `total` down to `floor` as 1 - sqrt (the WSD schedule of MiniCPM). Before its
    decay the factor does not depend on `total`: a run can be made longer while it is there."""
    if step < warmup_steps:
        return max(step / warmup_steps, 1e-3)
    start = total - decay_steps
    if step < start:
        return 1.0
    frac = min(1.0, (step - start) / max(1, decay_steps))
    return floor + (1 - floor) * (1 - math.sqrt(frac))


def unroll_skip(batch: dict, steps: int) -> int:
    """Leading indices no step >= 1 needs: step j's label at t is the token t + 2 + j, and no
    row labels a token before its label_start + 1."""
    return max(0, int(batch["label_start"].min()) - steps)


def resolve_teacher_dtype(name: str, device: torch.device) -> str:
    """auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16, AMX), else float32."""
    if name != "auto":
        return name
    from decoding.forward.cpu import native_bf16

    return "bfloat16" if torch.device(device).type == "cuda" or native_bf16() else "float32"


class FeatureDistillModule(L.LightningModule):
    def __init__(self, target: str | None = None, steps: int = 5, step_decay: float = 0.8,
                 lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.0, warmup_ratio: float = 0.015, min_lr_ratio: float = 0.1,
                 schedule: str = "time", rope_theta: float | None = None, init: str = "target",
                 freeze_output: bool = False, warm_start: str | None = None,
                 loss: str = "soft_ce", accept_temperature: float = 0.7, lk_kl_scale: float = 1.0,
                 lk_kl_decay: float = 3.0, teacher_dtype: str = "float32",
                 warmup_steps: int | None = None, decay_steps: int | None = None):
        """Args:
            target: target model dir (None = embedded SmolLM2): the head's shapes, frozen
                embedding, initial weights and (source online) the prefill.
            steps: training-time-test unroll depth (EAGLE-3: 7; 3-7 is the useful range).
            step_decay: weight of step j is step_decay ** j.
            lr, betas, weight_decay: AdamW.
            warmup_ratio: linear warm-up over this share of the schedule (time, steps).
            min_lr_ratio: the schedule's floor (share of lr).
            schedule: time (cosine over the share of trainer.max_time spent: a time-boxed run
                ends at the floor, also after a resume) | steps (cosine over the estimated
                steps) | wsd (warmup_steps up, the full lr, the last decay_steps of
                trainer.max_steps down: a run on a growing corpus can be lengthened while it
                is before its decay, training.head.chunks.longer_wsd).
            warmup_steps, decay_steps: the wsd schedule's ramps, in optimizer steps (wsd only).
            rope_theta: RoPE base of the head (None: the target's own); recorded on export.
            init: target (every layer from the target: fc passes the highest captured layer
                through, the midlayer copies the target's last layer) | output (only the
                output layer and final norm from the target, fc and midlayer freshly
                initialised: the passthrough predicts the NEXT token, not the one after it,
                so it starts confidently wrong).
            freeze_output: keep lm_head and the final norm at the target's values (the head
                then learns to produce the target's own output features; fewer parameters).
            warm_start: an exported feature-head directory to start from instead of `init`
                (how a run continues on another machine or in a later session: runs/ is
                git-ignored, the exported head is committed). Its vocabulary and aux layers
                must be the data's; optimiser and schedule start afresh.
            loss: soft_ce | lk_alpha | lk_lambda (training.draft.accept_metrics).
            accept_temperature: the sampling temperature of the logged expected acceptance
                (val/accept_J) and of the LK losses: the one decoding will serve.
            lk_kl_scale, lk_kl_decay: lk_lambda's CE weight, kl_scale * exp(-kl_decay * acceptance).
            teacher_dtype: dtype of the online prefill (features and labels): float32 | bfloat16 |
                auto (bfloat16 on CUDA and on CPUs that compute it natively, where it runs ~3x
                float32's speed; float32 elsewhere). The head, its shared embedding and its
                optimiser stay float32 whichever is chosen.
        """
        super().__init__()
        if not 1 <= steps <= 16:
            raise ValueError(f"steps must be in 1..16 (got {steps})")
        if init not in ("target", "output"):
            raise ValueError(f"init must be target or output (got {init!r})")
        if schedule not in ("time", "steps", "wsd"):
            raise ValueError(f"schedule must be time, steps or wsd (got {schedule!r})")
        if (schedule == "wsd") != (warmup_steps is not None and decay_steps is not None):
            raise ValueError("warmup_steps and decay_steps go with schedule: wsd, and it needs both")
        if schedule == "wsd" and (warmup_steps < 1 or decay_steps < 1):
            raise ValueError(f"warmup_steps and decay_steps must be >= 1 (got {warmup_steps}, {decay_steps})")
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)} (got {loss!r})")
        if teacher_dtype not in ("float32", "bfloat16", "auto"):
            raise ValueError(f"teacher_dtype must be float32, bfloat16 or auto (got {teacher_dtype!r})")
        if accept_temperature <= 0:
            raise ValueError(f"accept_temperature must be > 0 (got {accept_temperature})")
        self.hp = {"target": target, "steps": steps, "step_decay": step_decay, "lr": lr,
                   "betas": list(betas), "weight_decay": weight_decay, "warmup_ratio": warmup_ratio,
                   "min_lr_ratio": min_lr_ratio, "schedule": schedule, "rope_theta": rope_theta,
                   "init": init, "freeze_output": freeze_output, "warm_start": warm_start,
                   "loss": loss, "accept_temperature": accept_temperature,
                   "lk_kl_scale": lk_kl_scale, "lk_kl_decay": lk_kl_decay,
                   "teacher_dtype": teacher_dtype}
        if schedule == "wsd":  # only here: the other schedules' runs keep the identity they had
            self.hp |= {"warmup_steps": warmup_steps, "decay_steps": decay_steps}
        self.head = None  # built in setup(): its vocabulary comes from the data
        self._target: list = []  # out of the module tree: never saved, never trained
        self._teacher: dict = {}  # the online prefill's copy per dtype other than float32
        self._progress, self.t_start = 0.0, None
        self.layers, self.online_k = None, 32  # set from the data in setup()

    # --- construction ----------------------------------------------------------------------
    def target(self):
        if not self._target:
            from decoding.models import load_model

            self._target.append(load_model(self.hp["target"], "float32").requires_grad_(False))
        return self._target[0]

    def teacher(self, device: torch.device):
        """The target that runs the online prefill, in teacher_dtype resolved for `device`."""
        dtype = resolve_teacher_dtype(self.hp.get("teacher_dtype", "float32"), device)
        if dtype == "float32":
            return self.target()
        if dtype not in self._teacher:
            from decoding.models import load_model

            self._teacher[dtype] = load_model(self.hp["target"], dtype).requires_grad_(False)
        return self._teacher[dtype]

    def build_head(self, layers: list[int], used: torch.Tensor, init: bool = True):
        from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig

        t = self.target()
        self.layers = list(layers)
        cfg = FeatureDraftConfig.for_target(t, draft_vocab_size=len(used), aux_layers=layers)
        if self.hp["rope_theta"] is not None:
            cfg.rope_theta = float(self.hp["rope_theta"])
        head = FeatureDraft(cfg, t.get_input_embeddings().weight)
        if init and self.hp.get("warm_start"):
            head = self._warm_start(cfg, used)
        elif init:
            (head.init_from_target if self.hp["init"] == "target" else head.init_output)(t, used)
        self.head = head
        self.hp["head"] = cfg.to_dict()
        self.freeze()
        return head

    def _warm_start(self, cfg, used: torch.Tensor):
        from decoding.drafts.io import load_feature_draft

        head = load_feature_draft(self.hp["warm_start"], self.target())  # refuses another target
        if head.config.aux_layers != cfg.aux_layers or not torch.equal(head.used_ids.cpu(), used.cpu()):
            raise ValueError(f"warm_start {self.hp['warm_start']}: its aux layers or draft vocabulary "
                             "differ from the data's (same cache settings and corpora needed)")
        if head.config.rope_theta != cfg.rope_theta:
            raise ValueError(f"warm_start {self.hp['warm_start']}: rope_theta {head.config.rope_theta} "
                             f"!= {cfg.rope_theta}")
        return head.float().train()

    def freeze(self) -> None:
        """freeze_output: lm_head and the final norm stay the target's (not trained)."""
        frozen = self.hp.get("freeze_output", False)
        for p in (*self.head.lm_head.parameters(), *self.head.norm.parameters()):
            p.requires_grad_(not frozen)

    def setup(self, stage: str) -> None:
        dm = self.trainer.datamodule
        if self.head is None:
            self.build_head(dm.layers, dm.vocab.used)
        if stage == "fit" and getattr(dm, "train_rows", None):  # a resume extends the window
            self.hp["trained_window"] = max(self.hp.get("trained_window", 0), dm.window)
        self.online_k = self.trainer.datamodule.k

    def on_save_checkpoint(self, ckpt: dict) -> None:
        ckpt["specstop_hparams"] = self.hp  # plain JSON types: loads with weights_only=True

    # --- loss ------------------------------------------------------------------------------
    @torch.no_grad()
    def _online(self, batch: dict) -> dict:
        from training.head.cache import target_batch

        used, target = self.head.used_ids, self.teacher(batch["input_ids"].device)
        if target.device != batch["input_ids"].device:  # outside the module tree: Lightning never moves it
            target.to(batch["input_ids"].device)
        out = target_batch(target, batch["input_ids"], batch["attention_mask"],
                           batch["label_start"], self.layers, used, self.online_k)
        return batch | out

    def _step(self, batch: dict):
        if "feats" not in batch:
            batch = self._online(batch)
        skip = unroll_skip(batch, self.hp["steps"])
        outs = self.head.unroll(batch["input_ids"], batch["feats"], self.hp["steps"],
                                batch["attention_mask"], skip=skip, logits=False)
        total, per, hp = 0.0, [], self.hp
        for j, (_, h) in enumerate(outs):
            loss, agree, accept, m = step_loss(
                self.head, h, batch, j, skip, hp.get("loss", "soft_ce"),
                hp.get("accept_temperature", 0.7), (hp.get("lk_kl_scale", 1.0), hp.get("lk_kl_decay", 3.0)))
            total = total + hp["step_decay"] ** j * loss
            per.append((loss, agree, batch["code"][:, None].expand_as(m)[m], accept, m))
        return total, per

    def training_step(self, batch: dict, idx: int):
        if self.t_start is None:
            self.t_start = time.time()
        loss, per = self._step(batch)
        n = int(batch["lab_mask"].sum()) if "lab_mask" in batch else None
        self.log("train/loss", loss, prog_bar=True, batch_size=n)
        for j, (_, agree, *_) in enumerate(per):
            self.log(f"train/agree_{j + 1}", agree.mean(), prog_bar=j == 0, batch_size=len(agree))
        self.log("train/positions", float(batch["attention_mask"].sum()), reduce_fx="sum")
        return loss

    def on_validation_epoch_start(self) -> None:
        # [step, kind (code, general), (positions, agree sum, loss sum, acceptance sum)]
        self._val = torch.zeros(self.hp["steps"], 2, 4, dtype=torch.float64)
        self._walk = torch.zeros(2, dtype=torch.float64)  # greedy sd rounds, tokens they commit

    def validation_step(self, batch: dict, idx: int) -> None:
        _, per = self._step(batch)
        hits = []
        for j, (loss, agree, code, accept, m) in enumerate(per):
            for c, sel in enumerate((code, ~code)):
                self._val[j, c] += torch.tensor([float(sel.sum()), float(agree[sel].sum()),
                                                 float(loss) * float(sel.sum()),
                                                 float(accept[sel].sum())], dtype=torch.float64)
            hits.append(torch.zeros_like(m).masked_scatter(m, agree.bool()))
        # a chain of `steps` drafts walked from each row's first label, as training.bench.head does
        self._walk += walk_sd([h.cpu() for h in hits], per[-1][4].cpu(), batch["label_start"].tolist()).sum(0)

    def on_validation_epoch_end(self) -> None:
        tot = self.trainer.strategy.reduce(self._val.to(self.device), reduce_op="sum").cpu()
        out = {}
        for j in range(self.hp["steps"]):
            both = tot[j].sum(0)
            out[f"val/agree_{j + 1}"] = both[1] / both[0].clamp_min(1)
            out[f"val/loss_{j + 1}"] = both[2] / both[0].clamp_min(1)
            out[f"val/accept_{j + 1}"] = both[3] / both[0].clamp_min(1)
            for c, name in enumerate(("code", "general")):
                out[f"val/agree_{j + 1}_{name}"] = tot[j, c, 1] / tot[j, c, 0].clamp_min(1)
        walk = self.trainer.strategy.reduce(self._walk.to(self.device), reduce_op="sum").cpu()
        out["val/sd_tokens_per_call"] = walk[1] / walk[0].clamp_min(1)
        out["val/agree"] = out["val/agree_1"]  # the checkpoint monitor
        timer = self._timer()
        secs = timer.time_elapsed("train") if timer is not None else (
            0.0 if self.t_start is None else time.time() - self.t_start)
        out["train_minutes"] = torch.tensor(secs / 60)
        for k, v in out.items():
            self.log(k, v.float(), prog_bar=k == "val/agree")

    # --- optimiser -------------------------------------------------------------------------
    def _timer(self):
        from lightning.pytorch.callbacks import Timer

        timer = next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None)
        return timer if timer is not None and timer._duration else None

    def on_train_start(self) -> None:
        from training.head.data import restore_position

        restore_position(self.trainer)  # a resumed run goes on with the epoch's next unseen batch

    def on_train_batch_start(self, batch, idx: int) -> None:
        timer = self._timer() if self.hp["schedule"] == "time" else None
        if timer is not None:
            frac = (timer.time_elapsed("train") or 0.0) / timer._duration
            self._progress = float(self.trainer.strategy.broadcast(frac, src=0))

    def configure_optimizers(self):
        params = [p for p in self.head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.hp["lr"], betas=tuple(self.hp["betas"]),
                                weight_decay=self.hp["weight_decay"])
        timed = self.hp["schedule"] == "time" and self._timer() is not None
        total = 1 if timed else max(1, int(self.trainer.estimated_stepping_batches))
        if self.hp["schedule"] == "wsd" and not 0 < self.hp["decay_steps"] < self.trainer.max_steps:
            raise ValueError(f"schedule wsd needs trainer.max_steps above decay_steps "
                             f"({self.hp['decay_steps']}; got max_steps {self.trainer.max_steps})")
        warm_frac, floor = self.hp["warmup_ratio"], self.hp["min_lr_ratio"]

        def factor(step: int) -> float:
            if self.hp["schedule"] == "wsd":
                return wsd_factor(step, total, self.hp["warmup_steps"], self.hp["decay_steps"], floor)
            frac = min(1.0, self._progress) if timed else min(1.0, step / total)
            if frac < warm_frac:
                return max(frac / warm_frac, 1e-3)
            frac = (frac - warm_frac) / max(1e-9, 1 - warm_frac)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def load_feature_module(ckpt) -> FeatureDistillModule:
    """Rebuild the module from a checkpoint, reading only tensors and plain types (the head's
    token embeddings are the target's: loaded from model.target, never stored)."""
    from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig

    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    hp = dict(state["specstop_hparams"])
    head_cfg, window = hp.pop("head"), hp.pop("trained_window", None)
    module = FeatureDistillModule(**hp)
    if window is not None:
        module.hp["trained_window"] = window
    cfg = FeatureDraftConfig.from_dict(head_cfg)
    module.head = FeatureDraft(cfg, module.target().get_input_embeddings().weight)
    module.hp["head"], module.layers = head_cfg, list(cfg.aux_layers)
    module.load_state_dict(state["state_dict"])
    module.freeze()
    return module
