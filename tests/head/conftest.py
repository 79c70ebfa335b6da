"""The feature head's fixtures: a briefly fitted head on a 4-layer target, a random head over 4 of
6 ids for exact sampling, and a head target with its corpus (one per module)."""

import pytest

from support.head import fit_head, make_head_corpus, tiny_feature_draft
from support.models import tiny_llama


@pytest.fixture(scope="module")
def feature_pair():
    target = tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6)
    return target, fit_head(target)


@pytest.fixture(scope="module")
def tiny_pair():
    target = tiny_llama(0, vocab=6, layers=2, hidden=16, scale=3)
    # 4 of the 6 ids: the two others reach the output only through residual resampling
    return target, tiny_feature_draft(target, draft_vocab=4, aux=(0, 1, 1), seed=3)


@pytest.fixture(scope="module")
def head_corpus(tmp_path_factory):
    """(target dir, corpus dir, cache root) for the whole module."""
    return make_head_corpus(tmp_path_factory.mktemp("feature"))
