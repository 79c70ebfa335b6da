"""The scaled corpus (python -m training.corpus): the batched engine writes token shards; uint16 /
uint32 round trips, resume after a kill, dedupe across sources, greedy text equal to plain
decoding, multi-turn rows holding the target's own turns, one-line errors, the head reading it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.chat import make_chat_target, sharegpt_rows, write_jsonl

from decoding.batch.scheduler import BatchEngine
from training.corpus import tokens
from training.corpus.__main__ import main
from training.corpus.chat_template import prompt_ids
from training.corpus.scale import ScaleConfig, build, load_prompts
from training.corpus.teacher import CorpusConfig, load_teacher


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_chat_target(tmp_path_factory.mktemp("scale") / "target")


@pytest.fixture(scope="module")
def teacher(target):
    return load_teacher(CorpusConfig(target=str(target), dtype="float32"))


def prompt_file(path, texts):
    return write_jsonl(path, [{"id": f"q{i}", "prompt": t} for i, t in enumerate(texts)])


PROMPTS = [f"Tell me about {w} {i}." for i, w in enumerate(["cats", "rain", "code", "maps", "tea", "jazz"] * 2)]


def cfg(tmp_path, data, **kw) -> ScaleConfig:
    base = dict(data=[str(d) for d in data], out=str(tmp_path / "c"), batch_size=3, chunk=4,
                shard_tokens=300, max_new_tokens=10, temperature=1.0, max_turns=3, max_context_tokens=600,
                val_percent=20, heldout_percent=0)
    return ScaleConfig(**(base | kw))


def run(c: ScaleConfig, teacher) -> dict:
    convs, _ = load_prompts(c)
    return build(c, teacher, BatchEngine(teacher.model, None), convs, progress=False)


def rows(c: ScaleConfig) -> dict:
    return {(r.id, r.turn): r for r in tokens.iter_rows(c.out)}


@pytest.mark.parametrize("vocab,dtype", [(49152, "uint16"), (65536, "uint16"), (70000, "uint32")])
def test_token_shards_round_trip(tmp_path, vocab, dtype):
    assert tokens.token_dtype(vocab) == dtype
    rs = [tokens.TokenRow("p-a", 0, "code", "train", [0, vocab - 1, 5, 7, 9], [(2, 4, True)]),
          tokens.TokenRow("p-b", 2, "general", "val", [3, 1, 4, 1, 5, 9, 2], [(1, 3, False), (5, 7, True)])]
    tokens.write_shard(tmp_path / "s.safetensors", rs, dtype)
    back = tokens.read_shard(tmp_path / "s.safetensors")
    assert back == rs
    assert back[1].loss_mask.tolist() == [False, True, True, False, False, True, True]
    assert [t[0] for t in tokens.turns(back[1])] == ["p-b@2", "p-b@3"]
    size = (tmp_path / "s.safetensors").stat().st_size
    assert 12 * np.dtype(dtype).itemsize < size < 12 * np.dtype(dtype).itemsize + 1000
    with pytest.raises(ValueError, match="does not fit"):
        tokens.write_shard(tmp_path / "t.safetensors", [tokens.TokenRow("x", 0, "g", "t", [1 << 16], [])],
                           "uint16")


def test_greedy_rows_are_plain_decoding_of_the_prompt(tmp_path, teacher):
    from decoding.api import Decoder

    c = cfg(tmp_path, [prompt_file(tmp_path / "p.jsonl", PROMPTS[:5])], temperature=0.0, max_new_tokens=12)
    stats = run(c, teacher)
    assert stats["token_dtype"] == "uint16" and stats["added"]["positions"] == stats["corpus"]["tokens"]
    dec = Decoder.load(teacher.model, tokenizer=teacher.tokenizer, strategy="ar")
    got = rows(c)
    assert len(got) == 5
    for r in got.values():
        (a, b, fin), = r.spans
        ref = dec.generate(r.ids[:a], max_new_tokens=12)
        assert r.ids[a:b] == list(ref.token_ids) and fin == (r.ids[b - 1] in teacher.eos_token_ids)
        user = next(p for p in PROMPTS if p in teacher.tokenizer.decode(r.ids[:a]))
        assert r.ids[:a] == prompt_ids(teacher.tokenizer, [{"role": "user", "content": user}])


def test_multi_turn_rows_hold_the_targets_own_earlier_turns(tmp_path, teacher):
    c = cfg(tmp_path, [write_jsonl(tmp_path / "chats.jsonl", sharegpt_rows(4, turns=3))])
    run(c, teacher)
    tok = teacher.tokenizer
    for r in rows(c).values():
        assert len(r.spans) == 3 and r.turn == 0  # SmolLM2's template re-renders turns unchanged
        for j, (a, _, _) in enumerate(r.spans[1:], 1):
            before = tok.decode(r.ids[:a])
            for pa, pb, pf in r.spans[:j]:  # every earlier reply, as the target wrote it, is read
                assert tok.decode(r.ids[pa:pb - 1] if pf else r.ids[pa:pb]) in before
            assert "Because" not in before  # the data's own answers are gone
        assert r.loss_mask.sum() == sum(b - a for a, b, _ in r.spans)


def test_a_killed_run_resumes_without_duplicates_or_losses(tmp_path, teacher, monkeypatch):
    data = [prompt_file(tmp_path / "p.jsonl", PROMPTS)]
    whole = cfg(tmp_path, data, out=str(tmp_path / "whole"), batch_size=5, chunk=12)
    run(whole, teacher)
    c = cfg(tmp_path, data)
    real, calls = tokens.write_shard, []

    def dies_on_second_shard(path, rs, dtype):
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"half a shard")
            raise KeyboardInterrupt  # the machine goes away mid-write
        real(path, rs, dtype)

    monkeypatch.setattr(tokens, "write_shard", dies_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        run(c, teacher)
    monkeypatch.setattr(tokens, "write_shard", real)
    out = tmp_path / "c"
    (out / ".shard-00001.safetensors.tmp-99999").write_bytes(b"left by a kill -9")
    (out / "shard-00001.safetensors").write_bytes(b"renamed, never listed")
    first = json.loads((out / "manifest.json").read_text())["shards"]
    assert len(first) == 1
    stats = run(c, teacher)
    names = sorted(p.name for p in out.iterdir() if p.name not in (".lock", ".gitignore"))
    assert names == ["manifest.json"] + [f"shard-{i:05d}.safetensors" for i in range(stats["shards"])]
    ids = [r.id for r in tokens.iter_rows(c.out)]
    assert len(ids) == len(set(ids)) == len(PROMPTS)
    # each prompt samples from its own seeded generator: the same text whatever its batch or run
    assert rows(c) == rows(whole)
    assert run(c, teacher)["added"]["rows"] == 0


def test_a_prompt_is_written_once_across_sources(tmp_path, teacher):
    a = prompt_file(tmp_path / "a.jsonl", ["Tell me about cats.", "Why is the sky blue?"])
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": "  tell me ABOUT cats. "}]},
                                           {"conversations": [{"from": "human", "value": "Name a color."}]}])
    c = cfg(tmp_path, [a, b])
    convs, counts = load_prompts(c)
    assert len(convs) == 3 and counts["duplicates"] == 1
    run(c, teacher)
    assert len(rows(c)) == 3
    more = prompt_file(tmp_path / "more.jsonl", ["why is the sky   blue?", "A new one."])
    assert run(cfg(tmp_path, [more]), teacher)["added"]["rows"] == 1


def test_further_answers_are_new_rows_in_their_prompts_split(tmp_path, teacher):
    from training.draft.data import is_val

    p = prompt_file(tmp_path / "p.jsonl", PROMPTS[:4])
    one, _ = load_prompts(cfg(tmp_path, [p]))
    convs, counts = load_prompts(cfg(tmp_path, [p], samples=3))
    assert counts["prompts"] == 4 and counts["conversations"] == 12 and convs[:4] == one  # first answers first
    for c in convs[4:]:
        first = next(o for o in one if c.id.startswith(o.id + "~"))
        assert c.messages == first.messages and c.split == first.split
        assert is_val(c.id, 20) == is_val(first.id, 20)
    run(cfg(tmp_path, [p]), teacher)
    c = cfg(tmp_path, [p], samples=2)  # raised later: only the second answers are new
    assert run(c, teacher)["added"]["rows"] == 4
    got = rows(c)
    texts = {i: r for (i, turn), r in got.items() if turn == 0}
    assert len(texts) == 8 and any(texts[o.id].ids != texts[o.id + "~1"].ids for o in one)
    with pytest.raises(ValueError, match="samples"):
        load_prompts(cfg(tmp_path, [p], samples=0))


def test_bad_input_is_one_error_line(tmp_path, target, teacher, capsys):
    with pytest.raises(SystemExit, match=r"^error: .*missing\.jsonl"):
        main(["--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "c")])
    c = cfg(tmp_path, [prompt_file(tmp_path / "p.jsonl", PROMPTS[:2])])
    run(c, teacher)
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    m["target"]["weights_sha256"] = "another model"
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SystemExit, match=r"^error: .* written with another target"):
        main(["--data", str(tmp_path / "p.jsonl"), "--out", c.out, "--target", str(target),
              "--engine", "plain", "--dtype", "float32", "--max-new-tokens", "4"])


def test_the_command_writes_and_reports(tmp_path, target, capsys):
    data = prompt_file(tmp_path / "p.jsonl", PROMPTS[:4])
    main(["--data", str(data), "--out", str(tmp_path / "c"), "--target", str(target), "--engine", "plain",
          "--dtype", "float32", "--max-new-tokens", "6", "--heldout-percent", "0"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("added ") and "B/position" in last and "corpus:" in last
    assert len(list(tokens.iter_rows(tmp_path / "c"))) == 4


def test_the_heads_data_module_reads_a_token_corpus(tmp_path, target, teacher):
    from training.head.data import FeatureDataModule

    c = cfg(tmp_path, [write_jsonl(tmp_path / "chats.jsonl", sharegpt_rows(10, turns=2))], val_percent=30)
    run(c, teacher)
    dm = FeatureDataModule([c.out], target=str(target), source="online", draft_vocab_size=20, k=4,
                           layers=[0, 1, 2], max_prompt_tokens=10_000, val_percent=30)
    dm.setup("fit")
    want = {tid: p + comp for r in tokens.iter_rows(c.out) for tid, p, comp, _ in tokens.turns(r)}
    got = dm.train_rows + dm.val_rows
    assert len(got) == len(want) == 20 and dm.val_rows
    assert sorted(r["ids"] for r in got) == sorted(want.values())
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] >= 1 and (batch["label_start"] > 0).all()
    cached = FeatureDataModule([c.out], target=str(target), cache_root=str(tmp_path / "cache"),
                               draft_vocab_size=20, k=4, layers=[0, 1, 2], max_prompt_tokens=10_000,
                               val_percent=30)
    cached.prepare_data()  # the feature cache reads the token shards too
    cached.setup("fit")
    assert len(cached.train_rows) + len(cached.val_rows) == 20
    row = cached._load(cached.train_rows[0])
    assert len(row["top1"]) == len(row["ids"]) - 1 - row["label_start"]


def test_the_heads_data_module_trains_from_a_shard_on(tmp_path, target, teacher):
    """train_from: a warm-started head continued on the shards it has not read; validation stays."""
    from training.head.data import FeatureDataModule

    c = cfg(tmp_path, [write_jsonl(tmp_path / "chats.jsonl", sharegpt_rows(10, turns=2))], val_percent=30,
            shard_tokens=60)
    run(c, teacher)
    shards = json.loads((tmp_path / "c" / "manifest.json").read_text())["shards"]
    assert len(shards) >= 3

    def module(**kw):
        dm = FeatureDataModule([c.out], target=str(target), source="online", draft_vocab_size=20, k=4,
                               layers=[0, 1, 2], max_prompt_tokens=10_000, val_percent=30, **kw)
        dm.setup("fit")
        return dm

    whole, late = module(), module(train_from={c.out: 2})
    later = {tuple(p + comp) for f in shards[2:] for r in tokens.read_shard(tmp_path / "c" / f["file"], f)
             for _, p, comp, _ in tokens.turns(r)}
    assert late.val_rows == whole.val_rows
    assert 0 < len(late.train_rows) < len(whole.train_rows)
    assert {tuple(r["ids"]) for r in late.train_rows} == {tuple(r["ids"]) for r in whole.train_rows} & later
    with pytest.raises(ValueError, match="not among data.corpora"):
        FeatureDataModule([c.out], train_from={"elsewhere": 1})
