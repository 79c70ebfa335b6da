"""Tiny random Llama models built in the tests (vocab <= 64, 1-2 layers) for speed."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)

# The minute-long modules first: xdist hands work out in collection order, a worker holding up
# to 3 queued tests, so long tests met at the end of the run leave the other worker idle.
LONG_FIRST = ("test_sampling_exact.py", "test_growth.py", "test_feature_decoding.py",
              "test_real_target.py", "test_retrain.py", "test_failures.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # stable otherwise


def tiny_llama(seed=0, vocab=32, layers=2, hidden=32, scale=1.0, max_pos=256):
    """A random Llama; `scale` sharpens its next-token distributions."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_pos, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def noisy_copy(model, noise, seed=1):
    """A draft that agrees with the target often but not always."""
    torch.manual_seed(seed)
    d = copy.deepcopy(model)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * noise)
    return d


@pytest.fixture(scope="session")
def pair():
    target = tiny_llama(0, scale=6)
    return target, noisy_copy(target, 0.03)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny, sharp random Llama target saved as an HF directory with a tokenizer."""
    from distill_fixtures import make_target

    return make_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def corpus_dir(target_dir, tmp_path_factory):
    """A toy corpus written by the tiny target, with its teacher top-k cached."""
    from distill_fixtures import make_corpus

    return make_corpus(target_dir, tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def on_policy_dir(target_dir, corpus_dir, tmp_path_factory):
    """An on-policy corpus for the tiny target: a random draft writes, the target scores."""
    from distill_fixtures import make_on_policy_corpus

    return make_on_policy_corpus(target_dir, corpus_dir, tmp_path_factory.mktemp("onpolicy"))
