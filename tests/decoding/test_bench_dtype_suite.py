"""`python -m decoding.bench --suite dtype`: ar and the default configuration in float32 and
bfloat16, interleaved, on tiny models (which dtype `dtype: auto` should pick is measured)."""

import json

from decoding.bench.cli import main
from decoding.bench.dtype import dtype_markdown, run_dtypes
from decoding.bench.quick import quick_config


def test_dtype_suite_rows_ratios_and_equality(tmp_path):
    cfg = quick_config(tmp_path / "q")
    cfg.repeats, cfg.max_new_tokens = 2, 10
    prompts = ["w2 w3 w4 w5", "w20 w21 w22 w23"]
    res = run_dtypes(cfg, prompts, "test")
    assert set(res["rows"]) == {"ar float32", "default float32", "ar bfloat16", "default bfloat16"}
    assert all(r["tokens_per_s"] > 0 for r in res["rows"].values())
    # float32 is exact: the default speculative configuration reproduces ar token for token
    assert res["rows"]["default float32"]["equal_to_ar_same_dtype"]
    ratios = res["ratios"]
    assert {"ar: float32 / bfloat16", "default: float32 / bfloat16"} <= set(ratios)
    fastest = [k for k in ratios if "fastest over fastest" in k]
    assert len(fastest) == 1 and fastest[0].startswith("default ")
    for r in ratios.values():
        assert r["ci95"][0] <= r["point"] <= r["ci95"][1]
    md = dtype_markdown(res)
    assert "| default float32 |" in md and "fastest over fastest" in md
    json.dumps(res)  # results.json-ready


def test_dtype_suite_refuses_compare_only_flags(capsys):
    assert main(["--suite", "dtype", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compare suite" in err
