"""Teacher corpus: resume without loss or duplicates, batching independence, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from training.corpus import teacher as corpus
from training import shards
from training.corpus.teacher import CorpusConfig, Prompt, Teacher, build_corpus, load_corpus

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def teacher() -> Teacher:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    model = LlamaForCausalLM(cfg).eval()
    # A fake tokenizer: one id per character, so prompt lengths (and padding) vary.
    encode = lambda text: [1] + [3 + ord(c) % 60 for c in text]
    return Teacher(model, encode, [EOS], PAD, {"name": "tiny-llama", "vocab_size": 64})


PROMPTS = [Prompt(f"p{i}", "code" if i % 3 else "general", "train", "ab" * (1 + i % 5) + str(i))
           for i in range(11)]


def make_cfg(out, **kw) -> CorpusConfig:
    base = {"out": str(out), "dtype": "float32", "batch_size": 2, "shard_size": 3,
            "max_new_tokens": 6, "temperature": 1.0}
    return CorpusConfig(**{**base, **kw})


def rows(path) -> list[dict]:
    return sorted(load_corpus(path).to_list(), key=lambda r: r["prompt_id"])


@pytest.mark.parametrize("crash_in", ["generate_batch", "write_json"])
def test_resume_after_interruption_matches_uninterrupted(tmp_path, teacher, monkeypatch,
                                                         crash_in):
    build_corpus(make_cfg(tmp_path / "a"), teacher, PROMPTS, progress=False)
    expected = rows(tmp_path / "a")
    assert [r["prompt_id"] for r in expected] == sorted(p.id for p in PROMPTS)

    # Crash during the third shard: in generation, or after its parquet file was renamed into
    # place but before the manifest listed it (an orphan shard the restart must discard).
    module = corpus if crash_in == "generate_batch" else shards  # write_json: the manifest
    real, calls = getattr(module, crash_in), {"n": 0}
    crash_at = 5 if crash_in == "generate_batch" else 3

    def crashing(*args, **kw):
        calls["n"] += 1
        if calls["n"] == crash_at:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(module, crash_in, crashing)
    with pytest.raises(KeyboardInterrupt):
        build_corpus(make_cfg(tmp_path / "b"), teacher, PROMPTS, progress=False)
    monkeypatch.setattr(module, crash_in, real)
    (tmp_path / "b" / ".shard-00009.parquet.tmp-1").write_bytes(b"half a file")
    assert len(rows(tmp_path / "b")) == 6  # two complete shards survived

    stats = build_corpus(make_cfg(tmp_path / "b"), teacher, PROMPTS, progress=False)
    assert stats["new_rows"] == 5 and stats["remaining"] == 0
    assert rows(tmp_path / "b") == expected
    files = sorted(f.name for f in (tmp_path / "b").iterdir())
    assert files == [".lock", "manifest.json"] + [f"shard-0000{i}.parquet" for i in range(4)]
    # A third run has nothing left to do.
    assert build_corpus(make_cfg(tmp_path / "b"), teacher, PROMPTS, progress=False)["new_rows"] == 0


def test_rows_do_not_depend_on_batching(tmp_path, teacher):
    build_corpus(make_cfg(tmp_path / "a", batch_size=1), teacher, PROMPTS, progress=False)
    build_corpus(make_cfg(tmp_path / "b", batch_size=4, shard_size=8), teacher, PROMPTS,
                 progress=False)
    a = rows(tmp_path / "a")
    assert a == rows(tmp_path / "b")
    for r, p in zip(a, sorted(PROMPTS, key=lambda p: p.id)):
        assert r["prompt_ids"] == teacher.encode(p.text)  # stored without padding
        assert 1 <= len(r["completion_ids"]) <= 6
        assert r["finished"] == (r["completion_ids"][-1] == EOS)


def test_wrong_schema_manifest_raises(tmp_path, teacher):
    build_corpus(make_cfg(tmp_path, max_new_tokens=2), teacher, PROMPTS[:2], progress=False)
    m = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**m, "schema_version": 99}))
    with pytest.raises(ValueError, match="schema version 99"):
        load_corpus(tmp_path)
    with pytest.raises(ValueError, match="schema version"):
        build_corpus(make_cfg(tmp_path), teacher, PROMPTS, progress=False)
    (tmp_path / "manifest.json").write_text('{"kind": "something else"}')
    with pytest.raises(ValueError, match="not a specstop-teacher-corpus manifest"):
        load_corpus(tmp_path)


def test_more_samples_grow_the_same_corpus(tmp_path, teacher):
    from training.draft.data import is_val

    build_corpus(make_cfg(tmp_path), teacher, PROMPTS, progress=False)
    first = rows(tmp_path)
    stats = build_corpus(make_cfg(tmp_path, samples=3), teacher, PROMPTS, progress=False)
    assert stats["new_rows"] == 2 * len(PROMPTS)
    grown = {r["prompt_id"]: r for r in rows(tmp_path)}
    assert all(grown[r["prompt_id"]] == r for r in first)  # earlier rows untouched
    for p in PROMPTS:
        a, b = grown[f"{p.id}#1"], grown[f"{p.id}#2"]
        assert a["prompt_ids"] == b["prompt_ids"] == grown[p.id]["prompt_ids"]
        assert a["seed"] != b["seed"] != grown[p.id]["seed"]
        assert is_val(a["prompt_id"], 30.0) == is_val(p.id, 30.0)  # a prompt never straddles splits
    assert len({tuple(r["completion_ids"]) for r in grown.values()}) > len(PROMPTS)


def test_changed_settings_refuse_to_mix(tmp_path, teacher):
    build_corpus(make_cfg(tmp_path, max_new_tokens=2), teacher, PROMPTS[:2], progress=False)
    with pytest.raises(ValueError, match="generation"):
        build_corpus(make_cfg(tmp_path, max_new_tokens=3), teacher, PROMPTS, progress=False)


def test_bad_prompt_files_exit_with_one_line(tmp_path):
    with pytest.raises(SystemExit, match="prompt file not found"):
        corpus.main(["--prompts", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)])
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SystemExit, match="prompt file is empty"):
        corpus.main(["--prompts", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path)])
    (tmp_path / "bad.jsonl").write_text('{"id": "x"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1: not a prompt row"):
        corpus.main(["--prompts", str(tmp_path / "bad.jsonl")])
    with pytest.raises(SystemExit, match="config file not found"):
        corpus.main(["--config", str(tmp_path / "nope.yaml")])


def test_shipped_prompt_splits_are_disjoint():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "data" / "prompts"
    splits = {n: corpus.read_prompts([str(root / f"{n}.jsonl")])
              for n in ("train", "val", "heldout_general", "heldout_code")}
    ids = [p.id for ps in splits.values() for p in ps]
    texts = [p.text for ps in splits.values() for p in ps]
    assert len(set(ids)) == len(ids) and len(set(texts)) == len(texts)
    assert len(splits["heldout_code"]) == 40 and 80 <= len(splits["heldout_general"]) <= 120
    assert len(splits["train"]) >= 3500


@pytest.mark.parametrize("sampler", corpus.SAMPLERS)
def test_row_sampler_draws_the_tempered_distribution(sampler):
    """Both samplers are exact: chi-square of 4,000 draws per row against softmax(s / T)."""
    from scipy.stats import chisquare

    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5],
                           [0.0, 0.0, 3.0, -2.0, 1.0, float("-inf")]])
    temp, n = 0.7, 4000
    counts = torch.zeros_like(scores)
    rs = corpus.RowSampler([11, 12], temp, sampler)
    for _ in range(n):
        counts += rs(None, scores.clone()) == 0  # one-hot rows: 0 marks the pick
    probs = torch.softmax(scores / temp, -1)
    for c, p in zip(counts, probs):
        keep = p > 0
        assert c[~keep].sum() == 0  # impossible tokens are never drawn
        exp = p[keep].double() / p[keep].double().sum() * n
        assert chisquare(c[keep].double().numpy(), exp.numpy()).pvalue > 1e-3
    # the same seeds give the same draws, whatever else shares the batch
    again = corpus.RowSampler([12], temp, sampler)
    first = corpus.RowSampler([11, 12], temp, sampler)
    assert torch.equal(first(None, scores.clone())[1], again(None, scores[1:].clone())[0])


def test_on_policy_corpus_records_each_shards_writer(tmp_path, teacher):
    """A draft writes (on-policy): the manifest keeps the target, is marked on-policy, and
    every shard names its writer; a later, better draft keeps growing the same corpus."""
    from dataclasses import replace

    def writer(seed: int) -> Teacher:
        torch.manual_seed(seed)
        draft = LlamaForCausalLM(teacher.model.config).eval()
        return replace(teacher, model=draft, info=teacher.info | {"writer": {"name": f"d{seed}"}})

    cfg = make_cfg(tmp_path / "op", sampler=corpus.SAMPLERS[1])
    build_corpus(cfg, writer(1), PROMPTS[:6], progress=False)
    build_corpus(replace(cfg, samples=2), writer(2), PROMPTS[:6], progress=False)
    m = json.loads((tmp_path / "op" / "manifest.json").read_text())
    assert m["target"] == teacher.info and m["generation"]["on_policy"] is True
    assert [s["writer"]["name"] for s in m["shards"]] == ["d1", "d1", "d2", "d2"]
    assert len(rows(tmp_path / "op")) == 12
    # target-written rows never join an on-policy corpus, nor the reverse
    with pytest.raises(ValueError, match="generation"):
        build_corpus(replace(cfg, samples=3), teacher, PROMPTS[:6], progress=False)
    build_corpus(make_cfg(tmp_path / "t", sampler=corpus.SAMPLERS[1]), teacher, PROMPTS[:2],
                 progress=False)
    with pytest.raises(ValueError, match="generation"):
        build_corpus(make_cfg(tmp_path / "t", sampler=corpus.SAMPLERS[1]), writer(1), PROMPTS,
                     progress=False)
