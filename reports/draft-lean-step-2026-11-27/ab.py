"""The default (grown tree over the feature head) with the head's step on the CPU kernels (lean_step)
against the same head as torch modules: one loaded pair, the two alternating over 4 chat prompts x
96 tokens, 3 repeats, medians of tokens/s; outputs compared. Argument: torch threads (default 2).
Run from the repository root: .venv/bin/python reports/draft-lean-step-2026-11-27/ab.py [THREADS]"""
import statistics
import sys
import time

import torch
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
from decoding import Decoder
from decoding.drafts import lean_step
dec = Decoder.load()
d = dec.session.draft
prompts = ["Explain how a hash map works, with an example.", "Write a Python function that merges two sorted lists.",
           "What causes the seasons on Earth?", "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]
dec.generate(prompts[0], chat=True, max_new_tokens=16)
built = lean_step._build(d)
res = {}
for rep in range(3):
    for name, ls in (("lean", built), ("modules", None)):
        d._lean_step = ls
        t = time.perf_counter(); n = 0; outs = []
        for p in prompts:
            r = dec.generate(p, chat=True, max_new_tokens=96); n += len(r.token_ids); outs.append(r.token_ids)
        res.setdefault(name, []).append(n / (time.perf_counter() - t))
        res.setdefault(name + "_out", outs)
print({k: [round(x, 1) for x in v] for k, v in res.items() if not k.endswith("_out")})
print("lean/modules", round(statistics.median(res["lean"]) / statistics.median(res["modules"]), 3),
      "outputs equal:", res["lean_out"] == res["modules_out"])
