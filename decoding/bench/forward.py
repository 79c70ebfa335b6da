"""The forward suite: where a target forward's time goes, and what a cheaper forward buys
(`python -m decoding.bench --suite forward [--dtypes ...] [--forward-threads 1,2]`).

One target forward is what a decoding round pays for: the pending token plus n - 1 tree nodes
fed against a cache of `context` committed tokens (n = 1 is a plain decoding step), exactly as
the engine feeds it (decoding.kv_cache.CachedModel). For each thread count, every variant (dtype x
forward: eager = transformers' modules as loaded, packed / lean = decoding.forward.packed; a
"/torch" suffix leaves out decoding.forward.kernels: torch's ops and oneDNN's linears; "/sdpa" keeps
them but attends with torch's attention, $SPECSTOP_BATCH_INVARIANT=0) is timed at
every n, variants alternating call by call within each repeat, so load from other processes
hits all alike; medians and ratios are reported (ratios are what survives a shared machine).
torch.profiler splits one forward per variant and size into GEMM time and the rest (per-op
overhead, attention, norms), with the op count. Each variant's logits are checked against the
fp32 eager reference (same argmax, max abs difference).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from decoding import models

from decoding.forward import cpu, kernels
from decoding.kv_cache import CachedModel, crop
from decoding.forward.packed import packed_available, set_forward
from decoding.tree import TreeLayout, layout_from_k_config
from decoding.bench import roofline
from decoding.bench.profiling import profile_one

SIZES = (1, 2, 4, 8, 16)


class _Forward:
    """One variant: a loaded target in a dtype, with a forward kind, fed like the engine feeds."""

    def __init__(self, model, vocab: int, context: int):
        self.m = CachedModel(model)
        self.prompt = [(10 + i) % vocab for i in range(context)]
        self.vocab = vocab

    def prepare(self, n: int):
        """The cache holding the context but its last token: prefilled once, then cut back to
        that length before every call (a prefill per call would cost ~10x the timed forward)."""
        lay = layout_from_k_config([n - 1]) if n > 1 else TreeLayout(())
        held = len(self.prompt) - 1
        if self.m.length < held:
            self.m.reset()
            self.m.feed(self.prompt[:-1], lay, [], 0, 0)
        crop(self.m.cache, held)
        self.m.length = held
        return lay

    def call(self, n: int, lay) -> torch.Tensor:
        return self.m.feed(self.prompt, lay, [(1 + i) % self.vocab for i in range(n - 1)], 0, n - 1)[0]

    def time(self, n: int) -> float:
        lay = self.prepare(n)
        t = time.perf_counter()
        self.call(n, lay)
        return 1000 * (time.perf_counter() - t)

    def profile(self, n: int) -> dict:
        lay = self.prepare(n)
        return profile_one(lambda: self.call(n, lay))


def _variants(dtypes, forwards, context: int, sizes) -> dict[str, _Forward]:
    tdir = models.resolve_model_dir(None)
    out = {}
    for dt in dtypes:
        for fw in forwards:
            model = models.load_model(tdir, dt)
            if fw == "compiled":
                from decoding.bench.compiled_forward import CompiledForward

                out[f"{dt} {fw}"] = CompiledForward(model, model.config.vocab_size, context, max(sizes))
                continue
            # "lean/torch": without decoding.forward.kernels; "lean/sdpa": $SPECSTOP_BATCH_INVARIANT=0
            kind, _, only = fw.partition("/")
            if kind != "eager" and not packed_available(model.dtype, "cpu"):
                continue
            before = os.environ.pop(kernels.INVARIANT_ENV, None)
            if only == "sdpa":
                os.environ[kernels.INVARIANT_ENV] = "0"
            try:
                set_forward(model, kind, kernels=only != "torch")
            finally:
                os.environ.pop(kernels.INVARIANT_ENV, None)
                if before is not None:
                    os.environ[kernels.INVARIANT_ENV] = before
            out[f"{dt} {fw}"] = _Forward(model, model.config.vocab_size, context)
    return out


def forward_suite(dtypes=("float32", "bfloat16"), forwards=("eager", "packed"), threads=(1, 2),
                  context: int = 200, repeats: int = 15, sizes=SIZES) -> dict:
    """Median ms per forward of every variant (dtype x forward) at every size and thread count,
    interleaved; `compiled` (decoding.bench.compiled_forward) is a probe, its compile time kept."""
    load = os.getloadavg()[0]
    variants = _variants(dtypes, forwards, context, sizes)
    ref = "float32 eager" if "float32 eager" in variants else next(iter(variants))
    res = {"context": context, "repeats": repeats, "sizes": list(sizes), "reference": ref,
           "torch": torch.__version__, "cpu_flags": _cpu_flags(), "load_before": round(load, 2),
           "cpu_kernels": kernels.describe(), "threads": {}, "agreement": {}}
    for n in sizes:  # logits against the fp32 eager reference
        want = variants[ref].call(n, variants[ref].prepare(n))
        for name, v in variants.items():
            got = v.call(n, v.prepare(n))
            agree = res["agreement"].setdefault(name, {"same_argmax": True, "max_abs_diff": 0.0})
            agree["same_argmax"] &= bool(torch.equal(got.argmax(-1), want.argmax(-1)))
            agree["max_abs_diff"] = max(agree["max_abs_diff"], float((got - want).abs().max()))
    work = {}  # per dtype, for the roofline
    for name, v in variants.items():
        if hasattr(v, "m"):
            work.setdefault(name.split()[0], roofline.work_of(v.m.model))
    for th in threads:
        torch.set_num_threads(th)
        for v in variants.values():  # warm-up at this thread count
            for n in sizes:
                v.time(n)
        ms = {name: {n: [] for n in sizes} for name in variants}
        for _ in range(repeats):
            for n in sizes:
                for name, v in variants.items():  # alternate call by call
                    ms[name][n].append(v.time(n))
        med = {name: {n: statistics.median(x[n]) for n in sizes} for name, x in ms.items()}
        res["threads"][th] = {
            "median_ms": med,
            "over_reference": {name: {n: med[name][n] / med[ref][n] for n in sizes} for name in med},
            "over_one_token": {name: {n: med[name][n] / med[name][1] for n in sizes} for name in med},
            "profile": {name: {n: v.profile(n) for n in (1, 8) if n in sizes} for name, v in variants.items()},
        }
        peaks = roofline.measure(th)
        if peaks is not None:
            res["threads"][th]["roofline"] = roofline.suite_rows(work, sizes, context, peaks, med)
    res["load_after"] = round(os.getloadavg()[0], 2)
    res["compile_s"] = {name: v.compile_s for name, v in variants.items() if hasattr(v, "compile_s")}
    return res


def _cpu_flags() -> list[str]:
    return sorted(x for x in cpu.flags() if x.startswith(("amx", "avx512_bf16", "avx512f", "avx2")))


def forward_markdown(r: dict, command: str) -> str:
    sizes = r["sizes"]
    load = (f"1-min load average {r['load_before']} before, {r['load_after']} after" if "load_before" in r
            else r.get("conditions", ""))
    lines = [f"# Target forward cost (SmolLM2-135M, {r['context']}-token cache, {r['repeats']} repeats, "
             f"variants interleaved call by call; {load})", "", f"`{command}`", "",
             f"torch {r['torch']}; CPU flags: {', '.join(r['cpu_flags']) or '?'}. Reference: {r['reference']}. "
             f"decoding.forward.kernels: {r.get('cpu_kernels', '?')}.", "",
             "Each variant is its own loaded copy of the model: copies of one model have differed by up to ~10% "
             "in GEMM time alone (the same kernel over weights placed elsewhere in memory; "
             "reports/forward-2026-11-27-row-attention), so a ratio between two variants of one dtype under ~1.1x "
             "is not evidence; the cost over a variant's own 1-token forward is.", ""]
    for name, per in r.get("compile_s", {}).items():
        lines += [f"{name}: compile seconds per size " + ", ".join(f"n={n}: {s:.0f}" for n, s in per.items())
                  + " (paid once per process and size; a probe, not an engine forward)", ""]
    for th, t in r["threads"].items():
        head = " | ".join(f"n={n}" for n in sizes)
        lines += [f"## {th} thread(s)", "", "Median ms per forward (n new tokens) [ratio to the reference]:", "",
                  f"| variant | {head} |", "|---|" + "---|" * len(sizes)]
        for name, med in t["median_ms"].items():
            cells = " | ".join(f"{med[n]:.1f} [{t['over_reference'][name][n]:.2f}x]" for n in sizes)
            lines.append(f"| {name} | {cells} |")
        lines += ["", "Cost over a 1-token forward of the same variant:", "", f"| variant | {head} |",
                  "|---|" + "---|" * len(sizes)]
        for name, x in t["over_one_token"].items():
            lines.append(f"| {name} | " + " | ".join(f"{x[n]:.2f}" for n in sizes) + " |")
        if "roofline" in t:
            lines += [""] + roofline.markdown(t["roofline"], sizes, th)
        lines += ["", "torch.profiler, one forward: GEMM share of self CPU time (whole-layer calls apart: their GEMMs "
                  "are inside), op count, top ops:", "",
                  "| variant | n | ops | GEMM share | whole-layer calls | top ops (ms) |", "|---|---|---|---|---|---|"]
        for name, per in t["profile"].items():
            for n, p in per.items():
                top = ", ".join(f"{k} {v}" for k, v in p["top"])
                lines.append(f"| {name} | {n} | {p['ops']} | {p['gemm_share']:.0%} | {p.get('layer_share', 0):.0%} | {top} |")
        lines.append("")
    lines += ["## Agreement with the reference (logits of every size)", "", "| variant | same argmax | max abs diff |",
              "|---|---|---|"]
    for name, a in r["agreement"].items():
        lines.append(f"| {name} | {a['same_argmax']} | {a['max_abs_diff']:.3g} |")
    return "\n".join(lines) + "\n"
