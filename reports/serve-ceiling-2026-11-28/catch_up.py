"""The shipped head's catch-up step (4 / 64 / 300 committed rows, causal, a fresh cache), with
every row's logits and with the last row's only (what a catch-up reads): best of 7, in turn.
`python catch_up.py`."""
import time, torch
torch.set_num_threads(2)
from decoding import Decoder
from decoding.drafts import lean_step
from decoding.drafts.feature import DraftKV
dec = Decoder.load(); head = dec.session.draft
H = head.config.hidden_size
for K in (4, 64, 300):
    toks = torch.randint(0, 1000, (1, K)); hid = torch.randn(1, K, H); pos = torch.arange(K)[None]
    best = {False: 1e9, True: 1e9}
    with torch.inference_mode():
        for rep in range(7):
            for last in (False, True):
                t = time.perf_counter(); lean_step.step(head, toks, hid, pos, DraftKV(), None, last); best[last] = min(best[last], time.perf_counter() - t)
    print(f"catch-up of {K} rows: every row's logits {1e3*best[False]:.2f} ms, the last row's only {1e3*best[True]:.2f} ms")
