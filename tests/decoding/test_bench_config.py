"""The benchmark's YAML configs (decoding.bench.config): unknown keys and bad threshold values are
refused when the file is read, and the shipped configs are valid, measure enough (prompts, repeats,
bootstrap resamples) and give each draft of the drafts comparison its own decider."""

from pathlib import Path

import pytest

from decoding.bench.config import load_config


def test_config_rejects_unknown_keys(tmp_path):
    p = tmp_path / "b.yaml"
    p.write_text("repeats: 2\nstrategies:\n  - {name: ar, strategy: ar, gama: 3}\n")
    with pytest.raises(ValueError, match="unknown key.*gama"):
        load_config(p)
    p.write_text("strategies:\n  - {name: sd, strategy: sd}\n")
    with pytest.raises(ValueError, match="start with ar"):
        load_config(p)


def test_shipped_config_is_valid():
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "bench.yaml")
    assert cfg.strategies[0].strategy == "ar" and {s.strategy for s in cfg.strategies} >= {
        "hf-assisted", "hf-prompt-lookup", "sd", "mcsd", "ti-mcsd"}


def test_confidence_threshold_values_are_checked(tmp_path):
    p = tmp_path / "b.yaml"
    for bad, msg in (("tunned", "must be in"), ("1.5", "must be in"), ("tuned", "belongs to stop: confidence")):
        p.write_text(f"strategies:\n  - {{name: ar, strategy: ar}}\n  - {{name: x, strategy: ti-mcsd, "
                     f"confidence_threshold: {bad}}}\n")
        with pytest.raises(ValueError, match=msg):
            load_config(p)


@pytest.mark.parametrize("name", ["bench.yaml", "bench_decider.yaml", "bench_feature.yaml"])
def test_shipped_configs_measure_enough_and_tune_the_baselines(name):
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / name)
    assert cfg.prompts_per_set >= 6 and cfg.repeats >= 3 and cfg.bootstrap_resamples >= 1000
    conf = [s for s in cfg.strategies if s.stop == "confidence"]
    assert {s.confidence_rule for s in conf if s.tuned} == {"level", "tree"}
    assert [s.confidence_threshold for s in conf if "HF default 0.4" in s.name] == [0.4]
    # a confidence row is tuned, HF's own setting, or a grown tree (no threshold: a cost model)
    assert all(s.confidence_threshold == "tuned" or "HF default" in s.name or s.grows for s in conf)
    assert cfg.dtype == "auto"  # bf16 only where the CPU computes it natively


def test_the_drafts_config_gives_each_draft_its_own_decider():
    from decoding.decider.policy import resolve_decider_dir
    from decoding.defaults import DEFAULT_DRAFT

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "bench_drafts.yaml")
    assert cfg.prompts_per_set >= 6 and cfg.repeats >= 3 and cfg.dtype == "auto"
    drafts = {s.draft for s in cfg.strategies if s.strategy != "ar"}
    assert None in drafts and len(drafts) == 2  # the default draft and one other
    for s in cfg.strategies:
        if s.draft is not None:
            assert (root / s.draft / "config.json").is_file(), s.name
            if s.stop == "decider" or s.tuned:  # never the run's decider (the default pair's)
                assert s.decider and (resolve_decider_dir(s.decider) / "config.json").is_file(), s.name
    assert (DEFAULT_DRAFT / "config.json").is_file()


def test_auto_dtype_measures_what_decoder_load_runs(monkeypatch):
    """A GGUF target on its blocks runs float32 activations for a user (Decoder.load): a benchmark's
    `auto` measures that path, not the dense bf16 one resolve_dtype picks for AVX512-BF16."""
    from decoding.bench import compare
    from decoding.defaults import resolve_dtype
    from decoding.forward import gguf

    monkeypatch.setattr(gguf, "runs_quantized", lambda target, device="cpu": True)
    assert compare.bench_dtype("auto", None, "cpu")[0] == "float32"
    assert compare.bench_dtype("bfloat16", None, "cpu")[0] == "bfloat16"  # asked for: kept
    monkeypatch.setattr(gguf, "runs_quantized", lambda target, device="cpu": False)
    assert compare.bench_dtype("auto", "some/dir", "cpu") == resolve_dtype("auto", "cpu")
