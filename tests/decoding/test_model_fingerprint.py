"""The model fingerprint pins what defines the weights, not how a transformers version spells
the config; records of the older scheme migrate."""

import copy
import hashlib
import json

import pytest
import torch

from support.models import tiny_llama
from decoding.models import (
    FINGERPRINT_VERSION,
    ModelError,
    PrunedHeadLlamaConfig,
    PrunedHeadLlamaForCausalLM,
    fingerprint,
    load_model,
    same_model,
)


def test_unrelated_config_keys_and_dtype_keep_the_fingerprint():
    m = tiny_llama(0)
    fp = fingerprint(m)
    assert fp["fingerprint_version"] == FINGERPRINT_VERSION
    m.config.some_key_a_newer_transformers_adds = {"x": 1}
    m.config.transformers_version = "99.0"
    m.config.use_cache = not m.config.use_cache
    assert same_model(fingerprint(m), fp)
    # an older transformers: head_dim derived, no mlp_bias, rope_theta at the top level
    m.config.head_dim = None
    del m.config.mlp_bias
    rope = m.config.rope_parameters
    m.config.rope_parameters, m.config.rope_theta = None, rope["rope_theta"]
    assert same_model(fingerprint(m), fp)
    assert same_model(fingerprint(copy.deepcopy(m).to(torch.bfloat16)), fp)


@pytest.mark.parametrize("change", ["weight", "layers", "hidden", "rope", "tie"])
def test_weights_and_sizes_change_the_fingerprint(change):
    m = tiny_llama(0)
    fp = fingerprint(m)
    if change == "weight":
        with torch.no_grad():
            m.model.layers[1].mlp.up_proj.weight.add_(0.01)
    elif change == "layers":
        m = tiny_llama(0, layers=1)
    elif change == "hidden":
        m = tiny_llama(0, hidden=16)
    elif change == "rope":
        m.config.rope_parameters = dict(m.config.rope_parameters, rope_theta=5.0)
    else:
        m.config.tie_word_embeddings = True
    assert not same_model(fingerprint(m), fp)


def test_the_head_a_draft_proposes_from_is_part_of_its_identity():
    conf = PrunedHeadLlamaConfig(head_size=20, **tiny_llama(0).config.to_dict() | {"tie_word_embeddings": True})
    torch.manual_seed(0)
    d = PrunedHeadLlamaForCausalLM(conf).eval()
    d.set_head_ids(list(range(20)))
    fp = fingerprint(d)
    d.set_head_ids(list(range(1, 21)))
    assert not same_model(fingerprint(d), fp)


def _v1_record(model, name):
    from training.migrate_fingerprints import v1_embed_sha256

    return {"name": name, "config_sha256": "whole-config-hash", "embed_sha256": v1_embed_sha256(model),
            "vocab_size": 32}


def test_migration_rewrites_old_records_and_the_files_citing_them(tmp_path):
    from decoding.decider.policy import DeciderConfig, DeciderNet, load_decider, save_decider
    from training.migrate_fingerprints import files_under, known_models, migrate

    m = tiny_llama(0)
    m.save_pretrained(tmp_path / "model")
    loaded = load_model(tmp_path / "model")
    pair = {"target": _v1_record(loaded, "t"), "draft": _v1_record(loaded, "d")}
    dec = save_decider(tmp_path / "dec", DeciderNet(DeciderConfig(kind="logistic", model_pair=pair)),
                       DeciderConfig(kind="logistic", model_pair=pair), {})
    with pytest.raises(ModelError, match="migrate_fingerprints"):
        load_decider(dec, loaded, loaded)
    man = tmp_path / "corpus" / "manifest.json"
    man.parent.mkdir()
    stranger = {"name": "other", "config_sha256": "c", "embed_sha256": "e", "vocab_size": 32}
    man.write_text(json.dumps({"target": _v1_record(loaded, "t") | {"chat_template_sha256": "c"},
                               "shards": [{"writer": stranger}]}, indent=1) + "\n")
    cite = tmp_path / "draft" / "specstop_draft.json"
    cite.parent.mkdir()
    cite.write_text(json.dumps({"data": {"corpus_manifest_sha256":
                                         hashlib.sha256(man.read_bytes()).hexdigest()}}))
    changed, unmatched = migrate(files_under([str(tmp_path)]), known_models([str(tmp_path / "model")]))
    assert {p.name for p in changed} == {"config.json", "manifest.json", "specstop_draft.json"}
    assert unmatched == ["other"]
    load_decider(dec, loaded, loaded)  # now accepted for this pair
    new = json.loads(man.read_text())
    assert same_model(new["target"], fingerprint(loaded)) and new["target"]["chat_template_sha256"] == "c"
    assert new["shards"][0]["writer"] == stranger  # no model given for it: left as it was
    assert json.loads(cite.read_text())["data"]["corpus_manifest_sha256"] == \
        hashlib.sha256(man.read_bytes()).hexdigest()
    assert migrate(files_under([str(tmp_path)]), known_models([str(tmp_path / "model")]))[0] == []
