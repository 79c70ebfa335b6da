"""Chat data in: both shapes from JSONL, parquet and saved datasets; bad rows counted by
reason; stable splits; assistant masks from the chat template, exactly."""

from __future__ import annotations

import json

import pytest
from support.chat import (EOS, GENERATION_TEMPLATE, chat_tokenizer, openai_rows, sharegpt_rows,
                           write_jsonl)

from training.corpus import chat_data
from training.corpus.chat_data import load_chats, normalize
from training.corpus.chat_template import assistant_mask, mask_runs, prompt_ids, user_prefix
from training.draft.data import is_val


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def as_dicts(data):
    return sorted((c.id, c.messages, c.split, c.kind) for c in data.conversations)


def test_both_shapes_from_jsonl_parquet_and_saved_dataset(tmp_path):
    import datasets

    rows = sharegpt_rows(6) + openai_rows(4)
    jl = load_chats(str(write_jsonl(tmp_path / "chats.jsonl", rows)))
    assert jl.rows == 10 and len(jl.conversations) == 10 and not jl.bad
    c = next(c for c in jl.conversations if c.messages[0]["role"] == "system")
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert c.messages[0]["content"].startswith("Be brief") and c.kind == "general"
    o = next(c for c in jl.conversations if c.messages[0]["content"] == "Write code 0")
    assert [m["role"] for m in o.messages] == ["user", "assistant", "user"] and o.kind == "code"

    # parquet needs one schema per file: one file per shape, read together
    datasets.Dataset.from_list(sharegpt_rows(6)).to_parquet(str(tmp_path / "a.parquet"))
    datasets.Dataset.from_list(openai_rows(4)).to_parquet(str(tmp_path / "b.parquet"))
    pq = load_chats([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")])
    assert as_dicts(pq) == as_dicts(jl)

    saved = tmp_path / "saved"
    datasets.DatasetDict({"x": datasets.Dataset.from_list(sharegpt_rows(6)),
                          "y": datasets.Dataset.from_list(openai_rows(4))}).save_to_disk(str(saved))
    assert as_dicts(load_chats(str(saved))) == as_dicts(jl)


def test_bad_rows_are_counted_by_reason(tmp_path, capsys):
    good = sharegpt_rows(2)
    bad = [
        {"text": "no conversation"},
        {"conversations": "oops"},
        {"conversations": [{"from": "human", "value": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
        {"conversations": [{"from": "robot", "value": "hi"}]},
        {"messages": [{"role": "user", "content": "  "}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        {"messages": [{"role": "assistant", "content": "first"}, {"role": "user", "content": "b"}]},
        {"messages": [{"role": "system", "content": "only a system prompt"}]},
        good[0],
    ]
    data = load_chats(str(write_jsonl(tmp_path / "c.jsonl", good + bad)))
    assert data.rows == 13 and len(data.conversations) == 2
    assert data.summary()["bad"] == {"no_conversation": 1, "wrong_type": 3, "unknown_role": 1,
                                     "empty_content": 1, "misplaced_system": 1,
                                     "not_alternating": 2, "no_user_turn": 1, "duplicate": 1}
    chat_data.main(["--data", str(tmp_path / "c.jsonl")])
    out = json.loads(capsys.readouterr().out)
    assert out["bad"]["wrong_type"] == 3 and out["conversations"] == 2
    with pytest.raises(SystemExit, match="cannot read chat data|not a .jsonl"):
        chat_data.main(["--data", str(tmp_path / "missing.csv")])


def test_openai_text_parts_and_sharegpt_system_field():
    parts = normalize({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert parts == [{"role": "user", "content": "ab"}]
    sys_field = normalize({"system": "S", "conversations": [{"from": "human", "value": "q"}]})
    assert sys_field[0] == {"role": "system", "content": "S"}


def test_a_prompt_file_row_is_one_user_turn(tmp_path):
    assert normalize({"prompt": "How do tides work?"}) == [{"role": "user", "content": "How do tides work?"}]
    assert normalize({"prompt": "  "}) == "empty_content"
    # magpie's output file reads as chat data: one user turn each, its extra fields ignored
    rows = [{"id": f"m{i}", "source": "magpie", "kind": "general", "prompt": f"Question {i}?"} for i in range(3)]
    got = load_chats(str(write_jsonl(tmp_path / "magpie.jsonl", rows + [{"prompt": ""}])))
    assert [c.messages for c in got.conversations] == [({"role": "user", "content": f"Question {i}?"},)
                                                       for i in range(3)]
    assert got.bad == {"empty_content": 1}


def test_split_is_stable_and_matches_the_trainers_validation(tmp_path):
    data = load_chats(str(write_jsonl(tmp_path / "c.jsonl", sharegpt_rows(300))),
                      val_percent=10, heldout_percent=10)
    again = load_chats(str(write_jsonl(tmp_path / "d.jsonl", sharegpt_rows(300)[::-1])),
                       val_percent=10, heldout_percent=10)
    assert {c.id: c.split for c in data.conversations} == {c.id: c.split for c in again.conversations}
    counts = data.summary()["splits"]
    assert set(counts) == {"train", "val", "heldout"} and 10 < counts["val"] < 60
    for c in data.conversations:  # every turn row of a conversation validates with it
        assert (c.split == "val") == is_val(c.id, 10) == is_val(f"{c.id}@3", 10)


THREE_TURNS = [{"role": "system", "content": "Be kind."},
               {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
               {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "See you\n"}]


def expected_mask(tok, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Ids and mask built piece by piece (the tokenizer is one token per character)."""
    ids, mask = [], []
    for text, assistant in pieces:
        p = tok(text, add_special_tokens=False)["input_ids"]
        ids, mask = ids + p, mask + [assistant] * len(p)
    return ids, mask


@pytest.mark.parametrize("template", ["smollm2", "generation"])
def test_assistant_mask_system_prompt_three_turns(template):
    tok = chat_tokenizer() if template == "smollm2" else chat_tokenizer(GENERATION_TEMPLATE)
    pieces = [("<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
               "<|im_start|>assistant\n", False), ("Hello.<|im_end|>", True),
              ("\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", False),
              ("4<|im_end|>", True),
              ("\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", False),
              ("See you\n<|im_end|>", True), ("\n", False)]
    ids, mask = assistant_mask(tok, THREE_TURNS)
    assert (ids, mask) == expected_mask(tok, pieces)
    runs = mask_runs(mask)
    assert len(runs) == 3 and all(ids[b - 1] == EOS for _, b in runs)
    for k, (a, _) in enumerate(runs):  # a turn starts where the generation prompt leaves off
        assert ids[:a] == prompt_ids(tok, THREE_TURNS[: 2 + 2 * k])


def test_assistant_mask_with_the_templates_default_system_prompt():
    tok = chat_tokenizer()
    ids, mask = assistant_mask(tok, THREE_TURNS[1:3])
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Hello.<|im_end|>"
    assert tok.decode(ids[: mask.index(True)]).startswith("<|im_start|>system\nYou are a helpful")


def test_user_prefix_is_the_template_before_the_users_words():
    tok = chat_tokenizer()
    assert user_prefix(tok) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                                "trained by Hugging Face<|im_end|>\n<|im_start|>user\n")
    assert user_prefix(tok, "Be terse.") == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n"
