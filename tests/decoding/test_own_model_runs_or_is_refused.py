"""A user's own model: what cannot be rolled back is refused before generation in one line
(ModelError; exit 2 in the CLI), and every stop rule runs on a pair without its own decider
or says in one line what it needs."""

import json

import pytest
import torch
from tokenizers import Tokenizer, models as tk_models, pre_tokenizers
from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM,
                          PreTrainedTokenizerFast)

from support.models import WORDS, noisy_copy, save_tiny, tiny, tiny_llama
from decoding import Decoder
from decoding.generate import main
from decoding.growth import GrowPolicy
from decoding.models import ModelError
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine

AR = StrategyConfig(strategy="ar")


def tiny_mamba():
    torch.manual_seed(0)
    return MambaForCausalLM(MambaConfig(vocab_size=len(WORDS), hidden_size=32, state_size=4, num_hidden_layers=2,
                                        bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()


def one_line_error(fn, *words):
    with pytest.raises(ModelError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


def tokenizer():
    tok = Tokenizer(tk_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def test_recurrent_state_is_refused_before_generation():
    mamba = tiny_mamba()
    one_line_error(lambda: build_engine(mamba, None, AR, SamplingConfig()), "mamba", "recurrent", "rolled back")
    one_line_error(lambda: Decoder.load(mamba, tokenizer=tokenizer()), "mamba", "recurrent")


def test_unknown_layers_and_hybrids_without_a_mask_per_layer_type_are_refused():
    cfg = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    odd = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    odd.config.layer_types = ["full_attention", "chunked_attention"]
    odd.config.attention_chunk_size = 4
    one_line_error(lambda: build_engine(odd, None, AR, SamplingConfig()), "llama", "chunked attention")
    # Llama's forward builds one mask for every layer: its local layers would see the full context
    odd.config.layer_types, odd.config.sliding_window = ["sliding_attention", "full_attention"], 4
    one_line_error(lambda: build_engine(odd, None, AR, SamplingConfig()), "llama", "one attention mask")


def test_a_model_that_keeps_state_outside_its_cache_is_refused_at_the_first_forward():
    class OwnCache(LlamaForCausalLM):
        def forward(self, *args, past_key_values=None, **kw):  # ignores the cache it is given
            return super().forward(*args, past_key_values=DynamicCache(), **kw)

    m = tiny_llama(0)
    m.__class__ = OwnCache
    eng = build_engine(m, None, AR, SamplingConfig())
    one_line_error(lambda: eng.generate([1, 2, 3], 4), "outside the KV cache")


def test_cli_exits_2_with_one_line(tmp_path, capsys):
    d = save_tiny(tmp_path / "mamba", WORDS, tiny_mamba())
    rc = main(["--prompt", "w1 w2", "--target", d, "--strategy", "ar", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "mamba" in err and "recurrent" in err, err


def test_cli_serves_a_local_global_model_without_sdpa(tmp_path, capsys):
    """Gemma 2 has no sdpa path in transformers (loaded eager) and a window that bites: the
    CLI's speculative output equals its plain decoding."""
    target = tiny("gemma2+window", vocab_size=len(WORDS), scale=6)
    t = save_tiny(tmp_path / "t", WORDS, target)
    d = save_tiny(tmp_path / "d", WORDS, noisy_copy(target, 0.003))
    base = ["--prompt", "w3 w9 w4 w12 w7 w20 w5", "--target", t, "--draft", d, "--max-new-tokens", "12", "--json"]
    outs = []
    for extra in (["--strategy", "ar"], ["--strategy", "ti-mcsd", "--width", "2", "--depth", "4"]):
        assert main(base + extra) == 0
        outs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) > 0


@pytest.fixture(scope="module")
def own_pair():
    """A user's pair of an architecture the registry's decider has never seen (Gemma 3, a
    local window that bites), loaded as models with a tokenizer."""
    target = tiny("gemma3+window", vocab_size=len(WORDS), scale=6)
    return target, noisy_copy(target, 0.003), tokenizer()


def test_grow_rule_on_a_pair_without_a_decider_times_and_stores_its_cost_curve(own_pair, tmp_path, monkeypatch):
    """The registry's latest decider belongs to the shipped pair: its cost curve would price
    another machine's forwards for other models. This pair's curve is timed and stored."""
    monkeypatch.setenv("SPECSTOP_CACHE", str(tmp_path))
    target, draft, tok = own_pair
    dec = Decoder.load(target, draft, tokenizer=tok, strategy="ti-mcsd", width=2, depth=4,
                       stop="confidence", confidence_rule="grow")
    assert dec.config.grow_cost == "decider" and isinstance(dec._stop, GrowPolicy)
    stored = list((tmp_path / "cost").glob("*.json"))
    curve = json.loads(stored[0].read_text())["curve"] if len(stored) == 1 else {}
    assert curve.get("target_ms") and curve["policy_ms"] > 0  # the forwards and a level's host work, timed
    prompt = [3, 9, 4, 12, 7, 20, 5, 8]
    ar = dec.variant("ar").generate(prompt, 16)
    grown = dec.generate(prompt, 16)  # models this small may not pay for a tree at all: lossless either way
    assert grown.token_ids == ar.token_ids and grown.stats["lossless"]


@pytest.mark.parametrize("options", [dict(stop="fixed"), dict(stop="confidence"),
                                     dict(stop="confidence", confidence_rule="tree", confidence_threshold=0.1),
                                     dict(stop="confidence", confidence_rule="grow", grow_cost="measure")])
@pytest.mark.parametrize("strategy", ["sd", "mcsd", "ti-mcsd"])
def test_every_rule_without_a_decider_runs_on_a_users_pair(own_pair, tmp_path, monkeypatch, strategy, options):
    monkeypatch.setenv("SPECSTOP_CACHE", str(tmp_path))
    target, draft, tok = own_pair
    dec = Decoder.load(target, draft, tokenizer=tok, strategy=strategy, k_config="2,2", **options)
    prompt = [3, 9, 4, 12, 7, 20]
    assert dec.generate(prompt, 12).token_ids == dec.variant("ar").generate(prompt, 12).token_ids


def test_a_decider_rule_says_what_it_needs(own_pair):
    target, draft, tok = own_pair
    one_line_error(lambda: Decoder.load(target, draft, tokenizer=tok, stop="decider"),
                   "trained for another", "training.fit")
