"""The engine suite: `ar` vs `model.generate` (tokens/s ratio) and the draft / verify /
bookkeeping split of a round (`python -m decoding.bench --suite engine`)."""

from __future__ import annotations

import statistics
import time

import torch

from decoding import models
from decoding.sampling import SamplingConfig
from decoding.models.session import Session
from decoding.strategies import StrategyConfig, build_engine
from decoding.tree import layout_from_k_config

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in a few sentences why the sky is blue.",
]


def _chat_ids(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _hf_generate(model, ids, n):
    x = torch.tensor([ids])
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=model.generation_config.pad_token_id)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def random_draft(target, layers=2, seed=0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(models.small_draft_config(target.config, layers)).to(target.dtype).eval()


def engine_suite(dtype: str, new_tokens: int, repeats: int) -> dict:
    """ar vs model.generate (tokens/s ratio) and the draft / verify / bookkeeping split of a
    round on the real target with a 2-layer random draft."""
    sess = Session.open(None, None, dtype)
    greedy = SamplingConfig()
    ar = build_engine(sess.target, None, StrategyConfig(strategy="ar"), greedy)
    prompts = [_chat_ids(sess.tokenizer, p) for p in PROMPTS]
    ours, theirs, same = [], [], True
    _hf_generate(sess.target, prompts[0], 8)  # warm-up
    for _ in range(repeats):
        for ids in prompts:
            ref, t_hf = _hf_generate(sess.target, ids, new_tokens)
            out, st = ar.generate(ids, new_tokens)  # no EOS: both run exactly new_tokens
            same &= out == ref
            ours.append(new_tokens / st.wall_s)
            theirs.append(new_tokens / t_hf)
    res = {"dtype": dtype, "ar_tok_s": statistics.median(ours), "generate_tok_s": statistics.median(theirs),
           "ar_equals_generate": same}
    res["ar_over_generate"] = res["ar_tok_s"] / res["generate_tok_s"]
    draft = random_draft(sess.target)
    res["rounds"] = {}
    for cfg in (StrategyConfig(strategy="sd", gamma=4), StrategyConfig(strategy="mcsd", k_config="4,2,2,1"),
                StrategyConfig(strategy="ti-mcsd", width=4, depth=6)):
        eng = build_engine(sess.target, draft, cfg, greedy)
        tot = {"draft_s": 0.0, "verify_s": 0.0, "bookkeeping_s": 0.0, "rounds": 0, "equal_to_ar": True}
        for ids in prompts:
            out, st = eng.generate(ids, new_tokens)
            tot["equal_to_ar"] &= out == ar.generate(ids, new_tokens)[0]
            for k in ("draft_s", "verify_s", "bookkeeping_s"):
                tot[k] += getattr(st, k)
            tot["rounds"] += st.rounds
        round_s = tot["draft_s"] + tot["verify_s"] + tot["bookkeeping_s"]
        res["rounds"][cfg.name] = {
            "tree_nodes": layout_from_k_config(cfg.k_levels).size,
            "ms_per_round": 1000 * round_s / tot["rounds"],
            "draft_ms": 1000 * tot["draft_s"] / tot["rounds"],
            "verify_ms": 1000 * tot["verify_s"] / tot["rounds"],
            "bookkeeping_ms": 1000 * tot["bookkeeping_s"] / tot["rounds"],
            "bookkeeping_share": tot["bookkeeping_s"] / round_s,
            "equal_to_ar": tot["equal_to_ar"],
        }
    return res


def engine_markdown(results: list[dict], new_tokens: int) -> str:
    lines = [f"# Engine benchmark ({new_tokens} new tokens, greedy, batch 1, CPU)", "",
             "| dtype | ar tok/s | model.generate tok/s | ratio | same tokens |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['dtype']} | {r['ar_tok_s']:.1f} | {r['generate_tok_s']:.1f} | "
                     f"{r['ar_over_generate']:.3f} | {r['ar_equals_generate']} |")
    lines += ["", ("Per-round split, real target + 2-layer random draft (acceptance ~0, so this is "
                   "pure cost):"), "", ("| dtype | strategy | ms/round | draft ms | verify ms | bookkeeping ms | "
                                        "bookkeeping share | equal to ar |"), "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name, x in r["rounds"].items():
            lines.append(f"| {r['dtype']} | {name} | {x['ms_per_round']:.1f} | {x['draft_ms']:.1f} | "
                         f"{x['verify_ms']:.1f} | {x['bookkeeping_ms']:.1f} | {x['bookkeeping_share']:.1%} | "
                         f"{x['equal_to_ar']} |")
    return "\n".join(lines) + "\n"
