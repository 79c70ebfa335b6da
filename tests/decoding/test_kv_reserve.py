"""CachedModel.reserve: a request's cache buffers are made once, at the size its prompt, new tokens
and a tree need, so no round copies the cache into a doubled buffer; what the cache holds and the
logits are those of an unreserved cache; past the reservation it doubles as before."""

import torch

from decoding.batch.scheduler import TREE_ROWS, BatchEngine, reserve_for
from decoding.kv_cache import CachedModel
from decoding.tree import TreeLayout
from support.models import tiny_llama


def _buffers(cm: CachedModel) -> list[int]:
    return [layer._kb.untyped_storage().data_ptr() for layer in cm.cache.layers]


def test_a_reserved_cache_is_allocated_once_and_computes_the_same():
    model = tiny_llama(0, vocab=32, layers=2)
    plain, held = CachedModel(model), CachedModel(model)
    held.reserve(100)
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    want = plain.feed(seq, TreeLayout(()), [], 0, 0)[0]
    got = held.feed(seq, TreeLayout(()), [], 0, 0)[0]
    assert torch.equal(got, want)
    assert all(layer._kb.shape[-2] == 100 for layer in held.cache.layers)
    first = _buffers(held)
    for tok in range(92):  # to 100 entries: the same buffers throughout
        seq.append(tok % 32)
        assert torch.equal(held.feed(seq, TreeLayout(()), [], 0, 0)[0], plain.feed(seq, TreeLayout(()), [], 0, 0)[0])
        assert _buffers(held) == first
    seq.append(7)  # one past the reservation: a new buffer, twice what is needed
    held.feed(seq, TreeLayout(()), [], 0, 0)
    assert _buffers(held) != first and held.cache.layers[0]._kb.shape[-2] == 2 * len(seq)
    held.reset()  # a rebuilt cache keeps its reservation
    held.feed(seq[:3], TreeLayout(()), [], 0, 0)
    assert held.cache.layers[0]._kb.shape[-2] == 100


def test_the_batched_engine_reserves_prompt_new_tokens_and_a_tree_within_the_context():
    model = tiny_llama(0, vocab=32, layers=2, max_pos=256)
    assert reserve_for(model, 30, 16) == 30 + 16 + TREE_ROWS
    assert reserve_for(model, 200, 10_000) == 256 + TREE_ROWS  # never past the model's context
    engine = BatchEngine(model, None, TreeLayout(()))
    r = engine.add([1, 2, 3, 4, 5], 6)
    assert r.cache.reserved == 5 + 6 + TREE_ROWS
    engine.run()
    assert len(r.out) == 6
