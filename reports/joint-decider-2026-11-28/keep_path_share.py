"""keep_path's share of batch-1 generate (the default, the 8 bench chat prompts x 96 tokens): run in
each checkout (`PYTHONPATH=CHECKOUT python keep_path_share.py`), ms a call and % of the wall."""
import time, torch
torch.set_num_threads(2)
import decoding.kv_cache as kc
from decoding import Decoder
from decoding.batch.bench import PROMPTS
from decoding.sampling import SamplingConfig
spent = {"calls": 0, "s": 0.0}
inner = kc.keep_path
def timed(*a, **k):
    t = time.perf_counter(); r = inner(*a, **k); spent["s"] += time.perf_counter() - t; spent["calls"] += 1; return r
kc.keep_path = timed  # CachedModel.commit looks it up in the module
dec = Decoder.load(); eng = dec.engine(SamplingConfig())
ids = [dec.prompt_ids(p, chat=True, max_new_tokens=96) for p in PROMPTS]
t = time.perf_counter(); n = 0
for x in ids:
    n += len(eng.generate(x, 96, dec.session.eos_token_id)[0])
w = time.perf_counter() - t
print(f"{kc.__file__}: {n / w:.0f} tok/s, keep_path {spent['calls']} calls, "
      f"{1e3 * spent['s'] / spent['calls']:.3f} ms a call, {100 * spent['s'] / w:.1f}% of the wall")
