"""decoding.kv_cache: growing layers append in place and roll back by slicing, like transformers'
concatenating DynamicLayer, through the engine's commits (keep_path, cut_front, crop)."""

import pytest
import torch

from support.models import tiny_llama
from decoding.kv_cache import CachedModel, append_kv, crop, cut_front, keep_path, new_cache
from decoding.tree import TreeLayout


def _kv(t, fill=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, t, 4, generator=g)
    return x if fill is None else torch.full_like(x, fill)


def test_append_writes_into_spare_room_and_doubles_when_full():
    view, buf, ref = torch.empty(0), None, None
    for i, t in enumerate((3, 1, 1, 70, 2)):
        new = _kv(t, seed=i)
        ref = new if ref is None else torch.cat([ref, new], -2)
        old_buf = buf
        view, buf = append_kv(view, buf, new)
        assert torch.equal(view, ref)
        if old_buf is not None and ref.shape[-2] <= old_buf.shape[-2]:
            assert buf is old_buf  # room left: no new allocation, no copy of the cache
    assert buf.shape[-2] >= ref.shape[-2] and view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_append_after_a_cut_overwrites_the_dropped_rows_only():
    view, buf = append_kv(torch.empty(0), None, _kv(10))
    kept = view[..., :6, :]  # a rollback keeps 6 of 10
    view2, buf2 = append_kv(kept, buf, _kv(1, fill=7.0))
    assert buf2 is buf and torch.equal(view2[..., :6, :], kept) and (view2[..., 6, :] == 7).all()
    front = view2[..., 2:, :]  # a sliding layer drops its 2 oldest
    view3, _ = append_kv(front, buf2, _kv(1, fill=9.0))
    assert torch.equal(view3[..., :-1, :], front) and (view3[..., -1, :] == 9).all()
    other = torch.zeros(1, 2, 3, 4)  # not a view of the buffer (set from outside): copied, not aliased
    view4, buf4 = append_kv(other, buf, _kv(1, fill=1.0))
    assert buf4 is not buf and torch.equal(view4[..., :3, :], other) and (view4[..., 3, :] == 1).all()


def test_room_after_a_kernel_write_and_after_a_rollback():
    """room() skips its storage checks only while the views grown() left are the layer's: a
    rollback (a new view) or a full buffer takes the checked path."""
    model = tiny_llama(0, vocab=32, layers=1)
    layer = new_cache(model).layers[0]
    like = _kv(1)
    kb, vb, start, n = layer.room(like, 5)
    kb[..., start:start + 5, :] = _kv(5, seed=1)
    layer.grown(start, n + 5)
    kb2, _, start2, n2 = layer.room(like, 1)  # the fast path: same buffer, the same offsets
    assert kb2 is kb and (start2, n2) == (start, 5)
    layer.keys, layer.values = layer.keys[..., :3, :], layer.values[..., :3, :]  # keep_path / crop
    _, _, start3, n3 = layer.room(like, 1)
    assert (start3, n3) == (start, 3)
    layer.grown(start3, 3)
    kb4, _, _, n4 = layer.room(like, kb.shape[-2])  # no room left: a bigger buffer, the rows copied
    assert kb4 is not kb and kb4.shape[-2] >= 3 + kb.shape[-2] and n4 == 3
    assert torch.equal(layer.keys, kb[..., start:start + 3, :])


def test_the_engine_cache_on_growing_layers_equals_a_fresh_forward():
    """Feed, keep a path, crop and cut as rounds do; logits of the next token equal those of one
    forward over the committed sequence."""
    model = tiny_llama(0, vocab=32, layers=2)
    cache = new_cache(model)
    assert all(type(layer).__name__ == "GrowingLayer" for layer in cache.layers)
    cm = CachedModel(model)
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    cm.feed(seq, TreeLayout(()), [], 0, 0)
    for tok in (5, 3, 5):
        seq.append(tok)
        cm.feed(seq, TreeLayout(()), [], 0, 0)
    crop(cm.cache, len(seq) - 2)
    cm.length = len(seq) - 2
    seq = seq[:-1] + [7]
    got = cm.feed(seq, TreeLayout(()), [], 0, 0)[0][-1]
    with torch.no_grad():
        want = model(torch.tensor([seq])).logits[0, -1].float()
    assert torch.allclose(got, want, atol=1e-5)
    n = cm.length
    assert keep_path(cm.cache, n, [], 0) == n  # nothing fed beyond: unchanged
    cut_front(cm.cache, [0], 2)
    assert cm.cache.layers[0].keys.shape[-2] == n - 2 and cm.cache.layers[1].keys.shape[-2] == n


def test_keep_path_in_one_kernel_call_equals_the_per_layer_moves():
    """Layers a kernel wrote (spans, no views) keep a tree's path through csrc keep_rows in one
    call: the same rows as the per-layer gathers keep_path makes over views, float32 and float16,
    and the next kernel write lands right after them."""
    from decoding.forward import quant

    if not quant.available():  # it registers keep_rows (the AVX512 kernels register it too)
        pytest.skip(f"quantized kernel: {quant.why_not()}")
    model = tiny_llama(0, vocab=32, layers=3)
    for dtype in (torch.float32, torch.float16):
        like = _kv(1).to(dtype)
        fast, slow = new_cache(model), new_cache(model)
        for c in (fast, slow):
            for i, layer in enumerate(c.layers):
                kb, vb, start, n = layer.room(like, 9)  # 4 cached rows + a tree of 5, as a kernel writes
                kb[..., start:start + 9, :] = _kv(9, seed=i).to(dtype)
                vb[..., start:start + 9, :] = _kv(9, seed=10 + i).to(dtype)
                layer.grown(start, n + 9)
        for layer in slow.layers:
            assert layer.keys.shape[-2] == 9  # a view made: the per-layer path
        assert keep_path(fast, 4, [1, 3, 4], 5) == keep_path(slow, 4, [1, 3, 4], 5) == 7
        for a, b in zip(fast.layers, slow.layers):
            assert a._span is not None and a.rows == 7
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        ref = _kv(9, seed=0).to(dtype)
        assert torch.equal(fast.layers[0].keys[..., 4:, :], ref[..., [5, 7, 8], :])
        layer = fast.layers[0]
        kb, _, start, n = layer.room(like, 1)
        assert n == 7 and kb is layer._kb
