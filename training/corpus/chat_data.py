"""Users' chat data in, as conversations the corpus tools can regenerate or train on.

    python -m training.corpus.chat_data --data chats.jsonl [--val-percent 5] [--heldout-percent 5]

Reads, with `datasets`, a local JSONL / JSON file, a parquet file or a directory written by
`Dataset.save_to_disk` (every split of a DatasetDict), rows in either shape:
    ShareGPT  {"conversations": [{"from": "system|human|gpt", "value": ...}, ...], "system"?: ...}
    OpenAI    {"messages": [{"role": "system|user|assistant", "content": ...}, ...]}
(OpenAI content given as a list of text parts is joined). Multi-turn, system prompts kept.
A prompt file's row ({"prompt": ...}, e.g. training.corpus.magpie's output) is a one-turn
conversation: its user turn, no assistant turn (regenerate mode writes the reply).
A row is refused, counted by reason and reported, never dropped silently: no_conversation,
wrong_type, unknown_role, empty_content, misplaced_system (a system turn after the first),
not_alternating (user and assistant must alternate, user first), no_user_turn, duplicate.
The split comes from a stable hash of the conversation (training.draft.data.hash_bucket, the
same one the trainers validate by): `val_percent` of the buckets are validation (exactly the
rows FeatureDataModule validates on with the same data.val_percent), the next
`heldout_percent` held out (never written to a training corpus), the rest train.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from decoding.options import add_option

from training.draft.data import hash_bucket

ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
         "assistant": "assistant", "chatgpt": "assistant", "model": "assistant"}
SHAPES = {"conversations": ("from", "value"), "messages": ("role", "content")}
REASONS = ("no_conversation", "wrong_type", "unknown_role", "empty_content", "misplaced_system",
           "not_alternating", "no_user_turn", "duplicate")
CODE_MARKS = ("```", "def ", "function ", "#include", "public static", "SELECT ")


@dataclass(frozen=True)
class Conversation:
    id: str
    """"chat-<hash of the messages>": stable, so a rerun resumes and splits the same way."""
    messages: tuple
    """({"role": ..., "content": ...}, ...): system?, user, assistant, user, ..."""
    split: str
    kind: str
    """code when any turn looks like code (fenced block or a definition), else general."""

    @property
    def user_turns(self) -> int:
        return sum(m["role"] == "user" for m in self.messages)


@dataclass
class ChatData:
    conversations: list[Conversation]
    rows: int
    bad: Counter = field(default_factory=Counter)

    def summary(self) -> dict:
        splits = Counter(c.split for c in self.conversations)
        return {"rows": self.rows, "conversations": len(self.conversations),
                "bad": {r: self.bad[r] for r in REASONS if self.bad[r]},
                "splits": dict(sorted(splits.items())),
                "kinds": dict(Counter(c.kind for c in self.conversations)),
                "user_turns": dict(sorted(Counter(c.user_turns for c in self.conversations).items()))}


def _text(content) -> str | None:
    """A turn's text; OpenAI content parts [{"type": "text", "text": ...}] are joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    return None


def normalize(row: dict) -> list[dict] | str:
    """[{"role", "content"}, ...] in the template's roles, or the reason the row is refused."""
    key = next((k for k in SHAPES if row.get(k) is not None), None)
    if key is None and isinstance(row.get("prompt"), str):  # a prompt file: one user turn
        return [{"role": "user", "content": row["prompt"]}] if row["prompt"].strip() else "empty_content"
    if key is None:
        return "no_conversation"
    turns, (rk, ck) = row[key], SHAPES[key]
    if not isinstance(turns, list) or not turns:
        return "wrong_type"
    msgs = []
    system = row.get("system")
    if isinstance(system, str) and system.strip() and key == "conversations":
        msgs.append({"role": "system", "content": system})
    for t in turns:
        if not isinstance(t, dict) or not isinstance(t.get(rk), str):
            return "wrong_type"
        text = _text(t.get(ck))
        if text is None:
            return "wrong_type"
        role = ROLES.get(t[rk].strip().lower())
        if role is None:
            return "unknown_role"
        if not text.strip():
            return "empty_content"
        msgs.append({"role": role, "content": text})
    if any(m["role"] == "system" for m in msgs[1:]):
        return "misplaced_system"
    body = msgs[1:] if msgs[0]["role"] == "system" else msgs
    if not any(m["role"] == "user" for m in body):
        return "no_user_turn"
    if any(m["role"] != ("user", "assistant")[i % 2] for i, m in enumerate(body)):
        return "not_alternating"
    return msgs


def conversation_id(msgs: list[dict]) -> str:
    return "chat-" + hashlib.sha1(json.dumps(msgs, sort_keys=True).encode()).hexdigest()[:12]


def split_of(conv_id: str, val_percent: float, heldout_percent: float) -> str:
    b = hash_bucket(conv_id)
    if b < val_percent * 100:
        return "val"
    return "heldout" if b < (val_percent + heldout_percent) * 100 else "train"


def kind_of(msgs: list[dict]) -> str:
    return "code" if any(mark in m["content"] for m in msgs for mark in CODE_MARKS) else "general"


def load_rows(path: str | Path):
    """The rows of a local file or saved dataset directory, through `datasets`."""
    import datasets

    path = Path(path)
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        parts = list(ds.values()) if isinstance(ds, datasets.DatasetDict) else [ds]
        return [row for part in parts for row in part]
    suffix = path.suffix.lower()
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(suffix)
    if builder is None or not path.is_file():
        raise ValueError(f"{path}: not a .jsonl, .json or .parquet file nor a saved dataset "
                         "directory")
    return datasets.load_dataset(builder, data_files=str(path), split="train")


def load_chats(paths: list[str] | str, val_percent: float = 5.0, heldout_percent: float = 5.0,
               max_conversations: int | None = None) -> ChatData:
    """Every valid conversation of the files, in order, with its split; the rest counted."""
    out = ChatData([], 0)
    seen: set[str] = set()
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        try:
            rows = load_rows(path)
        except (OSError, ValueError) as e:  # datasets raises these on unreadable input
            raise ValueError(f"{path}: cannot read chat data ({str(e).splitlines()[0]})") from None
        for row in rows:
            if max_conversations is not None and len(out.conversations) >= max_conversations:
                return out
            out.rows += 1
            msgs = normalize(row) if isinstance(row, dict) else "wrong_type"
            if isinstance(msgs, str):
                out.bad[msgs] += 1
                continue
            cid = conversation_id(msgs)
            if cid in seen:
                out.bad["duplicate"] += 1
                continue
            seen.add(cid)
            out.conversations.append(Conversation(cid, tuple(msgs), split_of(
                cid, val_percent, heldout_percent), kind_of(msgs)))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.corpus.chat_data",
                                description=__doc__.split("\n")[0])
    p.add_argument("--data", nargs="+", required=True, help="JSONL / parquet / saved dataset dir")
    add_option(p, "val_percent")
    p.add_argument("--heldout-percent", type=float, default=5.0)
    a = p.parse_args(argv)
    try:
        data = load_chats(a.data, a.val_percent, a.heldout_percent)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(data.summary()))
    if not data.conversations:
        print(f"error: no valid conversation in {', '.join(a.data)}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
