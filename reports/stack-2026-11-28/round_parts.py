"""A steady plain round's parts (batched ar, 1 and 4 requests): round, verify, the 30 layers' call."""
import sys, time, torch
torch.set_num_threads(2)
from decoding import Decoder
import decoding.batch.forward as bf
import decoding.batch.scheduler as sch
from decoding.batch.scheduler import BatchEngine
from decoding.batch.bench import PROMPTS
dec = Decoder.load(strategy="ar"); s = dec.session
ids = [dec.prompt_ids(p, chat=True, max_new_tokens=96) for p in PROMPTS]
T = {}
def wrap(mod, name, key):
    f = getattr(mod, name)
    def g(*a, **k):
        t = time.perf_counter(); out = f(*a, **k); T[key] = T.get(key, 0) + time.perf_counter() - t; return out
    setattr(mod, name, g)
wrap(bf, "_one_call_stack", "stack")
wrap(sch, "verify_many", "verify")
st_op = None
for n in (1, 4):
    for rep in range(3):
        T.clear()
        e = BatchEngine(s.target, None)
        reqs = [e.add(ids[i], 200, eos_token_id=[]) for i in range(n)]
        for _ in range(3): e.step()   # prefill + warm
        T.clear(); k = 60
        t = time.perf_counter()
        for _ in range(k): e.step()
        wall = (time.perf_counter() - t) / k
        print(f"n={n}: round {1e3*wall:.2f} ms, verify {1e3*T['verify']/k:.2f}, stack call {1e3*T['stack']/k:.2f}", flush=True)
