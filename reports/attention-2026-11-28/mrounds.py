import sys, time, torch
torch.set_num_threads(2)
from decoding import Decoder
import decoding
dec = Decoder.load()
eng = dec.engine(__import__("decoding.sampling", fromlist=["SamplingConfig"]).SamplingConfig())
text = open(decoding.__file__.replace("__init__.py", "engine.py")).read()
full = dec.prompt_ids("Summarise what this code does:\n" + text, chat=True, max_new_tokens=128)
eos = dec.session.eos_token_id
log = []
real = eng.measured.record
eng.measured.record = lambda b, d, n, ms: (log.append((b, d, n, round(ms, 1))), real(b, d, n, ms))
eng.measured.warmup = 10**9  # alternate
for n in (150, 1200):
    log.clear()
    out, st = eng.generate(full[-n:], 64, eos)
    dr = [x for x in log if x[1]]; pl = [x for x in log if not x[1]]
    print(n, "drafted", sum(x[2] for x in dr), "tok in", round(sum(x[3] for x in dr)), "ms;", dr[:8])
    print(n, "plain", sum(x[2] for x in pl), "tok in", round(sum(x[3] for x in pl)), "ms;", pl[:8])
