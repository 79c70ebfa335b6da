"""Distillation of a draft toward the target: losses, draft construction, LightningModule.

Teacher signal = the target's top-k log-probs + one "rest" bucket per completion token
(cached, see training.draft.teacher_cache, or computed on the fly). KL / TV are computed over
those k + 1 buckets; teacher top-k tokens the draft's (pruned) head cannot emit merge into
the rest bucket, so every loss stays finite and exact on the coarser partition.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import lightning as L
import torch
import torch.nn.functional as F

from decoding.models import PrunedHead, PrunedHeadLlamaConfig, PrunedHeadLlamaForCausalLM

LOSSES = ("fkl", "rkl", "tv", "ce")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class DraftConfig:
    init: str = "new"
    """new = a fresh small Llama built from the fields below; else an HF draft dir to fine-tune."""
    layers: int = 2
    """Decoder layers of a new draft."""
    hidden: int = 256
    """Width of a new draft."""
    heads: int = 4
    """Attention heads of a new draft."""
    intermediate: int = 1024
    """MLP width of a new draft."""
    head_size: int | None = 16384
    """Token ids the new draft's output layer scores (most frequent first); None = all."""
    embed_init: str = "svd"
    """svd = project the target's embedding to `hidden` dims (its top singular directions: a warm start that keeps the target's token geometry) | random."""
    lora: bool = False
    """Fine-tune an existing draft (init = DIR) with a peft LoRA adapter instead of fully."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: int = 32
    """LoRA scaling numerator."""
    grow_layers: int = 0
    """Fine-tuning an existing draft: append this many decoder layers that start as the
    identity (zero output projections), so the warm start keeps its function and the new
    depth adds capacity (depth is cheap at serving time; width is not)."""
    reselect_head: bool = False
    """Fine-tuning an existing pruned-head draft: re-pick its output ids from this run's data
    (free with tied embeddings: the head is a row selection of the embedding)."""


def svd_embedding(weight: torch.Tensor, width: int) -> torch.Tensor:
    """[V, width]: rows of `weight` projected on its top `width` right singular vectors."""
    w = weight.float()
    if width >= w.shape[1]:
        return F.pad(w, (0, width - w.shape[1]))
    _, vecs = torch.linalg.eigh(w.T @ w)  # ascending eigenvalues; V is small (H x H)
    return w @ vecs[:, -width:].flip(-1)


def select_head_ids(counts, vocab: int, size: int, always=(), among=None) -> torch.Tensor:
    """The `size` most frequent ids of `among` (default: the whole vocabulary), `always` ones
    first (ties and unseen ids: lowest id first, i.e. BPE order)."""
    score = torch.zeros(vocab, dtype=torch.float64)
    for tok, n in counts.items():
        score[tok] = n
    for tok in always:
        score[tok] = float("inf")
    order = sorted(range(vocab) if among is None else among, key=lambda i: (-score[i].item(), i))
    return torch.tensor(sorted(order[:size]))


def grow_layers(model, n: int) -> None:
    """Append n identity-initialised decoder layers to a Llama-style causal LM, in place."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    conf, layers = model.config, model.model.layers
    ref = next(model.parameters())
    for _ in range(n):
        layer = LlamaDecoderLayer(conf, len(layers))
        for mod in layer.modules():
            if isinstance(mod, torch.nn.Linear):
                torch.nn.init.normal_(mod.weight, std=conf.initializer_range)
        with torch.no_grad():  # residual branches output 0: the layer is the identity
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        layers.append(layer.to(device=ref.device, dtype=ref.dtype))
    conf.num_hidden_layers = len(layers)


def new_draft(target_config, cfg: DraftConfig) -> PrunedHeadLlamaForCausalLM:
    from decoding.models import small_draft_config

    base = small_draft_config(target_config, cfg.layers, cfg.hidden, cfg.heads, cfg.intermediate)
    conf = PrunedHeadLlamaConfig(head_size=cfg.head_size, **base.to_dict())
    return PrunedHeadLlamaForCausalLM(conf)


def bucket_loss(logits: torch.Tensor, head_ids: torch.Tensor | None, t_ids: torch.Tensor,
                t_logp: torch.Tensor, targets: torch.Tensor, kind: str) -> tuple[torch.Tensor, dict]:
    """Loss over k+1 buckets and per-position stats ([N] agree, [N] accept).

    logits: [N, K] student logits over `head_ids` (None = the full vocabulary, K = V).
    t_ids / t_logp: [N, k] teacher top-k; targets: [N] corpus tokens (for `ce`).
    """
    lq_all = F.log_softmax(logits.float(), dim=-1)
    if head_ids is None:
        sidx, valid = t_ids, torch.ones_like(t_ids, dtype=torch.bool)
        tgt, tgt_ok = targets, torch.ones_like(targets, dtype=torch.bool)
    else:
        full2s = torch.full((int(head_ids.max()) + 2,), -1, dtype=torch.long, device=logits.device)
        full2s[head_ids] = torch.arange(len(head_ids), device=logits.device)
        lookup = lambda x: full2s[x.clamp(max=len(full2s) - 1)]  # ids beyond the table: -1
        sidx, tgt = lookup(t_ids), lookup(targets)
        valid, tgt_ok = sidx >= 0, tgt >= 0
    lq = lq_all.gather(1, sidx.clamp_min(0)).masked_fill(~valid, float("-inf"))
    lp = t_logp.float().masked_fill(~valid, float("-inf"))
    p, q = lp.exp(), lq.exp()
    p_rest = (1 - p.sum(-1, keepdim=True)).clamp_min(1e-6)
    q_rest = (1 - q.sum(-1, keepdim=True)).clamp_min(1e-6)
    P, Q = torch.cat([p, p_rest], -1), torch.cat([q, q_rest], -1)
    LP, LQ = torch.cat([lp, p_rest.log()], -1), torch.cat([lq, q_rest.log()], -1)
    if kind == "fkl":
        per = torch.where(P > 0, P * (LP - LQ.clamp_min(-1e4)), 0.0).sum(-1)
    elif kind == "rkl":
        per = torch.where(Q > 0, Q * (LQ - LP.clamp_min(-1e4)), 0.0).sum(-1)
    elif kind == "tv":
        per = 0.5 * (P - Q).abs().sum(-1)
    elif kind == "ce":
        per = -lq_all.gather(1, tgt.clamp_min(0)[:, None])[:, 0] * tgt_ok
    else:
        raise ValueError(f"unknown loss {kind!r}; choose from {', '.join(LOSSES)}")
    pred = lq_all.argmax(-1)
    pred = pred if head_ids is None else head_ids[pred]
    stats = {"agree": (pred == t_ids[:, 0]).float(), "accept": torch.minimum(p, q).sum(-1)}
    return per.mean(), stats


class DistillModule(L.LightningModule):
    def __init__(self, draft: DraftConfig | None = None, loss: str = "fkl", ce_weight: float = 0.0,
                 target: str | None = None, lr: float = 2e-3, weight_decay: float = 0.01,
                 warmup_steps: int = 100, min_lr_ratio: float = 0.05, k: int = 64,
                 on_policy_every: int = 0, on_policy_tokens: int = 32, seed: int = 0,
                 schedule: str = "time"):
        """Args:
            draft: the student (new small Llama, or an HF dir fine-tuned fully / with LoRA).
            loss: fkl | rkl | tv | ce (cross-entropy on the corpus tokens).
            ce_weight: extra weight of `ce` added to a KD loss (0 = pure KD).
            target: target model dir (None = embedded SmolLM2); used for the SVD init and,
                with an online teacher or on-policy batches, to score on the fly.
            lr, weight_decay, warmup_steps, min_lr_ratio: AdamW + linear warmup + cosine.
            k: teacher top-k buckets when scoring on the fly.
            on_policy_every: every n-th training batch is on-policy (DistillSpec): the student
                samples `on_policy_tokens` tokens after a corpus prefix and the target scores
                them; 0 = off.
            on_policy_tokens: tokens the student samples per on-policy row.
            seed: on-policy sampling seed.
            schedule: cosine decay over the fraction of trainer.max_time spent (time: a
                time-boxed run always ends at the low learning rate, also after a resume)
                or over trainer.estimated_stepping_batches (steps).
        """
        super().__init__()
        self.cfg = draft or DraftConfig()
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; choose from {', '.join(LOSSES)}")
        self.hp = {"draft": asdict(self.cfg), "loss": loss, "ce_weight": ce_weight,
                   "target": target, "lr": lr, "weight_decay": weight_decay,
                   "warmup_steps": warmup_steps, "min_lr_ratio": min_lr_ratio, "k": k,
                   "on_policy_every": on_policy_every, "on_policy_tokens": on_policy_tokens,
                   "seed": seed, "schedule": schedule}
        if schedule not in ("time", "steps"):
            raise ValueError(f"schedule must be time or steps (got {schedule!r})")
        self._progress = 0.0  # fraction of the schedule done (time mode)
        self.loss_kind, self.ce_weight, self.target_path, self.k = loss, ce_weight, target, k
        self.on_policy_every, self.on_policy_tokens = on_policy_every, on_policy_tokens
        self._teacher: list = []  # kept out of the module tree: never saved, never trained
        self._gen = torch.Generator().manual_seed(seed)
        self.draft = self._build_draft()
        self.initialised = False  # set once setup() has run the data-dependent init
        self.t_start = None

    # --- construction ----------------------------------------------------------------------
    def _build_draft(self):
        from decoding.models import load_model, resolve_model_dir

        if self.cfg.init == "new":
            from transformers import AutoConfig

            tconf = AutoConfig.from_pretrained(resolve_model_dir(self.target_path))
            return new_draft(tconf, self.cfg).train()
        model = load_model(self.cfg.init, "float32").train()
        if self.cfg.grow_layers:
            grow_layers(model, self.cfg.grow_layers)
        if not self.cfg.lora:
            return model
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(r=self.cfg.lora_r, lora_alpha=self.cfg.lora_alpha,
                          target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
        return get_peft_model(model, lcfg)

    def base(self):
        """The underlying causal LM (inside a peft wrapper when LoRA is on)."""
        return self.draft.get_base_model() if self.cfg.lora else self.draft

    def teacher(self):
        if not self._teacher:
            from decoding.models import load_model

            self._teacher.append(load_model(self.target_path, "bfloat16"))
        return self._teacher[0]

    def setup(self, stage: str) -> None:
        """Data-dependent init: head ids by token frequency (a new draft, or reselect_head),
        SVD embedding (a new draft)."""
        new = self.cfg.init == "new"
        if self.initialised or not (new or self.cfg.reselect_head):
            return
        dm = self.trainer.datamodule
        m, t = self.base(), self.teacher()
        eos = t.generation_config.eos_token_id
        always = {t.config.bos_token_id, *([eos] if isinstance(eos, int) else eos or [])} - {None}
        head = m.get_output_embeddings()
        size = self.cfg.head_size if new else (len(head.ids) if isinstance(head, PrunedHead) else None)
        if size:
            c = dm.token_counts()
            ids = select_head_ids(c, m.config.vocab_size, size, always)
            if not new:
                kept = len(set(ids.tolist()) & set(m.lm_head.ids.tolist()))
                print(f"distill: re-picked output head keeps {kept} of {size} ids")
            m.set_head_ids(ids)
            cover = sum(c[i] for i in ids.tolist()) / max(1, sum(c.values()))
            print(f"distill: output head covers {cover:.4f} of corpus/teacher-top1 tokens")
        if new and self.cfg.embed_init == "svd":
            with torch.no_grad():
                m.get_input_embeddings().weight.copy_(
                    svd_embedding(t.get_input_embeddings().weight, m.config.hidden_size))
        if self.on_policy_every <= 0 and dm.teacher == "cached":
            self._teacher.clear()  # not needed during training: free its memory
        self.initialised = True

    def on_save_checkpoint(self, ckpt: dict) -> None:
        ckpt["specstop_hparams"] = self.hp  # plain JSON types: loads with weights_only=True

    def on_load_checkpoint(self, ckpt: dict) -> None:
        self.initialised = True

    # --- forward / loss --------------------------------------------------------------------
    def student_logits(self, ids, mask, positions):
        """[N, K] logits at the flat `positions` of a right-padded batch, and the head ids."""
        m = self.base()
        h = m.model(input_ids=ids, attention_mask=mask).last_hidden_state
        h = h.reshape(-1, h.shape[-1])[positions]
        head = m.get_output_embeddings()
        if isinstance(head, PrunedHead):
            return head.pruned_logits(h), head.ids
        return head(h), None

    @torch.no_grad()
    def _score_online(self, batch: dict) -> None:
        from training.draft.teacher_cache import teacher_topk

        ids, mask, plens = batch["input_ids"], batch["attention_mask"], batch["prompt_lens"]
        seqs = [row[: int(n)].tolist() for row, n in zip(ids, mask.sum(-1))]
        out = teacher_topk(self.teacher(), seqs, plens.tolist(), self.k)
        batch["t_ids"] = torch.cat([o[0] for o in out]).long().to(ids.device)
        batch["t_logp"] = torch.cat([o[1] for o in out]).to(ids.device)

    @torch.no_grad()
    def _on_policy(self, batch: dict) -> dict:
        """Replace completions by student samples after a random prefix of each completion."""
        from training.draft.data import Row, collate

        ids, mask, plens = batch["input_ids"], batch["attention_mask"], batch["prompt_lens"]
        rows = []
        was_training = self.draft.training
        self.draft.eval()
        for row, n, p in zip(ids, mask.sum(-1).tolist(), plens.tolist()):
            cut = p + int(torch.randint(0, max(1, n - p), (1,), generator=self._gen))
            ctx = row[:cut].tolist()
            sample = self._sample(ctx, self.on_policy_tokens)
            rows.append(Row(ctx, sample, False))
        self.draft.train(was_training)
        new = collate(rows, 0, max_prompt_tokens=0)
        new = {k: v.to(ids.device) for k, v in new.items()}
        self._score_online(new)
        return new

    def _sample(self, ctx: list[int], n: int) -> list[int]:
        from transformers import DynamicCache

        m, cache, out = self.base(), DynamicCache(config=self.base().config), []
        x = torch.tensor([ctx], device=self.device)
        for _ in range(n):
            logits = m(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            tok = int(torch.multinomial(F.softmax(logits[0, -1].float(), -1), 1, generator=self._gen))
            out.append(tok)
            x = torch.tensor([[tok]], device=self.device)
        return out

    def _step(self, batch: dict):
        if "t_ids" not in batch:
            self._score_online(batch)
        logits, head_ids = self.student_logits(batch["input_ids"], batch["attention_mask"],
                                               batch["positions"])
        loss, stats = bucket_loss(logits, head_ids, batch["t_ids"], batch["t_logp"],
                                  batch["targets"], self.loss_kind)
        if self.ce_weight and self.loss_kind != "ce":
            loss = loss + self.ce_weight * bucket_loss(logits, head_ids, batch["t_ids"],
                                                       batch["t_logp"], batch["targets"], "ce")[0]
        return loss, stats

    def _timer(self):
        from lightning.pytorch.callbacks import Timer

        timer = next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None)
        return timer if timer is not None and timer._duration else None

    def on_train_batch_start(self, batch, idx: int) -> None:
        if self.hp["schedule"] == "time":
            timer = self._timer()
            if timer is not None:
                frac = (timer.time_elapsed("train") or 0.0) / timer._duration
                # every rank must use rank 0's clock, or their learning rates would differ
                self._progress = float(self.trainer.strategy.broadcast(frac, src=0))

    def training_step(self, batch: dict, idx: int):
        if self.t_start is None:
            self.t_start = time.time()
        on_policy = self.on_policy_every > 0 and (idx + 1) % self.on_policy_every == 0
        loss, stats = self._step(self._on_policy(batch) if on_policy else batch)
        pre = "train_op" if on_policy else "train"
        n = len(stats["agree"])
        self.log(f"{pre}/loss", loss, prog_bar=True, batch_size=n, sync_dist=False)
        self.log(f"{pre}/agree", stats["agree"].mean(), prog_bar=True, batch_size=n)
        self.log(f"{pre}/accept", stats["accept"].mean(), batch_size=n)
        return loss

    def on_validation_epoch_start(self) -> None:
        # per kind (code, general): rows, agree sum, accept sum -- summed over ranks at the end
        self._val = torch.zeros(2, 3, dtype=torch.float64, device=self.device)

    def validation_step(self, batch: dict, idx: int) -> None:
        loss, stats = self._step(batch)
        code = batch["code"]
        self.log("val/loss", loss, batch_size=len(code), sync_dist=True)
        for j, sel in enumerate((code, ~code)):
            self._val[j] += torch.stack([sel.sum(), stats["agree"][sel].sum(),
                                         stats["accept"][sel].sum()]).double()

    def on_validation_epoch_end(self) -> None:
        tot = self.trainer.strategy.reduce(self._val, reduce_op="sum")
        both = tot.sum(0)
        out = {"val/agree": both[1] / both[0].clamp_min(1), "val/accept": both[2] / both[0].clamp_min(1)}
        for j, name in enumerate(("code", "general")):
            out[f"val/agree_{name}"] = tot[j, 1] / tot[j, 0].clamp_min(1)
            out[f"val/accept_{name}"] = tot[j, 2] / tot[j, 0].clamp_min(1)
        # wall-clock minutes of training so far: the x axis of the learning curve
        timer = self._timer()  # its clock survives a resume; else this process's own
        secs = timer.time_elapsed("train") if timer is not None else (
            0.0 if self.t_start is None else time.time() - self.t_start)
        out["train_minutes"] = torch.tensor(secs / 60)
        for k, v in out.items():
            self.log(k, v.float(), prog_bar=k == "val/agree")

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.requires_grad and p.ndim >= 2]
        rest = [p for n, p in self.named_parameters() if p.requires_grad and p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.hp["weight_decay"]},
                                 {"params": rest, "weight_decay": 0.0}], lr=self.hp["lr"])
        total, timed = 1, self.hp["schedule"] == "time" and self._timer() is not None
        if not timed:
            total = max(1, int(self.trainer.estimated_stepping_batches))
        warm, floor = self.hp["warmup_steps"], self.hp["min_lr_ratio"]

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            if timed:
                frac = min(1.0, self._progress)
            else:
                frac = min(1.0, (step - warm) / max(1, total - warm))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
