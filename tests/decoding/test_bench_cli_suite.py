"""decoding.bench --suite cli: fresh processes, variants interleaved, the first call apart."""

import pytest

from decoding.bench import cli_suite as cs


def test_cli_suite_pairs_calls_and_reports_the_first_call_apart(monkeypatch):
    seen = []

    def fake(prompt, extra, new_tokens, threads, env=None):
        default = not extra
        seen.append(("default" if default else "ar", bool(env)))
        wall = 30.0 if env else (2.0 if default else 4.0)  # the first call times the cost curve
        return {"wall_s": wall, "generate_s": wall - 1.5, "tokens": new_tokens, "tokens_per_s": 40.0,
                "strategy": "grow" if default else "ar", "token_ids": [1, 2, 3]}

    monkeypatch.setattr(cs, "run_cli", fake)
    res = cs.cli_suite(prompts=2, new_tokens=96, repeats=2, threads=2, progress=lambda m: None)
    assert seen[0] == ("default", True) and all(not env for _, env in seen[1:])
    assert len(seen) == 1 + 2 * 2 * 4  # 2 repeats x 4 prompts (2 per kind) x 2 variants
    # each prompt alternates which variant goes first
    firsts = [seen[1 + 2 * k][0] for k in range(8)]
    assert firsts.count("default") == firsts.count("ar") == 4
    assert res["default_over_ar_end_to_end"] == pytest.approx([2.0, 2.0, 2.0])
    assert res["variants"]["default"]["median_startup_s"] == pytest.approx(1.5)
    assert res["first_call"]["wall_s"] == 30.0 and res["outputs_equal"] == 4
    md = cs.cli_markdown(res, "python -m decoding.bench --suite cli", "some CPU")
    assert "**2.00x**" in md and "| 30.00 |" in md


def test_run_cli_reports_a_failed_call_in_one_line():
    with pytest.raises(RuntimeError, match="failed: error: --max-new-tokens must be >= 1"):
        cs.run_cli("hi", [], 0, None)
