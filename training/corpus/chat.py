"""A teacher corpus from users' chat data: every assistant turn rewritten by the target.

    python -m training.corpus.chat --data chats.jsonl --out data/corpus-chat
    python -m training.corpus.chat --config configs/chat_corpus.yaml [--max-minutes M]

Conversations come from training.corpus.chat_data (ShareGPT or OpenAI shape; bad rows counted
and printed). mode regenerate: the target answers every user turn given the conversation so
far, its own earlier answers included (as a chat client would send them: text rendered with
the target's chat template, temperature from the config). mode keep: the data's own
assistant turns are kept (cheap; labels still come from the target when the feature cache
scores every position). Either way a conversation gives one corpus row per assistant turn
(as `speculators` does): prompt_ids = everything before the turn, completion_ids = the turn
up to its end-of-turn token, so the loss covers assistant tokens only and the rows feed the
feature cache and trainers unchanged. Row ids are "<conversation id>@<turn>"; all turns of a
conversation share its split (training.draft.data.hash_bucket). Held-out conversations are
never written.

Same layout, sharding and resume as training.corpus.teacher (a shard holds whole
conversations; a rerun skips those listed). A conversation stops at max_turns assistant
turns or when the prompt of its next turn passes max_context_tokens; one whose first prompt
is already longer is skipped and counted (too_long).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from training import shards
from training.config_flags import parse_config as parse_config_file
from training.corpus.chat_data import Conversation, load_chats
from training.corpus.chat_template import assistant_mask, mask_runs, prompt_ids
from training.corpus.teacher import (ARROW_SCHEMA, CORPUS_KIND, SAMPLERS, SCHEMA_VERSION, TURN_SEP, CorpusConfig,
                     GenClock, Teacher, _chunks, generate_rows, load_teacher, prompt_seed)

MODES = ("regenerate", "keep")


@dataclass
class ChatCorpusConfig:
    data: list[str] = field(default_factory=list)
    """Chat files: JSONL / JSON / parquet, or directories written by Dataset.save_to_disk."""
    out: str = "data/corpus-chat"
    """Corpus directory (the layout of training.corpus.teacher)."""
    mode: str = "regenerate"
    """regenerate (the target writes every assistant turn) | keep (the data's own turns)."""
    target: str | None = None
    """Target model directory; None = the embedded SmolLM2-135M-Instruct."""
    dtype: str = "bfloat16"
    batch_size: int = 32
    """Prompts per generate() call (turn k of the conversations in a shard together)."""
    shard_size: int = 64
    """Conversations per shard: the most work an interruption can lose."""
    max_new_tokens: int = 256
    """Cap of one regenerated turn (a capped turn stays in the conversation, cut)."""
    temperature: float = 0.7
    seed: int = 0
    sampler: str = SAMPLERS[1]
    max_turns: int = 8
    """Assistant turns per conversation at most."""
    max_context_tokens: int = 2048
    """A conversation stops before a turn whose prompt is longer than this."""
    val_percent: float = 5.0
    """Validation conversations (use the same data.val_percent when training)."""
    heldout_percent: float = 5.0
    """Held-out conversations: never written to the corpus."""
    max_conversations: int | None = None
    max_minutes: float | None = None
    threads: int | None = None

    def generation(self) -> CorpusConfig:
        return CorpusConfig(out=self.out, target=self.target, dtype=self.dtype,
                            batch_size=self.batch_size, max_new_tokens=self.max_new_tokens,
                            temperature=self.temperature, seed=self.seed, sampler=self.sampler)

    def identity(self) -> dict:
        chat = {"mode": self.mode, "max_turns": self.max_turns,
                "max_context_tokens": self.max_context_tokens}
        if self.mode == "keep":
            return {"chat": chat}
        return {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens,
                "dtype": self.dtype, "seed": self.seed, "sampler": self.sampler, "chat": chat}


def _head(conv: Conversation) -> tuple[list[dict], list[dict]]:
    """(system turn or nothing, the user turns in order)."""
    msgs = list(conv.messages)
    system = msgs[:1] if msgs[0]["role"] == "system" else []
    return system, [m for m in msgs if m["role"] == "user"]


def keep_rows(tok, conv: Conversation, cfg: ChatCorpusConfig) -> list[tuple]:
    """(row id, prompt ids, completion ids) of the data's own assistant turns."""
    ids, mask = assistant_mask(tok, list(conv.messages))
    rows = []
    for k, (a, b) in enumerate(mask_runs(mask)[: cfg.max_turns]):
        if a > cfg.max_context_tokens:
            break
        rows.append((f"{conv.id}{TURN_SEP}{k}", ids[:a], ids[a:b]))
    return rows


def regenerate(teacher: Teacher, convs: list[Conversation], cfg: ChatCorpusConfig,
               clock: GenClock, bar=None, generate=generate_rows) -> dict[str, list[tuple]]:
    """Conversation id -> (row id, prompt ids, completion ids, finished) of every turn the
    target wrote, turn k of all conversations batched together. `generate`: generate_rows'
    signature (training.corpus.scale passes the batched engine's)."""
    tok, gen = teacher.tokenizer, cfg.generation()
    history = {c.id: _head(c)[0] for c in convs}
    users = {c.id: _head(c)[1] for c in convs}
    out: dict[str, list[tuple]] = {c.id: [] for c in convs}
    live = [c.id for c in convs]
    for k in range(cfg.max_turns):
        todo = []
        for cid in live:
            if k < len(users[cid]):
                ids = prompt_ids(tok, history[cid] + [users[cid][k]])
                if len(ids) <= cfg.max_context_tokens:
                    todo.append((cid, ids))
        if not todo:
            break
        rids = [f"{cid}{TURN_SEP}{k}" for cid, _ in todo]
        res = generate(teacher, [ids for _, ids in todo],
                            [prompt_seed(cfg.seed, r) for r in rids], gen, clock, bar)
        for (cid, ids), rid, (comp, fin) in zip(todo, rids, res):
            reply = tok.decode(comp[:-1] if fin else comp, skip_special_tokens=True)
            history[cid] = history[cid] + [users[cid][k], {"role": "assistant", "content": reply}]
            out[cid].append((rid, ids, comp, fin))
        live = [cid for cid, _ in todo]
    return out


def build_chat_corpus(cfg: ChatCorpusConfig, teacher: Teacher, convs: list[Conversation],
                      progress: bool = True) -> dict:
    """Write the conversations not yet in cfg.out (train and val only); counts for this run."""
    import time

    from tqdm import tqdm

    if cfg.mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)} (got {cfg.mode!r})")
    tok = teacher.tokenizer
    convs = [c for c in convs if c.split != "heldout"]
    first = {c.id: prompt_ids(tok, list(_head(c)[0]) + _head(c)[1][:1]) for c in convs}
    too_long = sum(len(first[c.id]) > cfg.max_context_tokens for c in convs)
    convs = [c for c in convs if len(first[c.id]) <= cfg.max_context_tokens]
    identity = {"target": dict(teacher.info), "generation": cfg.identity()}
    with shards.ShardWriter(cfg.out, CORPUS_KIND, SCHEMA_VERSION, identity) as writer:
        done = writer.done()
        todo = [c for c in convs if f"{c.id}{TURN_SEP}0" not in done]
        t0, clock, new_rows, new_convs = time.time(), GenClock(), 0, 0
        # counted in replies, not conversations: a shard of long conversations takes many minutes
        turns = sum(min(len(_head(c)[1]), cfg.max_turns) for c in todo) if cfg.mode != "keep" else len(todo)
        bar = tqdm(total=turns, unit="reply" if cfg.mode != "keep" else "conv", disable=not progress,
                   dynamic_ncols=True, mininterval=1 if sys.stderr.isatty() else 30)
        for chunk in _chunks(todo, cfg.shard_size):
            if cfg.max_minutes is not None and time.time() - t0 > 60 * cfg.max_minutes:
                break
            if cfg.mode == "keep":
                eos = set(teacher.eos_token_ids)
                rows = {c.id: [(r, p, q, bool(q) and q[-1] in eos) for r, p, q in keep_rows(tok, c, cfg)]
                        for c in chunk}
            else:
                rows = regenerate(teacher, chunk, cfg, clock, bar)
            flat = [(c, *r) for c in chunk for r in rows[c.id]]
            table = pa.table({
                "prompt_id": [f[1] for f in flat], "kind": [f[0].kind for f in flat],
                "split": [f[0].split for f in flat],
                "seed": [prompt_seed(cfg.seed, f[1]) for f in flat],
                "prompt_ids": [f[2] for f in flat], "completion_ids": [f[3] for f in flat],
                "finished": [f[4] for f in flat]}, schema=ARROW_SCHEMA)
            writer.write(table, [f[1] for f in flat], conversations=len(chunk),
                         completion_tokens=sum(len(f[3]) for f in flat))
            new_rows, new_convs = new_rows + len(flat), new_convs + len(chunk)
            if cfg.mode == "keep":
                bar.update(len(chunk))
        bar.close()
        total = sum(s["rows"] for s in writer.manifest["shards"])
    return {"new_conversations": new_convs, "new_rows": new_rows, **clock.stats(),
            "total_rows": total, "too_long": too_long, "remaining": len(todo) - new_convs}


def parse_config(argv: list[str] | None = None) -> ChatCorpusConfig:
    cfg = parse_config_file(ChatCorpusConfig, argv, "python -m training.corpus.chat",
                            __doc__.split("\n")[0])
    if min(cfg.batch_size, cfg.shard_size, cfg.max_new_tokens, cfg.max_turns) < 1:
        raise SystemExit("error: batch-size, shard-size, max-new-tokens and max-turns must be >= 1")
    if not cfg.data:
        raise SystemExit("error: no chat data given (--data FILE ...)")
    if cfg.mode not in MODES:
        raise SystemExit(f"error: mode must be one of {', '.join(MODES)} (got {cfg.mode!r})")
    return cfg


def main(argv: list[str] | None = None) -> None:
    import torch

    cfg = parse_config(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        data = load_chats(cfg.data, cfg.val_percent, cfg.heldout_percent, cfg.max_conversations)
        print(f"chat data: {json.dumps(data.summary())}", file=sys.stderr)
        if not data.conversations:
            raise ValueError(f"no valid conversation in {', '.join(cfg.data)}")
        shards.read_manifest(cfg.out, CORPUS_KIND, SCHEMA_VERSION)  # a bad corpus fails first
        teacher = load_teacher(CorpusConfig(target=cfg.target, dtype=cfg.dtype))
        print(f"chat corpus -> {cfg.out} ({json.dumps(asdict(cfg))})", file=sys.stderr)
        stats = build_chat_corpus(cfg, teacher, data.conversations)
    except ValueError as e:  # includes decoding.models.ModelError
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit("interrupted: finished shards are kept; rerun to resume") from None
    print(json.dumps(stats | {"bad_rows": dict(data.bad)}))


if __name__ == "__main__":
    main()
