"""A loaded target/draft pair with its tokenizer: the one place CLIs get models from."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from decoding.decider.policy import DeciderConfig, DeciderStop, load_decider, resolve_decider_dir
from decoding.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_dtype
from decoding.drafts.attach import check_draft, load_draft
from decoding.forward import cpu, gguf
from decoding.forward.cost import CostCurve, measure_cost
from decoding.forward.cost_cache import cached_cost
from decoding.forward.packed import default_forward, set_forward
from decoding.growth import GrowPolicy, q_scores, time_host_work
from decoding.kv_cache import set_kv_dtype
from decoding.models.arch import attention_plan
from decoding.models.errors import ModelError
from decoding.models.fingerprint import fingerprint, same_model, stale_fingerprint
from decoding.models.resolve import resolve_model_dir
from decoding.stopping.prompt_gate import make_gate
from decoding.models.weights import load_tokenizer, read_model
from decoding.sampling import SamplingConfig
from decoding.stopping import GROW, make_stop_policy
from decoding.strategies import StrategyConfig, build_engine

def rule_threshold(dcfg: DeciderConfig, rule: str, where: Path | str = "the decider") -> float:
    """The threshold validated for `rule`: from `thresholds`; a checkpoint that predates it
    knows only its own rule's `threshold`."""
    if rule in dcfg.thresholds:
        return float(dcfg.thresholds[rule])
    if rule == dcfg.rule:
        return float(dcfg.threshold)
    raise ModelError(f"decider {where} has no validated threshold for the {rule} rule "
                            f"(it has: {', '.join(sorted(dcfg.thresholds) or [dcfg.rule])}); "
                            f"pass a threshold or refit it with python -m training.fit")


@dataclass
class Session:
    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: object
    target_dir: Path
    draft_dir: Path | None
    forward: str = "eager"
    """How the loaded models compute their linears: eager (as loaded) or packed
    (decoding.forward.packed)."""
    cost_cache: bool = False
    """grow_cost measure: reuse the curve timed on an earlier load (decoding.forward.cost_cache), as
    Decoder does; False (benchmarks) times it afresh once per loaded pair."""

    def __post_init__(self):
        from transformers import PreTrainedModel

        for m in (self.target, self.draft):  # an architecture we cannot verify: refused at load
            if isinstance(m, PreTrainedModel):
                attention_plan(m)

    @classmethod
    def open(cls, target=None, draft=None, dtype="float32", device="cpu", need_draft=False,
             forward: str | None = None, kv_dtype: str | None = None) -> Session:
        """Load a pair, stage by stage, each a call into the room that owns it. The engine is
        built from the loaded pair per strategy and sampling settings (`engine`, Decoder.engine).
        forward: eager | packed | lean (decoding.forward.packed; None: its default_forward).
        kv_dtype: float16 stores the target's KV cache so (decoding.kv_cache.set_kv_dtype)."""
        dtype = _load_dtype(target, dtype, device)
        tdir = resolve_model_dir(target)                                     # resolve the target
        draft = _draft_for(target, draft, need_draft)                        # (and name its draft)
        tok, t = load_tokenizer(tdir), read_model(tdir, dtype, device)       # read its weights,
        gguf.attach(t, target)                                               # a GGUF's own blocks where they run
        kind = set_forward(t, forward or default_forward(t.dtype, device))   # pick the forward
        try:
            set_kv_dtype(t, kv_dtype)
        except ValueError as e:
            raise ModelError(f"--kv-dtype {kv_dtype}: {e}") from None
        return cls(t, None, tok, tdir, None, kind).with_draft(draft)         # load, attach, check the draft

    def with_draft(self, draft) -> Session:
        """The same target (shared, not reloaded) with another draft, checked against it: a
        feature head by the target's fingerprint, a stand-alone model by config and tokenizer.
        How one benchmark compares drafts in one interleaved run."""
        if draft is None:
            return replace(self, draft=None, draft_dir=None)
        ddir = resolve_model_dir(draft)
        d, dtok = load_draft(ddir, self.target)                            # load and attach the draft
        check_draft(self.target, d, self.tokenizer, dtok)                   # check the pair
        set_forward(d, self.forward)                                        # the target's forward
        return replace(self, draft=d, draft_dir=ddir)

    @property
    def eos_token_id(self):
        eos = self.target.generation_config.eos_token_id
        return eos if eos is not None else self.tokenizer.eos_token_id

    def engine(self, cfg: StrategyConfig, sampling: SamplingConfig, decider=None, rule=None,
               threshold=None):
        """decider: checkpoint dir or 'latest'; rule / threshold override the checkpoint's."""
        if cfg.stop == "decider":
            stop = self.decider_stop(decider, rule, threshold, cfg)
        elif cfg.stop == "confidence" and cfg.confidence_rule == GROW and cfg.strategy != "ar":
            stop = self.grow_policy(cfg, decider, scorer=None)
        else:
            stop = make_stop_policy(cfg.stop, cfg.confidence_threshold, cfg.confidence_rule)
        return build_engine(self.target, self.draft, cfg, sampling, stop)

    def decider_stop(self, decider=None, rule=None, threshold=None,
                     cfg: StrategyConfig | None = None) -> DeciderStop | GrowPolicy:
        """rule: the checkpoint's by default; its threshold is the one validated for THAT rule
        (a threshold chosen for one rule means nothing to another); `threshold` overrides it.
        The grow rule has no threshold: it sizes the tree (width / depth / max_nodes of `cfg`)."""
        if self.draft is None:
            raise ModelError("--stop decider needs a draft model")
        net, dcfg = load_decider(decider or "latest", self.target, self.draft)
        net.to(next(self.draft.parameters()).device)  # features live where the draft's q does
        rule = rule or dcfg.rule
        if rule == GROW:
            return self.grow_policy(cfg or StrategyConfig("ti-mcsd"), decider,
                                    DeciderStop(net, replace(dcfg, rule="tree", threshold=0.0)))
        if threshold is None:
            threshold = rule_threshold(dcfg, rule, resolve_decider_dir(decider or "latest"))
        return DeciderStop(net, replace(dcfg, rule=rule, threshold=threshold))

    def grow_policy(self, cfg: StrategyConfig, decider=None, scorer: DeciderStop | None = None) -> GrowPolicy:
        """The cost-aware growth policy over the decider's scores, or over the draft's own q
        (scorer None), with the cost model the decider's fit measured for this pair, or this
        machine's, timed now (cfg.grow_cost). Over q with no decider named, a pair the registry's
        latest decider was not fitted for (a user's own) is priced by this machine's curve too."""
        if cfg.mode != "lossless":
            raise ValueError("the grow rule sizes lossless trees only (not the longest-branch mode)")
        if cfg.grow_cost == "measure":
            cost = self.measured_cost()
        elif scorer is None and decider is None and not self._latest_decider_fits():
            cost = self.measured_cost()  # a pair without its own decider: this machine's curve
        else:
            where = resolve_decider_dir(decider or "latest")
            dcfg = scorer.cfg if scorer is not None else load_decider(decider or "latest", self.target, self.draft)[1]
            try:
                cost = CostCurve.from_dict(dcfg.cost_model)
            except ValueError as e:
                raise ModelError(f"decider {where} has no usable cost model for the grow rule: {e} "
                                        f"(or use grow_cost measure)") from None
        # ti-mcsd: any node may get up to W children; sd / mcsd: the k-config is the envelope
        # (a fork 4,1,1,... grows exactly the sub-trees its traces replay, training.decider.grow_replay)
        env = None if cfg.strategy == "ti-mcsd" else cfg.k_levels
        return GrowPolicy(q_scores if scorer is None else scorer.scores, cost,
                          max_width=cfg.width if env is None else max(env), level_widths=env,
                          max_nodes=cfg.max_nodes, label="q" if scorer is None else "decider",
                          needs_hidden=scorer is not None and scorer.needs_hidden, gate=make_gate(cfg.gate))

    def measured_cost(self) -> CostCurve:
        """This machine's cost curve for the pair, timed once per loaded pair (and, with
        `cost_cache`, stored per machine for later loads)."""
        if not hasattr(self, "_measured_cost"):
            self._measured_cost = (cached_cost(self.target, self.draft, host_work=time_host_work)[0]
                                   if self.cost_cache else
                                   measure_cost(self.target, self.draft, host_work=time_host_work))
        return self._measured_cost

    def _latest_decider_fits(self) -> bool:
        """Whether the registry's latest decider was fitted for this pair (the shipped pair's
        is not for a user's own pair, whose grown tree then times its own cost curve)."""
        try:
            pair = json.loads((resolve_decider_dir("latest") / "config.json").read_text())["model_pair"]
        except (ModelError, OSError, ValueError, KeyError, TypeError):
            return False  # no registry or no readable latest decider: nothing priced this pair
        for role, model in (("target", self.target), ("draft", self.draft)):
            want = pair.get(role) if isinstance(pair, dict) else None
            if want and not stale_fingerprint(want) and not same_model(want, fingerprint(model)):
                return False
        return True  # this pair's (or one load_decider explains the trouble with)

    def tuned_confidence_threshold(self, decider, confidence_rule: str) -> float:
        """The draft-confidence threshold the decider's fit tuned on its validation replay
        (same traces, same cost model) for this pair; an error where it has none."""
        _, dcfg = load_decider(decider or "latest", self.target, self.draft)
        t = dcfg.confidence_thresholds.get(confidence_rule)
        if t is None:
            raise ModelError(
                f"decider {resolve_decider_dir(decider or 'latest')} records no tuned confidence threshold "
                f"for the {confidence_rule} rule (refit it with python -m training.fit, or set the threshold)")
        return float(t)

    def encode(self, prompt: str, chat: bool = False, max_new_tokens: int = 0, tree_depth: int = 0) -> list[int]:
        if not prompt or not prompt.strip():
            raise ValueError("empty prompt")
        if chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = self.tokenizer.encode(prompt)
        self.check_length(ids, max_new_tokens, tree_depth)
        return ids

    def check_length(self, ids, max_new_tokens: int = 0, tree_depth: int = 0) -> None:
        """Refuse a prompt whose generation cannot fit the target's context."""
        limit = getattr(self.target.config, "max_position_embeddings", None)
        need = len(ids) + max_new_tokens + tree_depth + 1
        if limit is not None and need > limit:
            raise ValueError(
                f"prompt too long: {len(ids)} prompt tokens + {max_new_tokens} new tokens "
                f"(+{tree_depth + 1} for the draft tree) exceed the model's context of {limit}")

    def streamer(self, out):
        """Callback that prints newly committed text (decodes the whole run so far, so
        multi-byte characters split across tokens come out whole)."""
        state = {"ids": [], "shown": 0}

        def push(new_ids):
            state["ids"] += new_ids
            text = self.tokenizer.decode(state["ids"], skip_special_tokens=True)
            if text.endswith("\ufffd"):
                return
            out.write(text[state["shown"]:])
            out.flush()
            state["shown"] = len(text)

        return push


def _load_dtype(target, dtype: str, device: str) -> str:
    """The dtype a target loads in. auto: float32 for a GGUF target on its blocks (float32
    activations in), else bf16 on CUDA, with AMX, or AVX512-BF16 + packed."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for but no CUDA device is available")
    dtype = "float32" if dtype == "auto" and gguf.runs_quantized(target, device) else resolve_dtype(dtype, device)[0]
    if dtype == "bfloat16" and device.startswith("cpu") and not cpu.native_bf16():
        print("note: this CPU has no native bfloat16 (no AVX512-BF16 or AMX-BF16): bfloat16 runs emulated, "
              "slower than float32 (--dtype float32), and its first call times an emulated cost curve",
              file=sys.stderr)
    return dtype


def _draft_for(target, draft, need_draft: bool):
    """The draft named, else the shipped head beside the embedded target."""
    if draft is None and target in (None, DEFAULT_TARGET) and (DEFAULT_DRAFT / "config.json").exists():
        draft = DEFAULT_DRAFT
    if draft is None and need_draft:
        raise ModelError("speculative strategies need a draft model: pass --draft DIR")
    return draft
