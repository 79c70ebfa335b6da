"""`--quick`: the whole comparison pipeline on tiny random models built here (CI smoke, seconds).
The numbers mean nothing; the code paths (engine rows, an HF peer, decider rows with their
per-rule thresholds, tuned confidence rows, quality columns, confidence intervals, goals,
plots) are the real ones. The decider is an untrained random one with made-up thresholds."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from decoding.bench.config import BenchConfig, GoalsConfig, OracleConfig, StrategySpec, SweepConfig

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(40)]


def _save(path: Path, model) -> str:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tk_models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tk_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # encode(chat=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def tiny_pair(root: Path) -> tuple[str, str, str]:
    """A sharp random 2-layer target, a noisy copy as draft (accepted often, not always) and a
    noisier copy (a second draft, for a row that runs with its own)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=1, pad_token_id=1)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(6)
    draft = copy.deepcopy(target)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.03)
    other = copy.deepcopy(target)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return _save(root / "target", target), _save(root / "draft", draft), _save(root / "draft2", other)


# Illustrative per-rule thresholds of the quick decider: distinct, so a test can tell which
# one a row ran with (none of them was validated: the decider is random).
QUICK_THRESHOLDS = {"paper": 0.5, "specdecpp": 0.6, "tree": 0.3}
QUICK_CONFIDENCE = {"level": 0.3, "tree": 0.2}
# illustrative costs (ms) for the replay and the grow rows' code paths (tiny models)
QUICK_COST = {"sizes": [1, 4, 16, 64], "target_ms": [2.0, 2.1, 2.4, 3.5], "draft_ms": [1.0, 1.0, 1.1, 1.3]}


def tiny_decider(root: Path, target: str, draft: str) -> str:
    """A random logistic decider for the tiny pair, with per-rule and confidence thresholds."""
    from decoding.decider.policy import DeciderConfig, DeciderNet, save_decider
    from decoding.models import fingerprint, load_model

    pair = {"target": fingerprint(load_model(target)), "draft": fingerprint(load_model(draft))}
    cfg = DeciderConfig(kind="logistic", rule="tree", threshold=QUICK_THRESHOLDS["tree"], model_pair=pair,
                        thresholds=dict(QUICK_THRESHOLDS), confidence_thresholds=dict(QUICK_CONFIDENCE),
                        cost_model=dict(QUICK_COST))
    torch.manual_seed(2)
    return str(save_decider(root / "decider", DeciderNet(cfg), cfg, {}))


def quick_config(root: Path, oracle_traces: str | None = None) -> BenchConfig:
    root.mkdir(parents=True, exist_ok=True)
    t, d, d2 = tiny_pair(root)
    dec = tiny_decider(root, t, d)
    sets = {}
    for name, offset in (("general", 2), ("code", 20)):
        p = root / f"{name}.jsonl"
        p.write_text("".join(json.dumps({"id": f"{name}-{i}", "kind": name,
                                         "prompt": " ".join(f"w{offset + i + j}" for j in range(4))}) + "\n"
                             for i in range(2)))
        sets[name] = str(p)
    cost = root / "cost_model.json"
    cost.write_text(json.dumps(QUICK_COST))
    S = StrategySpec
    return BenchConfig(
        target=t, draft=d, dtype="float32", threads=1, prompt_sets=sets, prompts_per_set=2,
        max_new_tokens=12, repeats=2, warmup_tokens=2, temperatures=[0.0, 0.7],
        decider=dec,
        strategies=[S("ar"), S("hf-assisted"), S("sd", gamma=3),
                    S("mcsd", k_config="3,2,1"),
                    S("ti-mcsd", width=3, depth=4),
                    S("sd", name="sd (draft2)", gamma=3, draft=d2),
                    S("ti-mcsd", name="ti-mcsd+confidence", width=3, depth=4, stop="confidence"),
                    S("ti-mcsd", name="ti-mcsd+confidence(tuned)", width=3, depth=4, stop="confidence",
                      confidence_threshold="tuned"),
                    S("ti-mcsd", name="ti-mcsd+confidence(tree, tuned)", width=3, depth=4, stop="confidence",
                      confidence_rule="tree", confidence_threshold="tuned"),
                    S("ti-mcsd", name="ti-mcsd+decider(paper)", width=3, depth=4, stop="decider", decider_rule="paper"),
                    S("ti-mcsd", name="ti-mcsd+decider(tree)", width=3, depth=4, stop="decider"),
                    S("ti-mcsd", name="ti-mcsd+confidence(grow)", width=3, depth=4, max_nodes=12, stop="confidence",
                      confidence_rule="grow", grow_cost="measure"),
                    S("ti-mcsd", name="ti-mcsd+decider(grow)", width=3, depth=4, max_nodes=12, stop="decider", decider_rule="grow"),
                    S("ti-mcsd", name="ti-mcsd longest-branch (LOSSY)", width=3, depth=4, mode="longest-branch")],
        sweep=SweepConfig(prompts=1, max_new_tokens=8, ti_mcsd=[[2, 3], [3, 4]], mcsd=["2,1", "3,2,1"]),
        oracle=OracleConfig(traces=oracle_traces, cost_model=str(cost)),
        goals=GoalsConfig(mcsd_reference="3,2,1", learned_vs_best_fixed=1.1, learned_vs_confidence=1.05),
    )
