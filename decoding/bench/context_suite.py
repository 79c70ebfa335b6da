"""The context suite: the default against `ar` and fixed shapes at a given cached context
(`python -m decoding.bench --suite context --contexts 100,600,1200,2400 --threads 2 --prompts 4
--new-tokens 64 --repeats 2 --out DIR`).

Why: the grow rule's price of a tree changes with the context (every verify row and every draft
step reads every cached key), and the default must not lose to `ar` there. Each held-out prompt
(both domains) is padded to each context: other prompts' text (FILLER, no row of the measured
sets) goes before the question in the same user turn, cut so the chat-templated prompt has
the context's token count. Every variant runs each (context, prompt) in one process, on the same
loaded target (the GGUF one by default, as the llama suite), greedy, the variants' order rotating
per prompt and repeat so drift hits all alike. Reported per context: decoding tokens per second
after the first round (the prompt's forward left out), tokens per round, paired speedups with 95% intervals over prompts
(decoding.bench.stats), and whether every variant's text equals `ar`'s. `--variants
default,ar,default-ungated,default-unpriced,default-window-all,default-window-64,default-decider,default-burst,default-gross,
default-unscoped,default-linear,default-w1,default-w2,default-cheap,default-fresh,default-prior`
adds the default with its gate always open, with its host work unpriced, with its head attending
the whole context, with the decider's scores for q's, with looks of several rounds, with looks
costed gross of the tokens they commit, with drafting priced alike at every context, with
one slope per cached key at every context, with a node's children capped at 1 or 2, with a
new prompt's head built from its newest 64 rows, and with that and a look at each new prompt
(ON_REQUEST).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from decoding.bench.config import BenchConfig, load_prompts, whole_window_catch_up
from decoding.bench.stats import speedup_ci

FILLER = "data/prompts/context_filler.txt"
"""Text that pads a prompt to a context (~5,000 tokens; no row of the measured prompt sets): the
held-out Magpie prompts, then the base-model val openings, as they stood for
reports/context-2026-12-06-memory. A file of its own, so held-out prompts added later do not move
the text at 2,400 cached tokens."""
VARIANTS = {
    "default": None,  # the defaults entry (the grown tree)
    "ar": {"strategy": "ar"},
    "sd-g2": {"strategy": "sd", "gamma": 2, "stop": "fixed"},
    "sd-g3": {"strategy": "sd", "gamma": 3, "stop": "fixed"},
    "mcsd-2,1": {"strategy": "mcsd", "k_config": "2,1", "stop": "fixed"},
}
"""Rows: the default, plain decoding and the fixed shapes that ran fastest on the CPU."""
ON_REQUEST = ("default-ungated", "default-unpriced", "default-window-all", "sd-g3-window-all", "default-window-64",
              "sd-g3-window-64", "default-decider",
              "default-burst", "default-gross", "default-unscoped", "default-linear", "default-w1", "default-w2",
              "default-context", "default-cheap", "default-fresh", "default-prior", "default-target-vocab",
              "sd-g2-target-vocab")
"""Rows run only when --variants names them: the default with its gate always open (every round
drafts), to isolate what the gate gives; and also with its host work unpriced (policy_ms and
overhead_ms 0: the rule as it ran before they were timed), to isolate what pricing gives; the
default, and sd g3, with its feature head attending the whole context (head_window 0) or its
newest 64 positions, to isolate what the window gives (sd g3 drafts every round: its tokens a round show the head's
acceptance); and the default with the shipped decider's scores in place of q (its grow rule and
gate otherwise the same), to compare the two as the rule's estimate; and the default whose looks
draft 4 rounds in a row (DraftGate.burst), to see whether lone looks undersell drafting; and the
default whose looks cost their whole time above a plain round's, whatever they commit
(DraftGate.net_looks off), to see what netting gives; and the default whose gate keeps one history
for every context (DraftGate.scale_span unbounded, 2 rounds of warm-up, the drafted rounds' scale
from one), to see what scoping gives; and the default whose cost curve extends its first slope per
cached key past the second timed context (CostCurve.far_context 0: one line through 256 and 1,280
cached tokens), to see what the far slope gives; and the default whose grown tree gives a node at
most 1 or 2 children (`width`), to see what the rule's siblings give beside the depth they cost;
and the default with the context gate (`--gate context`: decoding.stopping.gate, every request's
rounds near the current context, priced) in place of the request gate, its head's first catch-up
on a prompt building the whole window (`default-context`: the default before the request gate)
or its newest 64 rows (FeatureCache.catch_up, the default: `default-cheap`), and with a look at
each new prompt (`default-fresh`: DraftGate.fresh_share); and the default whose request gate
weighs a request's rounds with 4 rounds' worth of earlier requests' near the context
(`default-prior`: PromptGate.prior); and the default and sd g2 whose head's q is warped and drawn
over the target's vocabulary (`-target-vocab`: TreeProposer.vocab_ids None), to see what drawing
over the head's own gives. The burst, gross and unscoped rows are the context gate's settings too."""
GATES = {"default-burst": {"burst": 4}, "default-gross": {"net_looks": False},
         "default-unscoped": {"scale_span": float("inf"), "warmup": 2, "scale_warm": 1},
         "default-context": {}, "default-cheap": {}, "default-fresh": {"fresh_share": 0.02}}
"""The rows of ON_REQUEST that change only the default's gate: the context gate's settings."""


def filler_text() -> str:
    return Path(FILLER).read_text(encoding="utf-8")


def padded(decoder, prompt: str, context: int, filler_ids: list[int]) -> list[int]:
    """The chat-templated prompt with filler before the question, `context` tokens long (or the
    prompt alone when it is longer already)."""
    def ids(k: int) -> list[int]:  # the first k filler tokens, then the question
        pad = decoder.tokenizer.decode(filler_ids[:k]) + "\n\n" if k else ""
        return decoder.prompt_ids(pad + prompt, chat=True)

    k = max(context - len(ids(0)), 0)
    for _ in range(4):  # decode/encode may merge tokens at the seam: a few corrections
        n = len(ids(k))
        if n == context or k == 0:
            break
        k = max(k + context - n, 0)
    return ids(k)


def context_suite(contexts=(100, 600, 1200, 2400), prompts: int = 4, new_tokens: int = 64, repeats: int = 2,
                  threads: int = 2, target: str | None = None, variants=None, progress=print) -> dict:
    from decoding.api import Decoder
    from decoding.forward import cpu

    unknown = sorted(set(variants or ()) - set(VARIANTS) - set(ON_REQUEST))
    if unknown:
        raise ValueError(f"--variants: no row {', '.join(unknown)} (rows: {', '.join([*VARIANTS, *ON_REQUEST])})")
    torch.set_num_threads(threads)
    ar = Decoder.load(target, dtype="float32", strategy="ar")
    rows = {name: (ar.default_variant() if opts is None else ar if name == "ar" else ar.variant(**opts))
            for name, opts in VARIANTS.items() if variants is None or name in variants or name == "ar"}
    for name in [n for n in ON_REQUEST if variants is not None and n in variants]:
        from dataclasses import replace

        from decoding.stopping.gate import DraftGate

        if name in ("default-w1", "default-w2"):
            rows[name] = ar.default_variant(width=int(name[-1]))
            continue
        if name == "default-decider":
            rows[name] = ar.default_variant(stop="decider", decider_rule="grow")
            continue
        if "-window-" in name:
            w = 0 if name.endswith("-all") else int(name.rsplit("-", 1)[1])
            rows[name] = ar.default_variant(head_window=w) if name.startswith("default") else \
                ar.variant(**VARIANTS["sd-g3"], head_window=w)
            continue
        if name in GATES:
            rows[name] = ar.default_variant(gate="context")
            rows[name]._stop.gate = DraftGate(**GATES[name])  # the grow policy the engine is built with
            if name == "default-context":
                whole_window_catch_up(rows[name])
            continue
        if name == "default-prior":
            from decoding.stopping.prompt_gate import PromptGate

            rows[name] = ar.default_variant()
            rows[name]._stop.gate = PromptGate(prior=4.0)  # the grow policy the engine is built with
            continue
        if name.endswith("-target-vocab"):
            from decoding.sampling import SamplingConfig

            rows[name] = ar.default_variant() if name.startswith("default") else ar.variant(**VARIANTS["sd-g2"])
            p = rows[name].engine(SamplingConfig()).proposer  # the engine _run reads (built once)
            p.model.own_vocab, p.vocab_ids = False, None
            continue
        if name == "default-linear":
            rows[name] = lin = ar.default_variant()
            lin._stop.cost = replace(lin._stop.cost, far_context=0, target_far_key_ms=[], draft_far_key_ms=[])
            continue
        rows[name] = open_ = ar.default_variant()
        open_._stop.gate = DraftGate.held_open()  # the grow policy the engine is built with
        if name == "default-unpriced":
            open_._stop.cost = replace(open_._stop.cost, policy_ms=0.0, overhead_ms=0.0)
    fill = ar.tokenizer(filler_text(), add_special_tokens=False)["input_ids"]
    todo = [(kind, r) for kind, f in BenchConfig().prompt_sets.items() for r in load_prompts(f, prompts)]
    ids = {(c, i): padded(ar, r["prompt"], c, fill) for c in contexts for i, (_, r) in enumerate(todo)}
    for d in rows.values():  # warm-up: kernels, the default's cost curve (timed once, stored); a fresh gate
        d.warm_up()
    runs = {(n, c): [[None] * len(todo) for _ in range(repeats)] for n in rows for c in contexts}
    turn = 0
    for rep in range(repeats):
        for c in contexts:
            for i, (kind, row) in enumerate(todo):
                names = list(rows)
                names = names[turn % len(names):] + names[:turn % len(names)]
                turn += 1
                for n in names:
                    runs[(n, c)][rep][i] = _run(rows[n], ids[(c, i)], new_tokens)
                progress(f"repeat {rep + 1}/{repeats} context {c} {kind} {row['id']} (decode tok/s): " + "  ".join(
                    f"{n} {runs[(n, c)][rep][i]['tokens'] / runs[(n, c)][rep][i]['wall_s']:.0f}" for n in rows))
    return {"cpu": cpu.model_name(), "threads": threads, "new_tokens": new_tokens, "repeats": repeats,
            "prompts": [{"kind": k, "id": r["id"]} for k, r in todo], "contexts": list(contexts),
            "prompt_tokens": {c: [len(ids[(c, i)]) for i in range(len(todo))] for c in contexts},
            "per_context": {c: _summary(rows, runs, c, todo) for c in contexts}}


def _run(decoder, ids: list[int], new_tokens: int) -> dict:
    """One greedy request. Speed is of the decoding after the first round (the prompt's forward
    and its token): at a long context the prompt's forward would otherwise weigh as much as the
    rounds whose speed at that context is measured."""
    from decoding.sampling import SamplingConfig

    marks = []
    t = time.perf_counter()
    out, st = decoder.engine(SamplingConfig()).generate(
        ids, new_tokens, decoder.session.eos_token_id, 0, lambda new: marks.append((time.perf_counter(), len(new))))
    end = time.perf_counter()
    return {"tokens": len(out) - marks[0][1], "wall_s": end - marks[0][0], "request_s": end - t, "ids": out,
            "block_efficiency": st.block_efficiency, "rounds": st.rounds, "draft_s": st.draft_s,
            "drafted_rounds": st.rounds - st.tree_sizes[0]}


def _summary(rows, runs, c: int, todo) -> dict:
    def arr(n, key, idx=None):
        a = np.asarray([[x[key] for x in rep] for rep in runs[(n, c)]], dtype=float)
        return a if idx is None else a[:, idx]

    out = {"tokens_per_s": {n: float(arr(n, "tokens").sum() / arr(n, "wall_s").sum()) for n in rows},
           "request_s": {n: float(np.median(arr(n, "request_s"))) for n in rows},
           "same_text_as_ar": {n: all(x["ids"] == y["ids"] for rx, ry in zip(runs[(n, c)], runs[("ar", c)])
                                      for x, y in zip(rx, ry)) for n in rows},
           "block_efficiency": {n: float(np.mean([x["block_efficiency"] or 1.0 for rep in runs[(n, c)] for x in rep]))
                                for n in rows},
           # the round's draft phase (a plain round: the gate's decision and the head's bookkeeping)
           "draft_ms": {n: float(1000 * arr(n, "draft_s").sum() / arr(n, "rounds").sum()) for n in rows},
           "drafted_share": {n: float(arr(n, "drafted_rounds").sum() / arr(n, "rounds").sum()) for n in rows}}
    fixed = [n for n in rows if n not in ("default", "ar", *ON_REQUEST)]
    best = max(fixed, key=lambda n: out["tokens_per_s"][n]) if fixed else None
    mine = [n for n in ("default", *ON_REQUEST) if n in rows]
    pairs = [(a, b) for a in rows for b in ("ar", *fixed, *mine[1:]) if a != b and a in (*mine, *fixed)
             and not (a in fixed and b in fixed) and not (a in mine[1:] and b in mine[1:])]
    kinds = {k: [i for i, (kk, _) in enumerate(todo) if kk == k] for k, _ in todo}
    out["best_fixed"] = best
    out["ratios"] = [{"a": a, "b": b, "kind": kind, **dict(zip(("speedup", "low", "high"), speedup_ci(
        arr(a, "tokens", idx), arr(a, "wall_s", idx), arr(b, "tokens", idx), arr(b, "wall_s", idx))))}
        for a, b in pairs for kind, idx in (("all", None), *kinds.items())]
    return out


def context_markdown(r: dict, command: str) -> str:
    lines = [f"# The default against ar and fixed shapes by cached context ({r['cpu']}, {r['threads']} thread(s))", "",
             f"{len(r['prompts'])} held-out prompts (both domains) padded to each context, greedy, up to "
             f"{r['new_tokens']} new tokens, {r['repeats']} repeat(s), variants interleaved. Decode tok/s: the "
             "tokens after the first round over the time after it (the prompt's forward left out); speedups "
             "of it, paired over prompts, 95% intervals.", ""]
    for c, s in r["per_context"].items():
        lines += [f"## {c} cached tokens (best fixed shape: {s['best_fixed']})", "",
                  "| row | decode tok/s | median request s | tokens/round | rounds drafted | draft ms a round "
                  "| text = ar's |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {n} | {v:.1f} | {s['request_s'][n]:.2f} | {s['block_efficiency'][n]:.2f} | "
                  f"{s['drafted_share'][n]:.1%} | {s['draft_ms'][n]:.3f} | {s['same_text_as_ar'][n]} |"
                  for n, v in s["tokens_per_s"].items()]
        lines += ["", "| ratio | prompts | speedup [95% CI] |", "|---|---|---|"]
        lines += [f"| {x['a']} / {x['b']} | {x['kind']} | {x['speedup']:.3f}x [{x['low']:.3f}, {x['high']:.3f}] |"
                  for x in s["ratios"]]
        lines.append("")
    return "\n".join(lines) + f"\nCommand: `{command}`\n"
