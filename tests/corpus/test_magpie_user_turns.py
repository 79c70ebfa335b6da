"""Synthetic user turns (Magpie): the prefix the target reads, the filter, de-duplication and
the diversity report."""

from __future__ import annotations

import json

import pytest
from support.chat import make_chat_target

from training.corpus import diversity
from training.corpus.chat_template import encode, user_prefix
from training.corpus.teacher import CorpusConfig, load_corpus, load_teacher
from training.corpus.diversity import distinct_n, near_duplicates
from training.corpus.magpie import MagpieConfig, clean, extract, synthesise


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def test_distinct_n_by_hand():
    assert distinct_n(["a b a b"], 1) == 0.5
    assert distinct_n(["a b a b"], 2) == pytest.approx(2 / 3)
    assert distinct_n(["a b c", "a b d"], 3) == 1.0
    assert distinct_n(["x"], 2) == 0.0


def test_near_duplicates_flag_later_copies_only():
    base = "Explain how photosynthesis turns sunlight, water and carbon dioxide into sugar."
    texts = [base, "Write a haiku about autumn leaves falling.", base.replace("sugar", "sugars"),
             base.upper(), "What is the capital of Peru and why was it founded there?"]
    assert near_duplicates(texts, 0.7) == [False, False, True, True, False]
    assert near_duplicates(texts, 0.999) == [False, False, False, True, False]


def test_clean_counts_every_refusal():
    cfg = MagpieConfig(min_words=3, max_words=12, max_repeat=0.3, near_dup=0.7)
    texts = [("How do I bake bread at home?", True),
             ("How do I bake bread at home", False),            # unfinished
             ("Hi there", True),                                # too short
             (" ".join(f"w{i}" for i in range(13)), True),     # too long
             ("go go go go go go go go", True),                 # repetitive
             ("how  do I bake BREAD at home?", True),           # exact, case and spacing folded
             ("How do I bake bread at my home?", True),         # near-duplicate
             ("Tell me a story about a brave fox.", True)]
    kept, bad = clean(texts, cfg)
    assert kept == ["How do I bake bread at home?", "Tell me a story about a brave fox."]
    assert dict(bad) == {"unfinished": 1, "too_short": 1, "too_long": 1, "repetitive": 1,
                         "duplicate": 1, "near_duplicate": 1}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    target = make_chat_target(tmp_path_factory.mktemp("magpie") / "target", seed=1)
    return load_teacher(CorpusConfig(target=str(target), dtype="float32"))


def test_synthesis_reads_the_user_prefix_resumes_and_writes_prompts(tmp_path, teacher):
    cfg = MagpieConfig(raw=str(tmp_path / "raw"), out=str(tmp_path / "p" / "magpie.jsonl"),
                       dtype="float32", n=12, batch_size=4, shard_size=4, max_new_tokens=24,
                       min_words=1, max_words=50, max_repeat=1.0, heldout_percent=30,
                       report=str(tmp_path / "rep"), compare=None)
    first = synthesise(cfg, teacher, progress=False)
    assert first["new_rows"] == 12
    rows = load_corpus(cfg.raw).to_list()
    prefix = encode(teacher.tokenizer, user_prefix(teacher.tokenizer))
    assert all(r["prompt_ids"] == prefix for r in rows)
    assert len({tuple(r["completion_ids"]) for r in rows}) == 12  # one seed per row
    grown = synthesise(MagpieConfig(**{**cfg.__dict__, "n": 16}), teacher, progress=False)
    assert grown["new_rows"] == 4 and grown["total_rows"] == 16
    assert load_corpus(cfg.raw).to_list()[:12] == rows  # earlier rows untouched

    stats = extract(MagpieConfig(**{**cfg.__dict__, "n": 16}), teacher.tokenizer)
    train = [json.loads(line) for line in open(cfg.out)]
    held = [json.loads(line) for line in open(tmp_path / "p" / "magpie_heldout.jsonl")]
    assert stats["kept"] == len(train) and stats["heldout"] == len(held)
    assert stats["kept"] + stats["heldout"] + sum(stats["refused"].values()) == 16
    assert all(r["source"] == "magpie" and r["id"].startswith("m-") for r in train + held)
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    rep = json.loads((tmp_path / "rep" / "diversity.json").read_text())
    assert rep["sources"]["magpie"]["texts"] == len(train) + len(held)
    assert rep["magpie"] == stats and (tmp_path / "rep" / "diversity.md").exists()


def test_the_batch_engine_writes_a_new_raw_directory_after_the_earlier_ones(tmp_path, teacher):
    """engine batch: our BatchEngine writes the turns; it numbers (and seeds) them after the turns
    of the earlier directory, which keeps its own engine, and extract reads both."""
    from training.corpus.__main__ import load
    from training.corpus.magpie import main
    from training.corpus.scale import ScaleConfig

    base = dict(out=str(tmp_path / "p" / "magpie.jsonl"), n=6, batch_size=4, shard_size=4, max_new_tokens=24,
                min_words=1, max_words=50, max_repeat=1.0, heldout_percent=30, report=None, compare=None)
    hf = MagpieConfig(raw=str(tmp_path / "raw"), engine="hf", dtype="float32", **base)
    synthesise(hf, teacher, progress=False)
    bt, engine, _ = load(ScaleConfig(target=str(teacher.model.name_or_path), engine="plain", dtype="float32"))
    cfg = MagpieConfig(**{**hf.__dict__, "raw": str(tmp_path / "raw-batch"), "read_also": [hf.raw],
                          "engine": "batch", "n": 10})
    res = synthesise(cfg, bt, progress=False, engine=engine)
    assert res["new_rows"] == 4 and res["total_rows"] == 4
    rows = load_corpus(cfg.raw).to_list()
    assert [r["prompt_id"] for r in rows] == [f"magpie-{i:06d}" for i in range(6, 10)]
    assert all(r["prompt_ids"] == encode(bt.tokenizer, user_prefix(bt.tokenizer)) for r in rows)
    assert len({tuple(r["completion_ids"]) for r in rows}) == 4 and all(r["completion_ids"] for r in rows)
    with pytest.raises(ValueError):  # the earlier directory refuses turns of another engine
        synthesise(MagpieConfig(**{**cfg.__dict__, "raw": hf.raw, "read_also": []}), bt, progress=False,
                   engine=engine)
    stats = extract(cfg, bt.tokenizer)
    assert stats["generated"] == 10
    with pytest.raises(SystemExit, match="holds no raw Magpie turns"):
        main(["--raw", str(tmp_path / "r2"), "--read-also", str(tmp_path / "none"), "--n", "2"])


def test_diversity_cli_compares_sources(tmp_path, capsys):
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"id": str(i), "prompt": f"Name {i} fruits."}) + "\n"
                         for i in range(30)))
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in [
        "How do volcanoes form?", "Write a limerick about a cat.", "Sort a list in Rust.",
        "Why is the sky blue at noon?", "Plan a three-day trip to Kyoto."]))
    diversity.main(["--source", f"templates={a}", "--source", f"chat={b}", "--out",
                    str(tmp_path / "r")])
    rep = json.loads((tmp_path / "r" / "diversity.json").read_text())
    assert rep["texts_per_source"] == 5
    assert rep["sources"]["chat"]["distinct_2"] > rep["sources"]["templates"]["distinct_2"]
    assert "| chat | 5 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="NAME=PATH"):
        diversity.main(["--source", str(a)])
