"""The prepared device run (decoding.bench.gpu_suite) end to end on the CPU with tiny models: the
same code as on a GPU minus the graph capture; every file of the report is written."""

import json

import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from support.distill import tiny_tokenizer
from decoding.bench import gpu_suite
from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig
from decoding.drafts.io import save_feature_draft


def tiny_dirs(root):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    target = LlamaForCausalLM(cfg).eval()
    target.save_pretrained(root / "target")
    tiny_tokenizer(root / "target")
    head = FeatureDraft(FeatureDraftConfig.for_target(target, draft_vocab_size=32)).init_from_target(target, torch.arange(32))
    save_feature_draft(head, root / "head", target)
    return root / "target", root / "head"


def test_gpu_suite_runs_end_to_end_on_the_cpu(tmp_path, capsys):
    target, head = tiny_dirs(tmp_path)
    out = tmp_path / "report"
    rc = gpu_suite.main(["--suite", "gpu", "--out", str(out), "--target", str(target), "--head", str(head),
                         "--draft", str(target), "--device", "cpu", "--quick"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["forward"] == "static" and set(res["conditions"]) == {"8", "16"}
    rows = res["conditions"]["16"]
    assert {"hf-generate", "ar", "default", "hf-assisted", "sd[g=3]", "ar+device", "sd[g=2]+device", "ar@T1",
            "ar+device@T1"} == set(rows)
    assert rows["ar+device@T1"]["over_ar"]["median"] > 0 and rows["ar+device@T1"]["tokens_per_round"] == 1
    for name in ("ar", "default", "ar+device", "sd[g=2]+device"):  # greedy fp32: our rows are HF generate's text
        assert rows[name]["equal_to_hf_generate"] == rows[name]["prompts"] == 2
        assert rows[name]["over_hf_generate"]["median"] > 0
    assert len(res["cost"]["static"]) == len(res["cost"]["sizes"]) == 3
    entry = yaml.safe_load((out / "defaults.yaml").read_text())["cuda"]
    assert entry == res["cuda_defaults"] and entry["source"].startswith("python -m decoding.bench --suite gpu")
    assert (out / "cost.png").stat().st_size > 0 and "## 16 new tokens" in (out / "README.md").read_text()
    counts = res["launches"]  # untimed, after the runs: on a CPU nothing is off the CPU
    assert set(counts) == {k for k in rows if not k.startswith("hf-")}
    assert all(v["kernels_per_round"] > 0 and v["device_kernels_per_round"] == 0 for v in counts.values())
    assert "eager work besides the graph replays" in (out / "README.md").read_text()
    for name in ("ar+device", "sd[g=2]+device"):  # the prompt's forward aside: one read a round, no op
        assert 0.9 < counts[name]["host_reads_per_round"] <= 1
        assert set(counts[name]["by_phase"]) <= {"prefill", "other"} and counts[name]["by_phase"].get("other", 0) == 0
    assert set(res["round_split"]) == {"ar+device", "sd[g=2]+device"}
    assert "by step" in (out / "README.md").read_text()
    assert "report in" in capsys.readouterr().out


def test_a_failing_row_is_dropped_not_the_report(tmp_path, monkeypatch):
    target, head = tiny_dirs(tmp_path)
    load = gpu_suite.load_rows

    def with_a_broken_row(cfg):
        sess, rows = load(cfg)
        calls = []

        def broken(ids, n):
            calls.append(n)
            if len(calls) > 2:  # fails in the timed runs, after the warm-up
                raise RuntimeError("CUDA error: out of memory")
            return rows["ar"](ids, n)
        return sess, {**rows, "broken": broken}

    monkeypatch.setattr(gpu_suite, "load_rows", with_a_broken_row)
    out = tmp_path / "report"
    assert gpu_suite.main(["--out", str(out), "--target", str(target), "--head", str(head), "--draft", "none",
                           "--device", "cpu", "--quick"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["failed_rows"] == {"broken": "RuntimeError: CUDA error: out of memory"}
    assert "broken" not in res["conditions"]["8"] and "hf-assisted" not in res["conditions"]["8"]
    assert "Row broken failed" in (out / "README.md").read_text()


def test_an_ar_entry_runs_no_separate_default_row(tmp_path, monkeypatch):
    """Once the `cuda` entry is `ar` (picked on the H100), the ar row is the default: not run twice."""
    from decoding import defaults

    target, head = tiny_dirs(tmp_path)
    monkeypatch.setattr(defaults, "defaults_for", lambda device="cpu", **kw: defaults.Defaults(strategy="ar"))
    _, rows = gpu_suite.load_rows(gpu_suite.GpuSuiteConfig(target=str(target), head=str(head), draft=None,
                                                           device="cpu", dtype="float32"))
    assert "default" not in rows and {"hf-generate", "ar", "sd[g=3]", "sd[g=3]+device", "ar@T1"} <= set(rows)
