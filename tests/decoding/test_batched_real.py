"""Marked `real`: batched rounds on the embedded SmolLM2 target (its GGUF blocks, lean forward)
and the shipped feature head. Its quantized linears and attention take any row count alike, so
the stacked verify gives each request the bits of its batch-1 forward even past 100 rows, and
every request's greedy text equals `ar`'s."""

import pytest
import torch

from decoding import Decoder
from decoding.batch.budget import JointGrow
from decoding.batch.forward import Segment, verify_many
from decoding.batch.scheduler import BatchEngine
from decoding.growth import q_scores
from decoding.kv_cache import CachedModel
from decoding.sampling import SamplingConfig
from decoding.tree import layout_from_k_config

pytestmark = pytest.mark.real
PROMPTS = ["Hi there.", "Explain recursion to a beginner.", "Why is the sky blue?"]
N = 24


@pytest.fixture(scope="module")
def dec():
    return Decoder.load()


@pytest.mark.parametrize("threads", [1, 2])
def test_stacked_rows_are_batch1_rows(dec, threads):
    """The prompts with a tree (> 100 rows), a tree after a commit, then small trees (a thread a
    request on 2 threads): each request's logits are its batch-1 logits bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m = dec.session.target
        texts = [dec.prompt_ids(p, chat=True) for p in PROMPTS]
        solo, bat = [CachedModel(m) for _ in texts], [CachedModel(m) for _ in texts]
        for k in ([4, 1, 1], [4, 1, 1], [2, 1], [2, 1]):
            lay = layout_from_k_config(k)
            toks = [[100 + 37 * i + j for i in range(lay.size)] for j in range(3)]
            want = [c.feed(t, lay, tk, 0, lay.size)[0] for c, t, tk in zip(solo, texts, toks)]
            got = verify_many(m, [Segment(c, t, lay, tk) for c, t, tk in zip(bat, texts, toks)])
            assert all(torch.equal(w, g) for w, g in zip(want, got))
            for c1, c2 in zip(solo, bat):
                c1.commit([0, k[0]], lay.size)
                c2.commit([0, k[0]], lay.size)
            texts = [t + [tk[0], tk[k[0]], 42] for t, tk in zip(texts, toks)]
    finally:
        torch.set_num_threads(before)


def test_batched_head_rounds_equal_ar(dec):
    s, cfg = dec.session, dec.config
    ids = [dec.prompt_ids(p, chat=True) for p in PROMPTS]
    ar = dec.variant("ar").engine(SamplingConfig())
    want = [ar.generate(p, N, s.eos_token_id)[0] for p in ids]
    budget = JointGrow(q_scores, s.measured_cost(), max_width=max(cfg.k_levels), max_nodes=cfg.max_nodes)
    eng = BatchEngine(s.target, s.draft, layout_from_k_config(cfg.k_levels), budget=budget)
    reqs = [eng.add(ids[0], N, eos_token_id=s.eos_token_id)]
    eng.step()
    reqs.append(eng.add(ids[1], N, eos_token_id=s.eos_token_id))
    eng.step()
    reqs.append(eng.add(ids[2], N, eos_token_id=s.eos_token_id))
    eng.run()
    assert [r.out for r in reqs] == want
    assert sum(r.stats.accepted for r in reqs) > 0
