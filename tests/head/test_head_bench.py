"""training.bench.head: per-prompt counts, their intervals and paired comparisons."""

import pytest
import torch

from support.models import tiny_llama
from support.head import AUX, tiny_feature_draft
from training.bench.head import agreement, bootstrap, summary


def fake(prompt_hits: list[list[float]], n: float = 10.0, steps: int = 2, rounds=None) -> dict:
    """An eval result whose prompt i agrees on prompt_hits[i][j] of n positions at step j
    (chains: a step is right only where all earlier ones are); rounds[i] = (sd rounds, tokens)."""
    hits = [list(h) for h in prompt_hits]
    chain = [[min(h[: j + 1]) for j in range(steps)] for h in hits]
    ns = [[n] * steps for _ in hits]
    pp = {"prompt_ids": [f"p{i}" for i in range(len(hits))], "hits": hits, "chain": chain, "n": ns}
    if rounds is not None:
        pp |= {"rounds": [r for r, _ in rounds], "round_tokens": [t for _, t in rounds]}
    return {"per_prompt": pp}


def test_summary_closed_form():
    s = summary([5, 3], [5, 2], [10, 10])
    assert s == {"agree_step1": 0.5, "agree_step2": 0.3, "chain_step1": 0.5, "chain_step2": 0.2,
                 "accepted_length": pytest.approx(0.7)}


def test_bootstrap_intervals_and_paired_differences():
    always, never = fake([[10, 10]] * 8), fake([[0, 0]] * 8)
    assert bootstrap(always)["agree_step1"] == [1.0, 1.0, 1.0]
    assert bootstrap(always)["accepted_length"] == [2.0, 2.0, 2.0]
    assert bootstrap(always, never)["agree_step1"] == [1.0, 1.0, 1.0]
    same = bootstrap(fake([[i, i // 2] for i in range(10)]), fake([[i, i // 2] for i in range(10)]))
    assert same["agree_step1"] == [0.0, 0.0, 0.0]  # paired: one head against itself never differs
    varied = bootstrap(fake([[i, 0] for i in range(11)]))["agree_step1"]
    assert varied[0] == pytest.approx(0.5) and varied[1] < 0.5 < varied[2]  # prompts differ: a real interval
    # a head better by one position in ten on every prompt: +0.1, whatever the prompts' spread
    up = bootstrap(fake([[i + 1, 0] for i in range(9)]), fake([[i, 0] for i in range(9)]))
    assert up["agree_step1"] == pytest.approx([0.1, 0.1, 0.1])
    walked = bootstrap(fake([[5, 2]] * 4, rounds=[(10, 17), (10, 23), (5, 10), (5, 10)]))
    assert walked["sd_tokens_per_call"][0] == pytest.approx(60 / 30)  # pooled over rounds
    assert walked["sd_tokens_per_call"][1] < 2.0 < walked["sd_tokens_per_call"][2]
    assert "sd_tokens_per_call" not in bootstrap(fake([[5, 2]] * 4))  # written before rounds were kept
    assert "sd_tokens_per_call" not in bootstrap(fake([[5, 2]] * 4, rounds=[(1, 2)] * 4), fake([[5, 2]] * 4))
    other = fake([[1, 1]] * 8)
    other["per_prompt"]["prompt_ids"][0] = "elsewhere"
    with pytest.raises(ValueError, match="other prompts"):
        bootstrap(always, other)


def test_agreement_counts_per_prompt_add_up_and_do_not_depend_on_batching():
    target = tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6)
    head = tiny_feature_draft(target)
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt_id": f"p{i}", "prompt_ids": torch.randint(0, 40, (3 + i,), generator=g).tolist(),
             "completion_ids": torch.randint(0, 40, (6 + 2 * i,), generator=g).tolist()} for i in range(5)]
    one = agreement(target, head, rows, list(AUX), steps=3, max_tokens=4096)
    split = agreement(target, head, rows, list(AUX), steps=3, max_tokens=24)  # several batches
    pp = one["per_prompt"]
    assert split["per_prompt"]["n"] == pp["n"] and split["per_prompt"]["prompt_ids"] == pp["prompt_ids"]
    # other batch shapes run other GEMM kernels: a near-tie may flip on some CPU, no more
    diff = (torch.tensor(split["per_prompt"]["hits"]) - torch.tensor(pp["hits"])).abs().sum()
    assert diff <= 2, diff
    assert pp["prompt_ids"] == [r["prompt_id"] for r in rows]
    # every completion token is predicted once by step 1 (from the target's state two before it)
    assert [n[0] for n in pp["n"]] == [len(r["completion_ids"]) for r in rows]
    assert one["positions"] == sum(n[0] for n in pp["n"])
    totals = summary(*(torch.tensor(pp[k]).sum(0) for k in ("hits", "chain", "n")))
    assert all(one[k] == pytest.approx(v) for k, v in totals.items())
    assert one["accepted_length"] == pytest.approx(sum(one[f"chain_step{j}"] for j in (1, 2, 3)))


def test_expected_acceptance_is_top1_agreement_as_the_temperature_goes_to_zero():
    """sum_x min(p_T, q_T) with p_T normalised over the full vocabulary: at T -> 0 both are
    one-hot, so it is 1 exactly where the head's argmax is the target's (and 0 where the
    target's argmax is outside the draft vocabulary); at T = 1 it lies strictly between."""
    target = tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6)
    head = tiny_feature_draft(target)
    g = torch.Generator().manual_seed(1)
    rows = [{"prompt_id": f"p{i}", "prompt_ids": torch.randint(0, 40, (4,), generator=g).tolist(),
             "completion_ids": torch.randint(0, 40, (8,), generator=g).tolist()} for i in range(4)]
    cold = agreement(target, head, rows, list(AUX), steps=2, temperature=1e-4)
    hits, acc = (torch.tensor(cold["per_prompt"][k]) for k in ("hits", "accept"))
    assert (acc - hits).abs().sum() < 0.5, (acc, hits)
    warm = agreement(target, head, rows, list(AUX), steps=2, temperature=1.0)
    assert 0.0 < warm["accept_step1"] < 1.0 and warm["accept_temperature"] == 1.0
    assert bootstrap(warm)["accept_step1"][0] == pytest.approx(warm["accept_step1"])
    assert "accept_step1" not in bootstrap(fake([[5, 2]] * 4))  # written before acceptance was kept


def test_baseline_must_be_an_eval_with_per_prompt_counts(tmp_path):
    import json

    from training.bench.head import baseline

    good = {"teacher_forced": {k: fake([[1, 1]]) | {"agree_step1": 0.1} for k in ("general", "code")}}
    (tmp_path / "good.json").write_text(json.dumps(good))
    assert baseline(str(tmp_path / "good.json"))["code"]["agree_step1"] == 0.1
    old = {"teacher_forced": {k: {"agree_step1": 0.5} for k in ("general", "code")}}  # before per_prompt
    for name, data in (("old", old), ("list", [1, 2]), ("other", {"rows": 3})):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match="per-prompt counts"):
            baseline(str(tmp_path / f"{name}.json"))


def test_sd_tokens_per_call_on_greedy_continuations_is_what_decoding_commits():
    """On the target's greedy continuations the walked sd chain is the engine's sd run, round
    for round (the same head, fp32): rounds start after a rejection in both."""
    from support.head import fit_head
    from decoding.sampling import SamplingConfig
    from decoding.strategies import StrategyConfig, build_engine

    target = tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6)
    head = fit_head(target)
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), SamplingConfig())
    sd = build_engine(target, head, StrategyConfig(strategy="sd", gamma=3), SamplingConfig())
    rows, engine_rounds = [], []
    for i, prompt in enumerate([[1, 2, 3], [5], [7, 7, 7, 7, 9, 11]]):
        rows.append({"prompt_id": f"p{i}", "prompt_ids": prompt, "completion_ids": ar.generate(prompt, 24)[0]})
        taken = []
        sd.observer = lambda tree, logits, out, pos, taken=taken: taken.append(len(out.path) + 1)
        sd.generate(prompt, 24)
        engine_rounds.append(taken)
    res = agreement(target, head, rows, list(head.config.aux_layers), steps=3)
    pp = res["per_prompt"]
    for rounds, tokens, taken in zip(pp["rounds"], pp["round_tokens"], engine_rounds):
        assert rounds >= 3 and tokens == sum(taken[: int(rounds)]), (rounds, tokens, taken)
    assert res["sd_tokens_per_call"] > 1.2  # drafts were accepted: the walk really skipped ahead


def test_compare_two_eval_files_pairs_them_per_prompt_set(tmp_path):
    import json

    from training.bench.compare import main

    up = {"teacher_forced": {"general": fake([[i + 1, 0] for i in range(9)]), "magpie": fake([[5, 5]] * 3)}}
    base = {"teacher_forced": {"general": fake([[i, 0] for i in range(9)]), "code": fake([[1, 1]] * 3)}}
    for name, data in (("up", up), ("base", base)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    main([str(tmp_path / "up.json"), str(tmp_path / "base.json"), "--out", str(tmp_path), "--name", "d"])
    res = json.loads((tmp_path / "d.json").read_text())
    assert set(res) == {"eval", "base", "general"}  # only the set both measured
    assert res["general"]["difference_ci95"]["agree_step1"] == pytest.approx([0.1, 0.1, 0.1])
    assert (tmp_path / "d.png").stat().st_size > 1000
    (tmp_path / "other.json").write_text(json.dumps({"teacher_forced": {"code": fake([[1, 1]])}}))
    with pytest.raises(SystemExit, match="share no prompt set"):
        main([str(tmp_path / "up.json"), str(tmp_path / "other.json"), "--out", str(tmp_path)])
