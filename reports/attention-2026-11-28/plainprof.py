import cProfile, pstats, time, torch
torch.set_num_threads(2)
from decoding import Decoder
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine
import decoding
dec = Decoder.load()
s = SamplingConfig()
spec = dec.engine(s)
spec.measured.drafts = lambda n: False
ar = build_engine(dec.session.target, None, StrategyConfig(strategy="ar"), s)
eos = dec.session.eos_token_id
text = open(decoding.__file__.replace("__init__.py", "engine.py")).read()
ids = dec.prompt_ids("Summarise what this code does:\n" + text, chat=True, max_new_tokens=128)[-1200:]
for eng in (spec, ar, spec, ar):
    eng.generate(ids, 8, eos)
    t = time.perf_counter(); out, st = eng.generate(ids, 96, eos); tot = time.perf_counter() - t
    print(eng.name, f"{tot*1e3:.0f} ms for 96 incl prefill; verify {st.verify_s*1e3:.0f} draft {st.draft_s*1e3:.0f} book {st.bookkeeping_s*1e3:.0f}")
pr = cProfile.Profile(); pr.enable(); spec.generate(ids, 96, eos); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(12)
