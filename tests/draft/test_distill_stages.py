"""Draft recipe stages on tiny models: on-policy corpora, warm starts that grow, re-pick or
shrink the head, chained learning curves, and the step-cost tool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from decoding.models import MASKED_LOGIT, load_model
from support.distill import (
    EOS,
    TINY_DRAFT,
    V,
    data_module,
    trainer,
)
from training.draft.distill import export_draft
from training.draft.module import DistillModule, DraftConfig


def test_extra_corpora_add_training_rows_only(corpus_dir, on_policy_dir, tmp_path):
    from training.draft.data import is_val

    base, both = data_module(corpus_dir), data_module(corpus_dir, extra_corpora=[str(on_policy_dir)])
    for dm in (base, both):
        dm.setup("fit")
    extra = [r for r in both.train_rows if not r.target_written]
    assert len(both.train_rows) == len(base.train_rows) + len(extra) and extra
    assert [r.completion for r in both.val_rows] == [r.completion for r in base.val_rows]
    # validation prompts' on-policy rows are neither trained nor validated on
    from training.corpus.teacher import load_corpus

    op = load_corpus(on_policy_dir).to_list()
    assert len(extra) == sum(not is_val(r["prompt_id"], 20) for r in op) < len(op)
    # a recipe stage can keep to the shards its writers wrote (by the name each shard records)
    for writers, n in ((["rnd"], len(extra)), (["another-draft"], 0)):
        dm = data_module(corpus_dir, extra_corpora=[str(on_policy_dir)], extra_writers=writers)
        dm.setup("fit")
        assert sum(not r.target_written for r in dm.train_rows) == n
    # the draft's own tokens do not vote for the output head, the target's top-1 there does
    counts = both.token_counts()
    assert sum(counts.values()) == (sum(base.token_counts().values())
                                    + sum(len(r.completion) for r in extra))
    # a corpus written for another target is refused
    other = tmp_path / "other"
    other.mkdir()
    man = json.loads((on_policy_dir / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps(man | {"target": {"name": "x"}}))
    with pytest.raises(ValueError, match="another target"):
        data_module(corpus_dir, extra_corpora=[str(other)]).setup("fit")


def test_grown_draft_starts_as_the_warm_start_and_reselects_its_head(target_dir, corpus_dir,
                                                                     tmp_path):
    module = DistillModule(draft=TINY_DRAFT, target=str(target_dir))
    trainer(max_steps=2, num_sanity_val_steps=0).fit(module, datamodule=data_module(corpus_dir))
    src = export_draft(module, tmp_path / "drafts" / "v1", {"kind": "test"}, "bfloat16")
    old = load_model(src)
    with torch.no_grad():  # a head that misses frequent ids, so re-picking must change it
        old.set_head_ids(torch.arange(V - 48, V))
    old.save_pretrained(src)
    grown = DistillModule(draft=DraftConfig(init=str(src), grow_layers=2, reselect_head=True),
                          target=str(target_dir))
    assert grown.base().config.num_hidden_layers == 3 == len(grown.base().model.layers)
    x = torch.randint(0, V, (2, 12))
    grown.draft.eval()
    with torch.no_grad():  # new layers are the identity: same function as the warm start
        assert torch.allclose(grown.draft(input_ids=x).logits, old(input_ids=x).logits, atol=1e-5)
    t = trainer(max_steps=3, num_sanity_val_steps=0)
    t.fit(grown, datamodule=data_module(corpus_dir))
    ids = grown.base().lm_head.ids
    assert {1, EOS} <= set(ids.tolist()) and not torch.equal(ids, torch.arange(V - 48, V))
    assert grown.base().model.layers[2].self_attn.o_proj.weight.abs().sum() > 0  # it trains
    out = export_draft(grown, tmp_path / "drafts" / "v2", {"kind": "test"}, "bfloat16")
    served = load_model(out)
    assert served.config.num_hidden_layers == 3 and torch.equal(served.lm_head.ids, ids)


def test_draft_cost_refuses_a_missing_draft_with_one_line(tmp_path):
    from training.bench import draft_cost

    with pytest.raises(SystemExit, match="error: model directory not found"):
        draft_cost.main(["--draft", str(tmp_path / "nope")])


def test_learning_curves_chain_across_warm_started_stages(tmp_path):
    from training.draft.evaluate import learning_curve

    def csv(name: str, agree: list[float]) -> Path:
        rows = ["step,train_minutes,val/agree"] + [f"{i},{i + 1.0},{a}" for i, a in enumerate(agree)]
        (tmp_path / name).write_text("\n".join(rows) + "\n")
        return tmp_path / name

    one = learning_curve(csv("1.csv", [0.3, 0.4]), tmp_path / "1.png")
    two = learning_curve(csv("2.csv", [0.45, 0.5]), tmp_path / "2.png", one)
    three = learning_curve(csv("3.csv", [0.52]), tmp_path / "3.png", two)
    assert [q["stage"] for q in three] == [1, 1, 2, 2, 3]
    assert [q["total_minutes"] for q in three] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [q["val/agree"] for q in three] == [0.3, 0.4, 0.45, 0.5, 0.52]
    # a curve written before stages were recorded (no stage / total_minutes) is stage 1
    legacy = [{k: v for k, v in q.items() if k not in ("stage", "total_minutes")} for q in one]
    assert learning_curve(csv("2.csv", [0.45, 0.5]), tmp_path / "x.png", legacy) == two
    assert (tmp_path / "3.png").stat().st_size > 0


def test_shrunk_head_keeps_the_most_frequent_ids_and_their_logits(target_dir, corpus_dir, tmp_path):
    from training.draft import shrink_head

    module = DistillModule(draft=TINY_DRAFT, target=str(target_dir))
    trainer(max_steps=1, num_sanity_val_steps=0).fit(module, datamodule=data_module(corpus_dir))
    metrics = {"validation": {"val/agree": 0.5}, "heldout": {"top1": 0.4}}
    src = export_draft(module, tmp_path / "big", {"kind": "specstop-draft", "metrics": metrics})
    big = load_model(src)
    before = big.lm_head.ids.tolist()
    out = tmp_path / "small"
    shrink_head.main(["--draft", str(src), "--size", "20", "--out", str(out),
                      "--corpus", str(corpus_dir)])
    small = load_model(out)
    kept = small.lm_head.ids.tolist()
    assert len(kept) == 20 == small.config.head_size and set(kept) < set(before)
    assert {1, EOS} <= set(kept)  # BOS/EOS always stay
    counts = shrink_head.corpus_counts([str(corpus_dir)])
    dropped = set(before) - set(kept)
    assert min(counts[t] for t in kept if t not in (1, EOS)) >= max(counts[t] for t in dropped)
    x = torch.randint(0, V, (2, 10))
    with torch.no_grad():  # a row selection of the tied embedding: kept logits are unchanged
        a, b = big(input_ids=x).logits, small(input_ids=x).logits
    # equal up to fp32 rounding: the two heads are GEMMs of different shapes, whose blocking
    # (and so summation order) depends on the CPU's kernels; a wrong row is off by O(1)
    torch.testing.assert_close(b[..., kept], a[..., kept], rtol=1e-5, atol=1e-5 * float(a.abs().max()))
    assert (b[..., sorted(dropped)] == MASKED_LOGIT).all()
    meta = json.loads((out / "specstop_draft.json").read_text())
    assert meta["head_shrunk"]["to"] == 20 == meta["draft"]["head_size"]
    # training's validation figures stay (labelled), held-out ones of the larger head go
    assert meta["head_shrunk"]["validation_metrics_before_shrinking"] is True
    assert meta["metrics"] == {"validation": {"val/agree": 0.5}}
    assert meta["head_shrunk"]["corpus_coverage_after"] <= meta["head_shrunk"]["corpus_coverage_before"]
    # refused with one line: not smaller, the source as output
    for args, msg in ((["--size", "48", "--out", str(tmp_path / "x")], "below the current head size"),
                      (["--size", "10", "--out", str(src)], "must differ"),):
        with pytest.raises(SystemExit, match=msg):
            shrink_head.main(["--draft", str(src), "--corpus", str(corpus_dir), *args])
    assert load_model(src).lm_head.ids.tolist() == before  # the source is untouched


def test_shrink_head_refuses_draft_written_corpora(on_policy_dir):
    from training.draft.shrink_head import corpus_counts

    with pytest.raises(ValueError, match="written by a draft"):
        corpus_counts([str(on_policy_dir)])
