"""The llama suite's ratios and report from measured rows (no llama-server needed): the rows a
user reads (ours over llama.cpp, the default over `ar`, a candidate head over the shipped one)."""

from decoding.bench.llama import llama_markdown, speedups


def rows(tok_s: list[float], kind="general") -> list[dict]:
    return [{"tokens": 96, "wall_s": 96 / v, "kind": kind, "id": f"p{i}", "prompt_tokens": 40, "text": "x",
             "block_efficiency": 1.5} for i, v in enumerate(tok_s)]


def test_speedups_read_as_row_over_baseline_with_the_candidate_over_the_default():
    res = {"llama.cpp": rows([50, 55, 60, 52]), "ar": rows([100, 110, 120, 104]),
           "default": rows([110, 121, 132, 114.4]), "candidate": rows([121, 133.1, 145.2, 125.84])}
    got = {(r["a"], r["b"]): r for r in speedups(res, ["ar", "default", "candidate"], ["llama.cpp"])}
    assert set(got) == {("ar", "llama.cpp"), ("default", "llama.cpp"), ("candidate", "llama.cpp"),
                        ("default", "ar"), ("candidate", "ar"), ("candidate", "default")}
    for pair, want in {("ar", "llama.cpp"): 2.0, ("default", "ar"): 1.1, ("candidate", "default"): 1.1,
                       ("candidate", "ar"): 1.21}.items():
        r = got[pair]
        assert abs(r["speedup"] - want) < 1e-6 and r["low"] <= r["speedup"] <= r["high"]
    md = llama_markdown({"gguf": "t.gguf", "cpu": "cpu", "threads": 1, "new_tokens": 96, "quantized_linears": 0,
                         "quant_isa": "-", "results": res, "candidate": "heads/new",
                         "tokens_per_s": {n: 1.0 for n in res}, "ratios": list(got.values()),
                         "same_text_as_llama": {}, "accepted_per_round": {}})
    assert "| default / ar | 1.10x" in md and "| candidate / default | 1.10x" in md
    assert "candidate: our default configuration with the head heads/new" in md
