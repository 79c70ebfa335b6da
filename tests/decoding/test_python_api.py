"""The Python API (decoding.Decoder) on tiny model directories and tiny loaded models."""

import subprocess
import sys

import pytest
import yaml
from support.models import WORDS, noisy_copy, save_tiny, tiny_llama

from decoding import Decoder, GenerationResult
from decoding.models import ModelError, load_model, load_tokenizer
from decoding.sampling import SamplingConfig
from decoding.stopping.gate import DraftGate
from decoding.models.session import Session
from decoding.strategies import StrategyConfig, build_engine

PROMPT = "w1 w2 w3"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = tiny_llama(0, vocab=len(WORDS), scale=6, max_pos=64)
    t = save_tiny(root / "target", WORDS, target)
    d = save_tiny(root / "draft", WORDS, noisy_copy(target, 0.03))
    bad = save_tiny(root / "badtok", WORDS[:2] + WORDS[2:][::-1], noisy_copy(target, 0.03))
    return t, d, bad


@pytest.fixture(scope="module")
def dec(dirs):
    t, d, _ = dirs
    return Decoder.load(t, d, strategy="ti-mcsd", width=2, depth=3)


def engine_output(t, d, cfg, sampling, max_new, seed=0):
    sess = Session.open(t, d)
    ids = sess.encode(PROMPT)
    return build_engine(sess.target, sess.draft, cfg, sampling).generate(ids, max_new, sess.eos_token_id, seed)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_generate_equals_the_engine(dirs, dec, temperature):
    t, d, _ = dirs
    res = dec.generate(PROMPT, max_new_tokens=20, temperature=temperature, seed=3)
    out, stats = engine_output(t, d, StrategyConfig("ti-mcsd", width=2, depth=3), SamplingConfig(temperature),
                               20, seed=3)
    assert isinstance(res, GenerationResult)
    assert res.token_ids == out and res.stats["strategy"] == stats.strategy == "ti-mcsd[W=2,D=3]"
    assert res.text == dec.tokenizer.decode(out, skip_special_tokens=True)
    assert res.prompt_ids == dec.tokenizer.encode(PROMPT)
    assert dec.generate(res.prompt_ids, max_new_tokens=20, temperature=temperature, seed=3).token_ids == out
    if temperature == 0:  # lossless: the same as plain decoding
        assert dec.variant("ar").generate(PROMPT, max_new_tokens=20).token_ids == out


def test_stream_pieces_concatenate_to_generate(dec):
    res = dec.generate(PROMPT, max_new_tokens=24)
    pieces = list(dec.stream(PROMPT, max_new_tokens=24))
    assert len(pieces) > 1 and all(pieces)
    assert "".join(pieces) == res.text and dec.last_result.token_ids == res.token_ids


def test_stream_can_be_left_early_and_reused(dec):
    it = dec.stream(PROMPT, max_new_tokens=24)
    first = next(it)
    it.close()  # the worker ends at its next round instead of running on
    assert first and dec.last_result is None
    assert dec.generate(PROMPT, max_new_tokens=24).text.startswith(first)


def test_preloaded_models_are_accepted(dirs, dec):
    t, d, _ = dirs
    target, draft = load_model(t), load_model(d)
    loaded = Decoder.load(target, draft, tokenizer=load_tokenizer(t), strategy="ti-mcsd", width=2, depth=3)
    assert loaded.generate(PROMPT, max_new_tokens=20).token_ids == dec.generate(PROMPT, max_new_tokens=20).token_ids
    assert loaded.session.target is target  # used as given, not copied or reloaded
    alone = Decoder.load(target, tokenizer=t)  # no draft: plain decoding
    assert alone.config.strategy == "ar" and alone.generate(PROMPT, max_new_tokens=5).stats["lossless"]


def test_unset_options_come_from_the_defaults_file(dirs, tmp_path):
    t, d, _ = dirs
    f = tmp_path / "defaults.yaml"
    f.write_text(yaml.safe_dump({"other-pairs": {"strategy": "sd", "gamma": 2, "dtype": "float32",
                                                 "source": "test"}}))
    dec = Decoder.load(t, d, defaults_file=f)
    assert (dec.config.strategy, dec.config.gamma) == ("sd", 2) and dec.defaults.source == "test"
    assert Decoder.load(t, d, defaults_file=f, strategy="mcsd", k_config="2,1").config.k_levels == (2, 1)
    # a named strategy and shape run as named: the entry's stop rule is not inherited
    f.write_text(yaml.safe_dump({"other-pairs": {"strategy": "ti-mcsd", "width": 2, "depth": 5, "stop": "confidence",
                                                 "confidence_threshold": 0.99, "dtype": "float32"}}))
    assert Decoder.load(t, d, defaults_file=f).config.name == "ti-mcsd[W=2,D=5]+confidence"
    sd = Decoder.load(t, d, defaults_file=f, strategy="sd", gamma=3)
    res = sd.generate(PROMPT, max_new_tokens=30)
    assert sd.config.name == res.stats["strategy"] == "sd[g=3]" and sd.config.stop == "fixed"
    # every round drafts 3 tokens (the 0.99 confidence threshold would have cut them short)
    assert set(res.stats["drafted_depths"]) == {3} and res.stats["drafted"] == 3 * res.stats["rounds"]
    f.write_text("other-pairs: {width: 2, colour: red}\n")
    with pytest.raises(ValueError, match="unknown keys colour"):
        Decoder.load(t, d, defaults_file=f)


@pytest.mark.parametrize("prompt,kw,message", [
    ("", {}, "empty prompt"),
    ("   ", {}, "empty prompt"),
    ([], {}, "empty prompt"),
    ([1, 2, 999], {}, "token ids must lie in"),
    ("w1", {"max_new_tokens": 500}, "prompt too long"),
    ("w1", {"max_new_tokens": 0}, "max_new_tokens"),
    ("w1", {"temperature": -1.0}, "temperature"),
    (3.5, {}, "string or a sequence of token ids"),
])
def test_bad_generate_input_is_one_clear_error(dec, prompt, kw, message):
    for call in (dec.generate, dec.stream):
        with pytest.raises(ValueError, match=message) as e:
            call(prompt, **kw)
        assert "\n" not in str(e.value)


def test_bad_load_input_is_one_clear_error(dirs):
    t, d, bad = dirs
    with pytest.raises(ModelError, match="different token ids"):
        Decoder.load(t, bad, strategy="sd")
    with pytest.raises(ModelError, match="different token ids"):
        Decoder.load(load_model(t), load_model(bad), tokenizer=t, draft_tokenizer=bad)
    with pytest.raises(ValueError, match="needs tokenizer="):
        Decoder.load(load_model(t))
    with pytest.raises(ValueError, match="dtype applies to models loaded from directories"):
        Decoder.load(load_model(t), tokenizer=t, dtype="bfloat16")
    with pytest.raises(ValueError, match="bad k-config"):
        Decoder.load(t, d, strategy="mcsd", k_config="4,x")
    with pytest.raises(TypeError, match="unknown option"):
        Decoder.load(t, d, colour="red")
    with pytest.raises(ModelError, match="model directory not found"):
        Decoder.load("/no/such/dir")


def test_importing_decoding_stays_light():
    code = "import sys, decoding; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.real
def test_shipped_pair_uses_this_device_kinds_defaults():
    from decoding.defaults import defaults_for

    d = defaults_for("cpu", shipped=True)
    dec = Decoder.load()
    assert dec.defaults == d and dec.config.strategy == d.strategy and dec.config.stop == d.stop
    import torch

    from decoding.forward import gguf, quant

    if gguf.runs_quantized(None):  # the embedded GGUF on its blocks: float32 activations in
        assert dec.session.target.dtype == torch.float32 and quant.quantized(dec.session.target) > 200
    else:
        assert str(dec.session.target.dtype) == f"torch.{d.dtype}"
    res = dec.generate("Say hello.", chat=True, max_new_tokens=8)
    assert res.token_ids and res.stats["lossless"]


def test_bf16_on_a_cpu_without_native_bf16_says_so(target_dir, monkeypatch, capsys):
    """--dtype bfloat16 where the CPU emulates it: one note line (it runs, slower than fp32)."""
    from decoding.forward import cpu
    from decoding.models.session import Session

    monkeypatch.setattr(cpu, "flags", lambda: {"avx2", "fma"})
    Session.open(str(target_dir), None, "bfloat16")
    assert "no native bfloat16" in capsys.readouterr().err
    monkeypatch.setattr(cpu, "flags", lambda: {"avx2", "avx512_bf16"})
    Session.open(str(target_dir), None, "bfloat16")
    assert "no native bfloat16" not in capsys.readouterr().err


def test_with_draft_runs_the_same_configuration_on_another_checked_head(dirs, dec, tmp_path):
    t, _, bad = dirs
    other = save_tiny(tmp_path / "draft2", WORDS, noisy_copy(load_model(t), 0.2, seed=5))
    two = dec.with_draft(other)
    assert two.config == dec.config and two.session.target is dec.session.target
    assert two.session.draft is not dec.session.draft
    out = two.generate(PROMPT, max_new_tokens=20)
    assert out.token_ids == dec.variant("ar").generate(PROMPT, max_new_tokens=20).token_ids  # lossless
    assert out.stats["strategy"] == dec.generate(PROMPT, max_new_tokens=20).stats["strategy"]
    with pytest.raises(ModelError):
        dec.with_draft(bad)  # another tokenizer: refused, as Decoder.load refuses it


@pytest.mark.real
def test_dequantized_scope_loads_the_gguf_target_as_the_fp32_reference():
    """serve-check's specstop side: inside quant.dequantized() the embedded GGUF target runs its
    dequantized fp32 linears, transformers' numbers on the same weights (vLLM serves those)."""
    import torch
    from transformers import AutoModelForCausalLM

    from decoding import models
    from decoding.forward import gguf, quant

    if not gguf.runs_quantized(None):
        pytest.skip("the quantized kernel does not run here: nothing to scope")
    with quant.dequantized():
        ref = Decoder.load(dtype="float32", strategy="ar")
    assert quant.quantized(ref.session.target) == 0 and quant.available()  # the scope is left behind
    assert quant.quantized(Decoder.load(dtype="float32", strategy="ar").session.target) > 200
    hf = AutoModelForCausalLM.from_pretrained(str(models.default_target_dir()), dtype=torch.float32)
    ids = torch.tensor([ref.prompt_ids("Write a haiku about rain.", chat=True)])
    with torch.no_grad():
        ours, theirs = ref.session.target(ids).logits[0, -1], hf(ids).logits[0, -1]
    assert (ours - theirs).abs().max() < 1e-3  # summation order only; q8 activations move it ~0.1


def test_warm_up_leaves_the_gate_its_settings_and_nothing_learnt(dirs):
    """A benchmark's warm-up request times kernels and the cost curve; the rounds it drafted must
    not decide whether the first measured request drafts (decoding.bench's suites call it)."""
    t, d, _ = dirs
    grow = Decoder.load(t, d, strategy="ti-mcsd", width=2, depth=3, stop="confidence", confidence_rule="grow",
                        grow_cost="measure")
    grow._stop.gate = DraftGate(burst=3, look_share=0.02)
    engine_gate = grow._stop.gate
    grow.generate(PROMPT, max_new_tokens=12)
    assert engine_gate._ms["plain"] and engine_gate._ahead > 0  # timed rounds; plain ones promised (no draft pays here)
    grow.warm_up(PROMPT, 12, chat=False)
    fresh = grow._stop.gate
    assert fresh is not engine_gate and grow.engine(SamplingConfig()).stop.gate is fresh
    assert (fresh.burst, fresh.look_share, fresh.window) == (3, 0.02, engine_gate.window)
    assert fresh._recorded == fresh._ahead == fresh._plain == 0 and not fresh._past and not fresh._ms["plain"]
    assert grow.generate(PROMPT, max_new_tokens=12).token_ids == grow.variant("ar").generate(
        PROMPT, max_new_tokens=12).token_ids
    plain = grow.variant("ar")
    plain.warm_up(PROMPT, 4, chat=False)  # no gate: nothing to forget
