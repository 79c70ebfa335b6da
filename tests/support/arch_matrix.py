"""The architecture matrix's cases: every strategy and stop rule, the prompts (longer than the
window) and the cached tiny models of each architecture with HF's own greedy reference
(tests/decoding/test_greedy_on_every_architecture.py; the CUDA proofs reuse them)."""

from functools import cache

import torch

from decoding.forward.cost import CostCurve
from decoding.growth import GrowPolicy, q_scores
from decoding.stopping import DraftConfidence
from decoding.strategies import StrategyConfig
from support.engine import random_decider
from support.models import noisy_copy, tiny

PROMPTS = [[1, 5, 7, 3, 9, 11, 2, 4, 8, 30], [3, 3, 3, 17, 5, 22]]  # both longer than WINDOW + 1
N = 16


# a flat target cost with a cheap draft: the grown trees are large and vary in shape
GENTLE = CostCurve([1, 4, 16, 64], [10.0, 10.4, 11.5, 16.0], [0.5] * 4)


def _fork(stop="fixed", **kw):
    return StrategyConfig(strategy="ti-mcsd", width=2, depth=5, stop=stop, **kw)


# id -> (strategy, stop policy factory taking the draft, or None for the config's own)
CASES = {
    "sd": (StrategyConfig(strategy="sd", gamma=4), None),
    "mcsd": (StrategyConfig(strategy="mcsd", k_config="2,2,1"), None),
    "ti-mcsd": (_fork(), None),
    "confidence-level": (_fork("confidence", confidence_threshold=0.6), None),
    "confidence-tree": (StrategyConfig(strategy="mcsd", k_config="3,2,2", stop="confidence"),
                        lambda d: DraftConfidence(0.05, rule="tree")),
    "grow-q": (_fork("confidence", confidence_rule="grow"),
               lambda d: GrowPolicy(q_scores, GENTLE, max_width=2, max_nodes=16)),
    "decider-specdecpp": (_fork("decider"), lambda d: random_decider("specdecpp", 0.5)),
    "decider-tree-hidden": (_fork("decider"), lambda d: random_decider(
        "tree", 0.3, kind="hidden", hidden_size=d.config.hidden_size)),
}


@cache
def models(arch):
    target = tiny(arch)
    return target, noisy_copy(target, 0.003)


@cache
def reference(arch, prompt):
    with torch.no_grad():
        out = models(arch)[0].generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
