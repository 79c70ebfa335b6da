"""decoding.models.target_layout on tiny random models of every family a feature head supports: the
head embeds exactly what the target's first layer reads (Gemma's scaled embedding included),
its output layer starts as the target's own, capture and initialisation run; GPT-2 is refused."""

import pytest
import torch
from support.models import CONFIGS, REFUSED, FAMILY_VOCAB as V, tiny_model

from decoding.drafts.capture import capture_aux
from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig
from decoding.models import ModelError
from decoding.models.target_layout import target_layout
from training.export.eagle3_layout import TOLERANCE, scale_deviation

IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45]])


def head_for(model, draft_vocab=48):
    cfg = FeatureDraftConfig.for_target(model, draft_vocab_size=draft_vocab)
    return FeatureDraft(cfg).init_from_target(model, torch.arange(0, V, V // draft_vocab)[:draft_vocab])


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_head_reads_the_targets_own_functions(family):
    model = tiny_model(family)
    layout = target_layout(model)
    head = head_for(model)
    assert head.config.target_num_layers == len(layout.layers) == 4
    pre = {}
    hook = layout.norm.register_forward_pre_hook(lambda m, a: pre.setdefault("h", a[0]))
    with torch.no_grad(), capture_aux(model, (0, 1, 3)) as cap:
        out = model(input_ids=IDS)
        trunk = layout.trunk(input_ids=IDS).last_hidden_state
    hook.remove()
    # the head's embedding is the first layer's input: scaling (Gemma: sqrt(hidden)) included
    torch.testing.assert_close(head.embed(IDS), cap.states[0], rtol=1e-5, atol=1e-5)
    assert cap.aux().shape == (1, IDS.shape[1], 3 * 64)
    torch.testing.assert_close(layout.logits(trunk), out.logits, rtol=1e-5, atol=1e-5)
    if not isinstance(layout.norm, torch.nn.LayerNorm):  # RMSNorm families: the exact output layer
        with torch.no_grad():  # (before Gemma 2's soft-capping, which the head does not apply)
            mine, theirs = head.head(pre["h"]), layout.lm_head(trunk)[..., head.used_ids]
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unsupported_layouts_are_refused_in_one_line(family):
    with pytest.raises(ModelError, match=r"feature heads do not support GPT2LMHeadModel \(gpt2\)") as e:
        FeatureDraftConfig.for_target(tiny_model(family))
    assert "\n" not in str(e.value)


def test_layer_copy_only_for_llama_layouts():
    """The midlayer starts from the target's last layer only where the layouts agree."""
    for family, copied in (("qwen2", True), ("gemma3", False), ("phi3", False)):
        model = tiny_model(family)
        head = head_for(model)
        w = target_layout(model).layers[-1].self_attn.o_proj.weight
        assert torch.equal(head.midlayer.self_attn.o_proj.weight, w) == copied, family


def test_gemma_norms_use_their_effective_weight():
    model = tiny_model("gemma3")
    with torch.no_grad():
        target_layout(model).norm.weight.fill_(0.5)  # Gemma applies 1 + w
    assert torch.allclose(head_for(model).norm.weight, torch.full((64,), 1.5))


def test_scale_deviation_known_values():
    e = torch.full((3, 4), 0.01)  # mean square 1e-4
    assert scale_deviation(e, 1.0, 1e-6) == 0.0
    want = ((1e-4 + 1e-6) / (1e-4 + 1e-6 / 64)) ** 0.5 - 1
    assert scale_deviation(e, 8.0, 1e-6) == pytest.approx(want) and want > TOLERANCE
    assert scale_deviation(torch.zeros(2, 4), 8.0, 1e-6) == 0.0  # all-zero (padding) rows


def test_an_architecture_without_sdpa_loads_with_eager_attention(tmp_path):
    from decoding.models import load_model

    tiny_model("gemma2").save_pretrained(tmp_path / "g2")
    model = load_model(tmp_path / "g2")
    assert model.config._attn_implementation == "eager" and target_layout(model).embed_scale == 8.0
