"""The feature head's fixtures: a head target with its corpus (one per module; the decoding pairs
`feature_pair` and `tiny_pair` are in tests/conftest.py, shared with tests/round)."""

import pytest

from support.head import make_head_corpus


@pytest.fixture(scope="module")
def head_corpus(tmp_path_factory):
    """(target dir, corpus dir, cache root) for the whole module."""
    return make_head_corpus(tmp_path_factory.mktemp("feature"))
