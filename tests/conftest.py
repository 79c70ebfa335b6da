"""Fixtures shared across areas (tiny models, model directories, corpora); their builders live in
the support package (tests/support/), each area's own fixtures in its folder's conftest.py."""

import pytest

import decoding  # noqa: F401  before torch: $SPECSTOP_CPU=avx2 holds torch's kernels to AVX2
import torch  # noqa: E402, I001

from support.head import fit_head, tiny_feature_draft
from support.models import noisy_copy, tiny_llama

torch.set_num_threads(1)

# The minute-long modules first: xdist hands work out in collection order, a worker holding up
# to 3 queued tests, so long tests met at the end of the run leave the other worker idle.
LONG_FIRST = ("test_exact_sampling.py", "test_cost_aware_growth.py", "test_decoding_with_a_head.py",
              "test_batched_sampling.py", "test_static_cache.py", "test_real_target_greedy.py",
              "test_scheduled_retrain.py", "test_fault_table.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # stable otherwise


@pytest.fixture(scope="session")
def pair():
    target = tiny_llama(0, scale=6)
    return target, noisy_copy(target, 0.03)


@pytest.fixture(scope="module")
def feature_pair():
    """A briefly fitted feature head on a 4-layer target (drafts get accepted)."""
    target = tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6)
    return target, fit_head(target)


@pytest.fixture(scope="module")
def tiny_pair():
    """A random head over 4 of 6 ids, for exact sampling."""
    target = tiny_llama(0, vocab=6, layers=2, hidden=16, scale=3)
    # 4 of the 6 ids: the two others reach the output only through residual resampling
    return target, tiny_feature_draft(target, draft_vocab=4, aux=(0, 1, 1), seed=3)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny, sharp random Llama target saved as an HF directory with a tokenizer."""
    from support.distill import make_target

    return make_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def corpus_dir(target_dir, tmp_path_factory):
    """A toy corpus written by the tiny target, with its teacher top-k cached."""
    from support.distill import make_corpus

    return make_corpus(target_dir, tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def on_policy_dir(target_dir, corpus_dir, tmp_path_factory):
    """An on-policy corpus for the tiny target: a random draft writes, the target scores."""
    from support.distill import make_on_policy_corpus

    return make_on_policy_corpus(target_dir, corpus_dir, tmp_path_factory.mktemp("onpolicy"))


@pytest.fixture(scope="module")
def damaged_champion(tmp_path_factory):
    """(root, target dir, champion dir) for training.head.redistill: a tiny head target, a 2-step
    distill config and a champion head that never agrees (its lm_head zeroed). Used by the head's
    redistill tests and the serve gate's."""
    from support.head import make_redistill_run

    return make_redistill_run(tmp_path_factory.mktemp("redistill"))
