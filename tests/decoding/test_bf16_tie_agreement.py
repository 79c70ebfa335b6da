"""decoding.bench.agreement: equal / tie / mismatch on hand-made cases of tiny random models."""

import math

import pytest
import torch

from support.models import noisy_copy, tiny_llama
from decoding.bench.agreement import GreedyCheck, check_greedy, count_kinds, first_difference, fp32_logits, ulp
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine

PROMPT = [3, 1, 4, 1, 5]
N = 12


def greedy(model, prompt=PROMPT, n=N):
    eng = build_engine(model, None, StrategyConfig(strategy="ar"), SamplingConfig())
    return eng.generate(prompt, n)[0]


@pytest.fixture(scope="module")
def tied():
    """A bf16 model whose output rows of tokens a and b are identical: an exact tie wherever
    a or b is the best token. Returns (model, ref, partner of ref[0])."""
    model = tiny_llama(5, scale=6)
    a = greedy(model)[0]
    b = (a + 1) % model.config.vocab_size
    with torch.no_grad():
        model.lm_head.weight[b] = model.lm_head.weight[a]
    model = model.to(torch.bfloat16)
    ref = greedy(model)
    assert ref[0] in (a, b)
    return model, ref, b if ref[0] == a else a


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([], []) is None
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a strict prefix differs where it ends
    assert first_difference([5], [6]) == 0


def test_ulp():
    assert ulp(1.0, "bfloat16") == 2 ** -7 and ulp(-20.0, "bfloat16") == 0.125
    assert ulp(1.5, "float16") == 2 ** -10
    assert ulp(20.0, "float32") == 0.0


def test_identical_outputs_are_equal(tied):
    model, ref, _ = tied
    assert check_greedy(model, PROMPT, ref, list(ref), "bfloat16") == GreedyCheck("equal")


def test_forced_tie_is_a_tie_in_bf16_and_a_mismatch_in_fp32(tied):
    model, ref, partner = tied
    out = [partner] + ref[1:]
    c = check_greedy(model, PROMPT, ref, out, "bfloat16")
    assert c.kind == "tie" and c.position == 0 and c.gap == 0.0 and c.tolerance > 0
    # fp32 stays bit for bit: the same flip is a mismatch
    assert check_greedy(model, PROMPT, ref, out, "float32").kind == "mismatch"


def test_large_gap_is_a_mismatch(tied):
    model, ref, _ = tied
    j = 3
    logits = fp32_logits(model, PROMPT + ref[:j])
    worst = int(logits.argmin())
    c = check_greedy(model, PROMPT, ref, ref[:j] + [worst] + ref[j + 1:], "bfloat16")
    assert c.kind == "mismatch" and c.position == j and c.gap > c.tolerance
    assert c.gap == pytest.approx(float(logits.max() - logits.min()))


def test_tie_between_two_tokens_below_the_top_is_a_mismatch(tied):
    """Both tokens must be near the best logit, not merely near each other."""
    model, ref, partner = tied
    j = next((i for i in range(1, N) if ref[i] not in (ref[0], partner)), None)
    assert j is not None  # a position where the tied pair is not the best token
    assert check_greedy(model, PROMPT, ref[:j] + [ref[0]], ref[:j] + [partner], "bfloat16").kind == "mismatch"


def test_tolerance_boundary(tied):
    """The runner-up at a position is a tie exactly when the gap is within `ulps` ulps."""
    model, ref, _ = tied
    j = 2
    logits = fp32_logits(model, PROMPT + ref[:j])
    second = int(logits.topk(2).indices[1])
    gap = float(logits.max() - logits[second])
    assert gap > 0
    u = ulp(float(logits.max()), "bfloat16")
    out = ref[:j] + [second]
    assert check_greedy(model, PROMPT, ref, out, "bfloat16", ulps=math.ceil(gap / u) + 1).kind == "tie"
    assert check_greedy(model, PROMPT, ref, out, "bfloat16", ulps=math.floor(gap / u) - 1).kind == "mismatch"


def test_early_stop_is_a_mismatch(tied):
    model, ref, _ = tied
    assert check_greedy(model, PROMPT, ref, ref[:-2], "bfloat16").kind == "mismatch"


def test_count_kinds_and_a_lossy_mode_is_caught(pair):
    """The longest-branch mode (lossy) produces at least one mismatch, never a mere tie (fp32)."""
    target, _ = pair
    draft = noisy_copy(target, 0.2)
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), SamplingConfig())
    lossy = build_engine(target, draft, StrategyConfig(strategy="ti-mcsd", width=4, depth=4,
                                                       mode="longest-branch"), SamplingConfig())
    checks = []
    for p in ([1, 5, 7, 3], [2], [9, 9, 4, 11]):
        ref, out = ar.generate(p, 40)[0], lossy.generate(p, 40)[0]
        checks.append(check_greedy(target, p, ref, out, "float32"))
    kinds = count_kinds(checks)
    assert kinds["mismatch"] >= 1 and kinds["tie"] == 0 and sum(kinds.values()) == 3
    assert count_kinds(["equal", "tie", "tie"]) == {"equal": 1, "tie": 2, "mismatch": 0}


def test_fp32_reference_of_a_packed_bf16_target():
    """The tie check copies the target to float32; oneDNN's packed weights cannot be deep-copied,
    so the copy is made from the eager model and the target keeps its packed forward."""
    from decoding.forward.packed import forward_kind, packed_available, set_forward

    model = tiny_llama(3, vocab=32).to(torch.bfloat16)
    if not packed_available(torch.bfloat16, "cpu"):
        pytest.skip("no oneDNN bf16 on this CPU")
    set_forward(model, "packed")
    logits = fp32_logits(model, [1, 2, 3])
    assert logits.dtype == torch.float32 and logits.shape == (32,)
    assert forward_kind(model) == "packed"
