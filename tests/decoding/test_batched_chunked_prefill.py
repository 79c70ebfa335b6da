"""Chunked prefill in batched rounds: a long prompt fed `chunk` tokens a round beside the running
requests' trees changes no request's greedy output (its own included), with a stand-alone draft
and with a feature head reading the chunks' features; its exact sampling is in
test_batched_sampling.py (chunked-prompts)."""

import pytest
import torch

from decoding.batch.scheduler import BatchEngine
from decoding.options import fork_k_config
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine
from decoding.tree import layout_from_k_config
from support.head import fit_head
from support.models import tiny_llama

N = 16
LAYOUT = layout_from_k_config(fork_k_config(2, 3))


def prompts(vocab):
    g = torch.Generator().manual_seed(0)
    return [[1, 5, 7], torch.randint(0, vocab, (70,), generator=g).tolist(), [2, 9]]


def run(engine, ps, joins):
    reqs, first = {}, {}
    while len(reqs) < len(ps) or engine.active:
        for i, (p, j) in enumerate(zip(ps, joins)):
            if i not in reqs and engine.rounds >= j:
                reqs[i] = engine.add(p, N)
        engine.step()
        for i, r in reqs.items():
            if r.out and i not in first:
                first[i] = engine.rounds - joins[i]
    return [reqs[i].out for i in range(len(ps))], first


@pytest.mark.parametrize("draft_kind", ["standalone", "feature-head"])
def test_a_chunked_prompt_changes_no_greedy_output(pair, draft_kind):
    target, draft = pair if draft_kind == "standalone" else (lambda t: (t, fit_head(t)))(
        tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6))
    ps = prompts(target.config.vocab_size)
    ar = build_engine(target, None, StrategyConfig("ar"), SamplingConfig())
    want = [ar.generate(p, N)[0] for p in ps]
    got, first = run(BatchEngine(target, draft, LAYOUT, chunk=16), ps, [0, 2, 3])
    assert got == want
    assert first[1] >= 70 // 16  # the long prompt took several rounds, the others ran meanwhile
    assert first[0] == 1 and first[2] == 1
