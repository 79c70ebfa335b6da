"""training.draft.feature_bench: per-prompt counts, their intervals and paired comparisons."""

import pytest
import torch

from conftest import tiny_llama
from test_feature_draft import AUX, tiny_feature_draft
from training.draft.feature_bench import agreement, bootstrap, summary


def fake(prompt_hits: list[list[float]], n: float = 10.0, steps: int = 2) -> dict:
    """An eval result whose prompt i agrees on prompt_hits[i][j] of n positions at step j
    (chains: a step is right only where all earlier ones are)."""
    hits = [list(h) for h in prompt_hits]
    chain = [[min(h[: j + 1]) for j in range(steps)] for h in hits]
    ns = [[n] * steps for _ in hits]
    return {"per_prompt": {"prompt_ids": [f"p{i}" for i in range(len(hits))], "hits": hits,
                           "chain": chain, "n": ns}}


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


def test_baseline_must_be_an_eval_with_per_prompt_counts(tmp_path):
    import json

    from training.draft.feature_bench import baseline

    good = {"teacher_forced": {k: fake([[1, 1]]) | {"agree_step1": 0.1} for k in ("general", "code")}}
    (tmp_path / "good.json").write_text(json.dumps(good))
    assert baseline(str(tmp_path / "good.json"))["code"]["agree_step1"] == 0.1
    old = {"teacher_forced": {k: {"agree_step1": 0.5} for k in ("general", "code")}}  # before per_prompt
    for name, data in (("old", old), ("list", [1, 2]), ("other", {"rows": 3})):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match="per-prompt counts"):
            baseline(str(tmp_path / f"{name}.json"))
