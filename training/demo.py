"""`make demo`: the main job end to end on the embedded default pair.

collect decider traces on a few prompts -> fit a decider (Lightning, threshold by replay
with a cost model measured here) -> generate with it, next to fixed depth. Everything the
demo writes goes under runs/demo/ (the shipped decider and registry are left alone); each
run starts from an empty runs/demo/, so traces of an earlier pair (e.g. before a new default
draft) are never mixed in.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

OUT = Path("runs/demo")
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def main() -> int:
    from decoding import generate
    from training import collect, fit

    if OUT.exists():
        print(f"demo: clearing {OUT}/ (the demo's own output from an earlier run)", flush=True)
        shutil.rmtree(OUT)
    steps = [
        ("collect", lambda: collect.main([
            "--config", "configs/collect.yaml", "--out", str(OUT / "traces"), "--max-prompts", "24",
            "--max-new-tokens", "48", "--threads", "2"])),
        ("fit", lambda: fit.main([
            "--config", "configs/fit_decider.yaml", "--data.traces", str(OUT / "traces"),
            "--data.val_fraction", "0.25", "--data.test_fraction", "0.25", "--trainer.max_epochs", "5",
            "--trainer.default_root_dir", str(OUT / "fit"), "--trainer.logger", "false",
            "--export.out", str(OUT / "deciders"), "--export.reports", str(OUT / "reports"),
            "--export.run_id", "demo"])),
    ]
    for name, step in steps:
        print(f"== {name}", flush=True)
        rc = step()
        if rc:
            print(f"demo: step {name} failed (exit {rc})", file=sys.stderr)
            return rc
    rows = []
    for label, extra in (("fixed depth", ["--stop", "fixed"]),
                         ("confidence", ["--stop", "confidence"]),
                         ("confidence (tree)", ["--stop", "confidence", "--confidence-rule", "tree",
                                                "--confidence-threshold", "0.15"]),
                         ("decider", ["--stop", "decider", "--decider", str(OUT / "deciders" / "demo")])):
        print(f"== generate ({label})", flush=True)
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = generate.main(["--chat", "--prompt", PROMPT, "--strategy", "ti-mcsd", "--dtype", "bfloat16",
                                "--max-new-tokens", "96", "--json", *extra])
        if rc:
            return rc
        res = json.loads(buf.getvalue())
        rows.append((label, res["stats"]))
        if label == "fixed depth":
            print(res["text"])
    print("\n| stop policy | tok/s | block efficiency | acceptance | mean tree size | target calls | lossless |")
    print("|---|---|---|---|---|---|---|")
    for label, s in rows:
        print(f"| {label} | {s['tokens_per_s']} | {s['block_efficiency']} | {s['acceptance_rate']} | "
              f"{s['mean_tree_size']} | {s['target_calls']} | {s['lossless']} |")
    print(f"\ndecider report: {OUT / 'reports' / 'demo' / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
