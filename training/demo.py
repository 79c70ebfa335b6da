"""`make demo`: the main job end to end on the embedded default pair.

collect decider traces on a few prompts -> fit a decider (Lightning, threshold by replay
with a cost model measured here) -> generate with plain decoding (`ar`), the default
configuration (decoding/defaults.yaml) and each stop policy on the W4 D6 tree, with the
speedup over `ar` of each. The models are loaded once for all rows (decoding.Decoder).
Everything the demo writes goes under --out (runs/demo/; the shipped decider and registry are
left alone); each run starts from an empty --out, so traces of an earlier pair (e.g. before a
new default draft) are never mixed in. --target / --draft / --prompts run it on another pair
(the tests use a tiny one).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from decoding.options import add_option

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m training.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(ap, "out", default="runs/demo")
    add_option(ap, "target")
    add_option(ap, "draft")
    add_option(ap, "prompts_file", unset="collect.yaml's")
    ap.add_argument("--max-prompts", type=int, default=24, help="prompts to collect traces on")
    ap.add_argument("--collect-new-tokens", type=int, default=48, help="new tokens per collected prompt")
    add_option(ap, "prompt", default=PROMPT)
    add_option(ap, "max_new_tokens", default=96)
    add_option(ap, "cost_model")
    add_option(ap, "threads", default=2)
    return ap


def steps(a, out: Path) -> list:
    from training.decider import collect
    from training.decider import fit

    pair = [*(["--target", a.target] if a.target else []), *(["--draft", a.draft] if a.draft else [])]
    replay_pair = [*(["--replay.target", a.target] if a.target else []),
                   *(["--replay.draft", a.draft] if a.draft else [])]
    return [
        ("collect", lambda: collect.main([
            "--config", "configs/collect.yaml", "--out", str(out / "traces"), "--max-prompts", str(a.max_prompts),
            "--max-new-tokens", str(a.collect_new_tokens), "--threads", str(a.threads), *pair,
            *(["--prompt-files", a.prompts_file] if a.prompts_file else [])])),
        ("fit", lambda: fit.main([
            "--config", "configs/fit_decider.yaml", "--data.traces", str(out / "traces"),
            "--data.val_fraction", "0.25", "--data.test_fraction", "0.25", "--trainer.max_epochs", "5",
            "--trainer.default_root_dir", str(out / "fit"), "--trainer.logger", "false",
            "--replay.cost_model", a.cost_model, *replay_pair, "--threads", str(a.threads),
            "--export.out", str(out / "deciders"), "--export.reports", str(out / "reports"),
            "--export.run_id", "demo"])),
    ]


def rows(base, decider: str) -> list:
    """(label, Decoder) for the table; all share base's loaded models."""
    tree = dict(strategy="ti-mcsd", width=4, depth=6, mode="lossless")
    # the entry's options, in the dtype the target really runs (a GGUF target runs float32 even
    # where the entry for this CPU names bfloat16)
    d = replace(base.defaults, dtype=str(base.session.target.dtype).removeprefix("torch."))
    return [
        ("ar (plain decoding)", base),
        (f"default: {d.describe()}", base.default_variant(decider="latest")),
        ("W4 D6 fixed depth", base.variant(**tree, stop="fixed")),
        ("W4 D6 confidence", base.variant(**tree, stop="confidence", confidence_threshold=0.4,
                                          confidence_rule="level")),
        ("W4 D6 confidence (tree)", base.variant(**tree, stop="confidence", confidence_threshold=0.15,
                                                 confidence_rule="tree")),
        ("W4 D6 decider", base.variant(**tree, stop="decider", decider=decider, decider_rule=None)),
    ]


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    out = Path(a.out)
    if out.exists():
        print(f"demo: clearing {out}/ (the demo's own output from an earlier run)", flush=True)
        shutil.rmtree(out)
    for name, step in steps(a, out):
        print(f"== {name}", flush=True)
        rc = step()
        if rc:
            print(f"demo: step {name} failed (exit {rc})", file=sys.stderr)
            return rc
    import torch

    from decoding import Decoder
    from decoding.models import ModelError

    torch.set_num_threads(a.threads)
    try:
        base = Decoder.load(a.target, a.draft, strategy="ar")
        table = rows(base, str(out / "deciders" / "demo"))
        for _, dec in table[:3]:  # warm-up, so the first row timed does not pay for it
            dec.generate(a.prompt, max_new_tokens=4, chat=True)
        results = []
        for label, dec in table:
            print(f"== generate ({label})", flush=True)
            results.append((label, dec.generate(a.prompt, max_new_tokens=a.max_new_tokens, chat=True)))
    except (ModelError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(results[0][1].text)
    ar_tps = results[0][1].stats["tokens_per_s"]
    print(f"\n{base.session.target.dtype}, one run each (tokens/s on a shared machine is noisy)")
    print("\n| configuration | tok/s | speedup vs ar | block efficiency | acceptance | mean tree size | "
          "target calls | lossless |")
    print("|---|---|---|---|---|---|---|---|")
    for label, res in results:
        s = res.stats
        print(f"| {label} | {s['tokens_per_s']} | {s['tokens_per_s'] / ar_tps:.2f}x | {s['block_efficiency']} | "
              f"{s['acceptance_rate']} | {s['mean_tree_size']} | {s['target_calls']} | {s['lossless']} |")
    print(f"\ndecider report: {out / 'reports' / 'demo' / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
