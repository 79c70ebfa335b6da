"""The feature (EAGLE-3) head on tiny random Qwen3 and Gemma 3 targets (Gemma 3: local and
global layers, a scaled embedding): training steps lower the loss, the eagle3 export reads
back with identical logits, and a head whose embedding scale the engines would not cancel is
refused in one line. Decoding with a head on full-attention non-Llama targets (Gemma's scaled
embedding included) gives `ar`'s greedy output."""

import pytest
import torch
from support.models import FAMILY_VOCAB as V, tiny_model

from decoding.drafts.io import load_feature_draft, save_feature_draft
from decoding.models import ModelError
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine
from training.head.module import FeatureDistillModule
from training.export.formats import from_eagle3, to_eagle3

FAMILIES = ("qwen3", "gemma3")


def module_for(model, data=None, steps=3, lr=3e-3):
    """A module training a head over the 48 ids most frequent in `data` (any 48 without)."""
    m = FeatureDistillModule(target="unused", steps=steps, lr=lr)
    m._target.append(model.requires_grad_(False))  # in memory: no directory to load
    ids = data["input_ids"].flatten() if data is not None else torch.arange(V)
    # distinct layers: default_aux_layers(4) is (2, 2, 1), which vLLM could not serve (it
    # captures each layer once), so the export would refuse it
    m.build_head([1, 2, 3], torch.bincount(ids, minlength=V).argsort(descending=True)[:48])
    m.online_k = 8
    return m


def batch(model, seed=0, b=8, t=20):
    """The target's own greedy continuations of random 3-token prompts (learnable by a head)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ids = model.generate(torch.randint(3, V, (b, 3), generator=g), max_new_tokens=t, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "label_start": torch.full((b,), 2),
            "code": torch.zeros(b, dtype=torch.bool)}


def train(family, steps=12):
    torch.manual_seed(0)
    model = tiny_model(family, sharp=3.0)
    data, losses = batch(model), []
    m = module_for(model, data)
    opt = torch.optim.AdamW([p for p in m.head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss, _ = m._step(data)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, m.head.eval(), losses, data


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request):
    return (request.param, *train(request.param)[:3])


def test_training_steps_lower_the_loss(trained):
    family, _, head, losses = trained
    assert losses[-1] < 0.8 * losses[0], (family, losses)
    assert head.config.embed_scale == (8.0 if family == "gemma3" else 1.0)  # sqrt(64)


def test_own_format_and_eagle3_round_trip(trained, tmp_path):
    family, model, head, _ = trained
    back = load_feature_draft(save_feature_draft(head, tmp_path / "own", model), model)
    assert back.config == head.config
    out = to_eagle3(head, tmp_path / "eagle3", "float32", model.config, embed_tokens=False)
    again = from_eagle3(out, model)
    assert again.config.embed_scale == head.config.embed_scale
    ids, aux = torch.randint(0, V, (2, 7)), torch.randn(2, 7, 3 * 64)
    with torch.no_grad():
        for (a, ha), (b, hb), (c, hc) in zip(head.unroll(ids, aux, 3), back.unroll(ids, aux, 3),
                                             again.unroll(ids, aux, 3)):
            assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(ha, hb) and torch.equal(ha, hc), family


def test_a_scale_the_input_norm_does_not_cancel_is_refused(tmp_path):
    model = tiny_model("gemma3")
    with torch.no_grad():  # mean square 1e-8 ~ eps: dropping the x8 would change the normed input
        model.get_input_embeddings().weight.normal_(0, 1e-4)
    head = module_for(model).head
    with pytest.raises(ModelError, match=r"scaled by 8 .*not exportable to eagle3") as e:
        to_eagle3(head, tmp_path / "x", "float32", model.config)
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()


@pytest.mark.parametrize("family", ["qwen3", "gemma", "phi3", "gpt_neox"])
def test_decoding_with_a_head_equals_ar(family):
    model, head, _, data = train(family, steps=40)
    greedy, accepted = SamplingConfig(), 0
    ar = build_engine(model, None, StrategyConfig(strategy="ar"), greedy)
    for cfg in (StrategyConfig(strategy="sd", gamma=4), StrategyConfig(strategy="ti-mcsd", width=3, depth=4)):
        eng = build_engine(model, head, cfg, greedy)
        for prompt in (data["input_ids"][0, :3].tolist(), data["input_ids"][1, :5].tolist()):  # seen text
            out, stats = eng.generate(prompt, 20)
            assert out == ar.generate(prompt, 20)[0] and stats.lossless, (family, cfg.name)
            accepted += stats.accepted
    assert accepted > 0, family  # the head's drafts were really verified and kept


def test_feature_cache_stores_states_float16_overflows_in_bfloat16():
    """Gemma's residual stream exceeds float16's range (65504): those shards keep bfloat16."""
    from training.head.cache import CacheSettings, compute_shard

    settings, used = CacheSettings([0, 1, 3], draft_vocab_size=16, k=4), torch.arange(16)
    dtypes = []
    for scale in (1.0, 1e5):  # x 0.2 x sqrt(64): states ~1.6e5
        model = tiny_model("gemma3")
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(scale)
        out = compute_shard(model, [[1, 5, 9, 13, 17, 21]], [1], settings, used, 0, 64)
        assert torch.isfinite(out["feats"]).all()
        dtypes.append(out["feats"].dtype)
    assert dtypes == [torch.float16, torch.bfloat16]
