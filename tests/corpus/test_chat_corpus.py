"""Chat corpus: the target regenerates every assistant turn (resumable, sharded); rows carry
assistant tokens only as completions; keep mode follows the template's masks."""

from __future__ import annotations

import json

import pytest
from support.chat import EOS, make_chat_target, openai_rows, sharegpt_rows, write_jsonl

from training.corpus import chat as chat_corpus

from training.corpus import teacher as corpus
from training.corpus.chat import ChatCorpusConfig, build_chat_corpus
from training.corpus.chat_data import load_chats
from training.corpus.chat_template import assistant_mask, mask_runs, prompt_ids
from training.corpus.teacher import CorpusConfig, load_corpus, load_teacher


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_chat_target(tmp_path_factory.mktemp("chat") / "target")


@pytest.fixture(scope="module")
def teacher(target):
    return load_teacher(CorpusConfig(target=str(target), dtype="float32"))


def convs(tmp_path, n=9):
    path = write_jsonl(tmp_path / "chats.jsonl", sharegpt_rows(n, turns=3) + openai_rows(3))
    return load_chats(str(path), val_percent=20, heldout_percent=20).conversations


def cfg(out, **kw) -> ChatCorpusConfig:
    base = dict(out=str(out), dtype="float32", batch_size=4, shard_size=3, max_new_tokens=12,
                temperature=1.0, max_turns=3, max_context_tokens=400)
    return ChatCorpusConfig(**(base | kw))


def rows(path) -> list[dict]:
    return sorted(load_corpus(path).to_list(), key=lambda r: r["prompt_id"])


def test_every_turn_is_regenerated_given_the_conversation_so_far(tmp_path, teacher):
    cs = convs(tmp_path)
    stats = build_chat_corpus(cfg(tmp_path / "c"), teacher, cs, progress=False)
    got = {r["prompt_id"]: r for r in rows(tmp_path / "c")}
    kept = [c for c in cs if c.split != "heldout"]
    assert 0 < len(kept) < len(cs) and stats["remaining"] == 0
    assert {k.split("@")[0] for k in got} == {c.id for c in kept}  # held-out never written
    tok = teacher.tokenizer
    for c in kept:
        users = [m for m in c.messages if m["role"] == "user"]
        history = [m for m in c.messages[:1] if m["role"] == "system"]
        for k, user in enumerate(users[:3]):
            r = got[f"{c.id}@{k}"]
            assert r["split"] == c.split and r["kind"] == c.kind
            assert r["prompt_ids"] == prompt_ids(tok, history + [user])
            assert r["finished"] == (r["completion_ids"][-1] == EOS)
            reply = tok.decode(r["completion_ids"][:-1] if r["finished"] else r["completion_ids"],
                               skip_special_tokens=True)
            old = [m["content"] for m in c.messages if m["role"] == "assistant"]
            assert reply not in old  # the target's words, not the data's
            history = history + [user, {"role": "assistant", "content": reply}]
        assert f"{c.id}@{len(users)}" not in got
    # the regenerated conversation's own template mask gives the same assistant tokens (where
    # a reply holds no special token mid-way: decoding drops those)
    assert any(r["finished"] for r in got.values()) and not all(r["finished"] for r in got.values())
    checked = 0
    for c in kept:
        ids, mask = assistant_mask(tok, rebuild(tok, c, got))
        runs = mask_runs(mask)
        assert len(runs) == min(3, sum(m["role"] == "user" for m in c.messages))
        for k, (a, b) in enumerate(runs):
            r = got[f"{c.id}@{k}"]
            body = r["completion_ids"][:-1] if r["finished"] else r["completion_ids"]
            if any(t < 3 for t in body):
                continue
            assert ids[a:b] == body + [EOS] and ids[:a] == r["prompt_ids"]
            checked += 1
    assert checked >= 3


def rebuild(tok, c, got) -> list[dict]:
    msgs = [m for m in c.messages[:1] if m["role"] == "system"]
    for k, user in enumerate(m for m in c.messages if m["role"] == "user"):
        comp = got[f"{c.id}@{k}"]["completion_ids"]
        reply = tok.decode(comp[:-1] if comp[-1] == EOS else comp, skip_special_tokens=True)
        msgs += [user, {"role": "assistant", "content": reply}]
    return msgs


def test_regeneration_resumes_after_an_interruption(tmp_path, teacher, monkeypatch):
    cs = convs(tmp_path)
    build_chat_corpus(cfg(tmp_path / "a"), teacher, cs, progress=False)
    expected = rows(tmp_path / "a")

    real, calls = corpus.generate_batch, {"n": 0}

    def crashing(*args, **kw):  # shard 1 takes 3 turns of one batch; die inside shard 2
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(corpus, "generate_batch", crashing)
    with pytest.raises(KeyboardInterrupt):
        build_chat_corpus(cfg(tmp_path / "b"), teacher, cs, progress=False)
    monkeypatch.setattr(corpus, "generate_batch", real)
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert len(m["shards"]) == 1 and m["shards"][0]["conversations"] == 3
    stats = build_chat_corpus(cfg(tmp_path / "b"), teacher, cs, progress=False)
    assert stats["new_conversations"] == sum(c.split != "heldout" for c in cs) - 3
    assert rows(tmp_path / "b") == expected
    assert build_chat_corpus(cfg(tmp_path / "b"), teacher, cs, progress=False)["new_rows"] == 0
    with pytest.raises(ValueError, match="another generation"):
        build_chat_corpus(cfg(tmp_path / "b", temperature=0.5), teacher, cs, progress=False)


def test_keep_mode_rows_are_the_templates_assistant_spans(tmp_path, teacher):
    cs = convs(tmp_path)
    build_chat_corpus(cfg(tmp_path / "k", mode="keep", max_turns=2), teacher, cs, progress=False)
    got = {r["prompt_id"]: r for r in rows(tmp_path / "k")}
    for c in (c for c in cs if c.split != "heldout"):
        ids, mask = assistant_mask(teacher.tokenizer, list(c.messages))
        runs = mask_runs(mask)[:2]
        assert [got[f"{c.id}@{k}"]["completion_ids"] for k in range(len(runs))] == \
            [ids[a:b] for a, b in runs]
        assert all(got[f"{c.id}@{k}"]["finished"] for k in range(len(runs)))
        assert f"{c.id}@{len(runs)}" not in got


def test_context_budget_stops_conversations_and_skips_long_ones(tmp_path, teacher):
    cs = convs(tmp_path)
    first = min(len(prompt_ids(teacher.tokenizer, [m for m in c.messages[:2]])) for c in cs)
    stats = build_chat_corpus(cfg(tmp_path / "s", max_context_tokens=first + 5), teacher, cs,
                              progress=False)
    got = rows(tmp_path / "s")
    assert all(len(r["prompt_ids"]) <= first + 5 for r in got)
    assert stats["too_long"] > 0 and all(r["prompt_id"].endswith("@0") for r in got)


def test_cli_reports_bad_rows_and_refuses_no_data(tmp_path, target, capsys):
    path = write_jsonl(tmp_path / "c.jsonl", sharegpt_rows(4) + [{"messages": "x"}])
    args = ["--data", str(path), "--out", str(tmp_path / "o"), "--target", str(target),
            "--dtype", "float32", "--max-new-tokens", "4", "--heldout-percent", "0",
            "--val-percent", "0"]
    chat_corpus.main(args)
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["bad_rows"] == {"wrong_type": 1} and stats["new_conversations"] == 4
    with pytest.raises(SystemExit, match="no chat data"):
        chat_corpus.main(["--out", str(tmp_path / "o")])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": "x"}])
    with pytest.raises(SystemExit, match="no valid conversation"):
        chat_corpus.main(["--data", str(bad), "--out", str(tmp_path / "o2")])
