"""EAGLE-3 feature head on a tiny random Llama target: shapes, capture hooks, vocab maps, caches."""

import pytest
import torch

from support.head import AUX, tiny_feature_draft
from support.models import tiny_llama
from decoding.drafts.capture import capture_aux
from decoding.drafts.feature import DraftKV, FeatureDraftConfig, default_aux_layers


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, vocab=40, layers=4, hidden=32)


def test_default_aux_layers():
    assert default_aux_layers(30) == (2, 15, 27)


def test_config_from_target_and_roundtrip(target):
    cfg = FeatureDraftConfig.from_target(target.config, draft_vocab_size=24, aux_layers=AUX)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 4, 2, 8)
    assert cfg.rope_theta == target.config.rope_parameters["rope_theta"]
    assert FeatureDraftConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="exactly 3"):
        FeatureDraftConfig(aux_layers=(1, 2))
    with pytest.raises(ValueError, match="unknown"):
        FeatureDraftConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_shapes_and_state_dict(target):
    d = tiny_feature_draft(target)
    sd = d.state_dict()
    assert sd["fc.weight"].shape == (32, 96)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (32, 64)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (16, 64)
    assert sd["lm_head.weight"].shape == (24, 32)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert not any("embed" in k for k in sd), "embeddings are the target's: never saved"
    assert all(p is not d.embed_weight for p in d.parameters())
    ids = torch.randint(0, 40, (2, 7))
    outs = d.unroll(ids, torch.randn(2, 7, 96), steps=3)
    assert len(outs) == 3 and outs[2][0].shape == (2, 7, 24) and outs[2][1].shape == (2, 7, 32)


def test_capture_is_the_pre_layer_residual(target):
    ids = torch.randint(0, 40, (2, 9))
    with torch.no_grad(), capture_aux(target, AUX) as cap:
        out = target(input_ids=ids, output_hidden_states=True)
    for i in AUX:  # hidden_states[i] is layer i's input (the previous layer's output)
        assert torch.equal(cap.states[i], out.hidden_states[i])
    assert cap.aux().shape == (2, 9, 96)
    assert not target.model.layers[0]._forward_pre_hooks, "hooks are removed on exit"
    with pytest.raises(ValueError, match="cannot capture"):
        with capture_aux(target, (0, 1, 9)):
            pass


def test_vocab_maps_are_consistent(target):
    d = tiny_feature_draft(target)
    used = d.used_ids
    assert torch.equal(used, used.sort().values) and used.unique().numel() == 24
    assert torch.equal(d.t2d.nonzero()[:, 0], used)
    assert torch.equal(d.d2t, used - torch.arange(24))
    # lm_head initialised from the target's output rows at the used ids (before the noise)
    d0 = tiny_feature_draft(target, init=False)
    d0.init_from_target(target, used)
    assert torch.equal(d0.lm_head.weight, target.lm_head.weight[used])
    logits = torch.randn(3, 24)
    full = d.to_target(logits)
    assert torch.equal(full[:, used], logits) and torch.isinf(full[:, ~d.t2d]).all()
    assert torch.equal(full.argmax(-1), used[logits.argmax(-1)])
    with pytest.raises(ValueError, match="distinct"):
        d.set_vocab([1, 1, 2])


def test_cache_matches_no_cache(target):
    d = tiny_feature_draft(target)
    ids, aux = torch.randint(0, 40, (1, 8)), torch.randn(1, 8, 96)
    with torch.no_grad():
        h = d.fuse(aux)
        pos = torch.arange(8)[None]
        full, hf = d.step(ids, h, pos)
        cache = DraftKV()
        parts = [d.step(ids[:, a:b], h[:, a:b], pos[:, a:b], cache) for a, b in ((0, 3), (3, 4), (4, 8))]
    assert len(cache) == 8
    torch.testing.assert_close(torch.cat([p[0] for p in parts], 1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([p[1] for p in parts], 1), hf, rtol=1e-5, atol=1e-5)
    cache.crop(5)
    assert len(cache) == 5


def test_a_step_can_leave_all_but_the_last_row_s_logits(target):
    """last=True (a catch-up, which reads only the anchor's logits): [B, 1, N], the whole step's
    last row; h and the cache as without it."""
    d = tiny_feature_draft(target)
    ids, aux = torch.randint(0, 40, (2, 6)), torch.randn(2, 6, 96)
    with torch.no_grad():
        h, pos = d.fuse(aux), torch.arange(6)[None].expand(2, 6)
        c1, c2 = DraftKV(), DraftKV()
        full, hf = d.step(ids, h, pos, c1)
        last, hl = d.step(ids, h, pos, c2, last=True)
    assert last.shape == (2, 1, full.shape[-1])
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-6, atol=1e-6)
    assert torch.equal(hl, hf) and torch.equal(c1.k, c2.k) and torch.equal(c1.v, c2.v)


def test_unroll_matches_cached_chain_decoding(target):
    """Step j of the training-time test = drafting a chain of depth j+1 at inference."""
    d = tiny_feature_draft(target)
    T, steps = 9, 3
    ids, aux = torch.randint(0, 40, (1, T)), torch.randn(1, T, 96)
    with torch.no_grad():
        outs = d.unroll(ids, aux, steps)
        step0, _ = d.step(ids[:, 1:], d.fuse(aux[:, :-1]), torch.arange(T - 1)[None])
        torch.testing.assert_close(outs[0][0][:, : T - 1], step0, rtol=1e-5, atol=1e-5)
        for t in range(T - steps):
            cache = DraftKV()  # committed entries 0..t with the true features
            logit, h = d.step(ids[:, 1: t + 2], d.fuse(aux[:, : t + 1]), torch.arange(t + 1)[None], cache)
            h = h[:, -1:]
            for j in range(1, steps):  # chain: the ground-truth token, the draft's own h
                logit, h = d.step(ids[:, t + 1 + j: t + 2 + j], h, torch.tensor([[t + j]]), cache)
                torch.testing.assert_close(logit[0, 0], outs[j][0][0, t], rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(h[0, 0], outs[j][1][0, t], rtol=1e-4, atol=1e-5)


def test_unroll_padding_does_not_leak(target):
    d = tiny_feature_draft(target)
    ids, aux = torch.randint(0, 40, (2, 6)), torch.randn(2, 6, 96)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    ids2, aux2 = ids.clone(), aux.clone()
    ids2[1, 4:], aux2[1, 4:] = 7, 5.0  # change only the padding
    with torch.no_grad():
        a = d.unroll(ids, aux, 2, mask)
        b = d.unroll(ids2, aux2, 2, mask)
    torch.testing.assert_close(a[0][0][1, :3], b[0][0][1, :3])
    torch.testing.assert_close(a[1][0][1, :2], b[1][0][1, :2])


def test_unroll_skip_computes_only_later_rows_and_changes_nothing(target):
    """Steps >= 1 restricted to t >= skip give the same outputs there as the full unroll."""
    d = tiny_feature_draft(target)
    ids, aux = torch.randint(0, 40, (2, 10)), torch.randn(2, 10, 96)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 8:] = 0
    with torch.no_grad():
        full = d.unroll(ids, aux, 3, mask)
        part = d.unroll(ids, aux, 3, mask, skip=4, logits=False)
    torch.testing.assert_close(part[0][1], full[0][1])
    assert part[0][0] is None and part[1][1].shape == (2, 6, 32)
    for j in (1, 2):
        torch.testing.assert_close(part[j][1], full[j][1][:, 4:], rtol=1e-5, atol=1e-6)
