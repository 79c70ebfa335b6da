"""A decider is accepted for the pair it was fit for however the pair is passed (directories or
models already loaded), checked by weights fingerprint: a stand-alone draft with a pruned head,
loaded by plain transformers, is still its directory's draft; a draft with other weights is not."""

import pytest
import torch
from support.models import WORDS, save_tiny, tiny_llama
from transformers import AutoModelForCausalLM

from decoding import Decoder
from decoding.decider.policy import DeciderConfig, DeciderNet, save_decider
from decoding.models import ModelError, PrunedHead, PrunedHeadLlamaConfig, PrunedHeadLlamaForCausalLM, fingerprint, load_model

PROMPT = "w1 w2 w3"
SHAPE = dict(strategy="ti-mcsd", width=2, depth=3)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """(target dir, pruned-head draft dir, a decider exported for the directory-loaded pair)."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_llama(0, vocab=len(WORDS), scale=6, max_pos=64)
    conf = PrunedHeadLlamaConfig(head_size=20, **target.config.to_dict() | {"tie_word_embeddings": True})
    torch.manual_seed(1)
    draft = PrunedHeadLlamaForCausalLM(conf).eval()
    draft.set_head_ids(list(range(2, 22)))
    t, d = save_tiny(root / "target", WORDS, target), save_tiny(root / "draft", WORDS, draft)
    cfg = DeciderConfig(kind="logistic", threshold=0.5, rule="paper",
                        model_pair={"target": fingerprint(load_model(t)), "draft": fingerprint(load_model(d))})
    return t, d, save_decider(root / "deciders" / "run", DeciderNet(cfg), cfg, {})


def plain(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_a_decider_for_the_directories_serves_the_same_models_loaded(fitted):
    t, d, run = fitted
    draft = plain(d)
    assert not isinstance(draft.get_output_embeddings(), PrunedHead)  # plain transformers: full head
    dec = Decoder.load(plain(t), draft, tokenizer=t, **SHAPE).variant(stop="decider", decider=str(run))
    assert isinstance(dec.session.draft.get_output_embeddings(), PrunedHead)  # the recorded head drafts
    assert not isinstance(draft.get_output_embeddings(), PrunedHead)  # the caller's model is unchanged
    assert dec.session.draft.get_input_embeddings().weight is draft.get_input_embeddings().weight
    from_dirs = Decoder.load(t, d, **SHAPE).variant(stop="decider", decider=str(run))
    a, b = dec.generate(PROMPT, max_new_tokens=12), from_dirs.generate(PROMPT, max_new_tokens=12)
    assert a.token_ids == b.token_ids and a.stats["drafted"] == b.stats["drafted"]


def test_a_draft_with_other_weights_is_still_refused(fitted):
    t, d, run = fitted
    other = plain(d)
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight.add_(0.01)
    dec = Decoder.load(plain(t), other, tokenizer=t, **SHAPE)
    with pytest.raises(ModelError, match="trained for another draft model"):
        dec.variant(stop="decider", decider=str(run))
