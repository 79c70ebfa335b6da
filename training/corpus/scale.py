"""A target-written corpus at scale: our batched engine answers diverse prompts into token shards.

    python -m training.corpus --config configs/corpus_scale.yaml [--max-minutes 50] [--max-tokens N]

Prompts come from any mix of prompt files ({"prompt": ...} rows: the templates, Magpie's
data/prompts/magpie*.jsonl) and users' chat data (ShareGPT / OpenAI rows, multi-turn), read by
training.corpus.chat_data. Each prompt's id is a hash of its normalized system and user turns,
so one prompt met in two sources, or twice, is written once. The target answers every user turn
given the conversation so far, its own earlier answers included (training.corpus.chat.regenerate),
through decoding.batch.scheduler.BatchEngine: plain batched decoding, or speculative rounds with
a draft (lossless: greedy text is the target's own, sampled text its distribution). Each turn
samples from a generator seeded by (seed, its id), so its text does not depend on its batch.

Rows go to token shards (training.corpus.tokens) of about `shard_tokens` tokens: a shard is
written to a temp file and renamed, then listed in the manifest, so a killed run loses at most
the shard it was filling. A rerun (here, or on another machine after `git pull`) skips the
prompts the listed shards hold and removes half-written leftovers; a corpus written for another
target or with other generation settings is refused.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from training import shards
from training.corpus import tokens
from training.corpus.chat import ChatCorpusConfig, _head, regenerate
from training.corpus.chat_data import Conversation, load_chats, split_of
from training.corpus.chat_template import prompt_ids
from training.corpus.diversity import normalized
from training.corpus.teacher import GenClock, Teacher, _chunks

ENGINES = ("plain", "speculative")


SAMPLER = "batch-engine-per-turn-generator-v1"
"""How a BatchEngine samples: each request from its own generator seeded by its id."""


@dataclass
class ScaleConfig:
    data: list[str] = field(default_factory=lambda: ["data/prompts/magpie.jsonl"])
    """Prompt files and chat data: JSONL / JSON / parquet or Dataset.save_to_disk directories."""
    out: str = "data/corpus-scale"
    """Token corpus directory (training.corpus.tokens)."""
    target: str | None = None
    """Target model directory; None = the embedded SmolLM2-135M-Instruct."""
    draft: str | None = None
    """Draft for speculative rounds; None = the shipped head (when the target is the embedded one)."""
    engine: str = "speculative"
    """speculative (the draft proposes, the target verifies: same text, faster) | plain."""
    budget: str = "joint"
    """Speculative tree sizing across requests (decoding.serve.worker.batch_engine): joint |
    joint-always | own."""
    dtype: str | None = None
    """Weights dtype; None = this device's defaults entry (decoding/defaults.yaml)."""
    forward: str | None = None
    """eager | packed | lean; None = decoding.forward.packed.default_forward."""
    batch_size: int = 8
    """Requests decoding at once (4-8 is where the engine writes fastest on 2 cores)."""
    chunk: int = 64
    """Conversations generated together (turn k of all of them, then turn k + 1)."""
    shard_tokens: int = 1_000_000
    """Tokens per shard (~2 MB at uint16): the most work a vanished machine loses."""
    max_new_tokens: int = 256
    """Cap of one turn (a capped turn stays in its conversation, cut)."""
    temperature: float = 0.7
    """0 = greedy."""
    top_p: float = 1.0
    seed: int = 0
    """Base seed; turn k of prompt p samples from a generator seeded by (seed, "p@k")."""
    max_turns: int = 8
    """Assistant turns per conversation at most."""
    max_context_tokens: int = 2048
    """A conversation stops before a turn whose prompt is longer than this."""
    val_percent: float = 5.0
    """Recorded split of each prompt (by its id's hash, as the trainers validate)."""
    heldout_percent: float = 5.0
    """Prompts never written (kept to measure a head on unseen prompts)."""
    samples: int = 1
    """Answers each prompt gets, each from its own generators (id "<prompt id>~k" for k >= 1, so
    answer k of a prompt is written once, whatever was written before): EAGLE-3's recipe
    regenerates responses, and a second sampled answer is new target-written text where new
    prompts run out. All prompts' first answers come before any second one. Not part of the
    corpus identity: raising it later adds answers to a corpus, it refuses nothing."""
    max_conversations: int | None = None
    """Read at most N conversations of the data (smoke runs)."""
    max_minutes: float | None = None
    """Stop at the first shard boundary past this many minutes."""
    max_tokens: int | None = None
    """Stop at the first shard boundary past this many new tokens (prompt + target-written)."""
    threads: int | None = None

    def chat(self) -> ChatCorpusConfig:
        """The settings training.corpus.chat.regenerate reads."""
        return ChatCorpusConfig(out=self.out, batch_size=self.batch_size, max_new_tokens=self.max_new_tokens,
                                temperature=self.temperature, seed=self.seed, max_turns=self.max_turns,
                                max_context_tokens=self.max_context_tokens)

    def identity(self) -> dict:
        """Generation settings a corpus keeps for life (the engine and dtype may change by shard)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": self.max_new_tokens,
                "seed": self.seed, "max_turns": self.max_turns, "max_context_tokens": self.max_context_tokens,
                "sampler": SAMPLER}


def prompt_key(messages) -> str:
    """A prompt's id: the hash of its normalized system and user turns (assistant turns are
    rewritten anyway), the same whichever file it came from."""
    turns = [[m["role"], normalized(m["content"])] for m in messages if m["role"] != "assistant"]
    return "p-" + hashlib.sha1(json.dumps(turns).encode()).hexdigest()[:16]


def load_prompts(cfg: ScaleConfig) -> tuple[list[Conversation], dict]:
    """Unique conversations of the data (held-out ones left out), ordered by id: the sources
    interleave, so a run stopped early still holds all of them; then their further answers
    (`samples`), in the same order; plus counts."""
    data = load_chats(cfg.data, 0.0, 0.0, cfg.max_conversations)  # rows by our own ids below
    out: dict[str, Conversation] = {}
    dup = 0
    for c in data.conversations:
        key = prompt_key(c.messages)
        if key in out:
            dup += 1
            continue
        out[key] = replace(c, id=key, split=split_of(key, cfg.val_percent, cfg.heldout_percent))
    if cfg.samples < 1:
        raise ValueError(f"samples must be >= 1 (got {cfg.samples})")
    kept = [c for k, c in sorted(out.items()) if c.split != "heldout"]
    prompts = len(kept)
    kept += [replace(c, id=f"{c.id}~{k}") for k in range(1, cfg.samples) for c in kept[:prompts]]
    return kept, {"conversations": len(kept), "prompts": prompts, "duplicates": dup,
                  "heldout": len(out) - prompts, "bad_rows": dict(data.bad)}


def engine_generate(engine, cfg: ScaleConfig, on_tokens: Callable[[int], None] | None = None):
    """training.corpus.teacher.generate_rows' signature, decoding with a BatchEngine: up to
    cfg.batch_size requests at once, a new one joining as soon as one ends."""
    from decoding.options import SamplingConfig

    sampling = SamplingConfig(cfg.temperature, cfg.top_p)

    def generate(teacher: Teacher, encoded, seeds, _gen, clock: GenClock, bar=None):
        order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))  # similar lengths
        results: list = [None] * len(encoded)
        live: dict[int, int] = {}
        t0 = time.time()
        while order or engine.active:
            while order and len(engine.active) < cfg.batch_size:
                i = order.pop(0)
                req = engine.add(encoded[i], cfg.max_new_tokens, sampling, seeds[i], teacher.eos_token_ids)
                live[req.id] = i
            for r in engine.step():
                results[live.pop(r.id)] = (list(r.out), bool(r.out) and r.out[-1] in teacher.eos_token_ids)
                clock.tokens += len(r.out)
                if on_tokens:
                    on_tokens(len(r.out))
            if engine.failed:
                raise RuntimeError(f"generation failed: {engine.failed[0].error!r}")
        clock.seconds += time.time() - t0
        return results

    return generate


def _first(conv: Conversation) -> list[dict]:
    """What the target reads before its first turn (the system turn, if any, and the first user turn)."""
    system, users = _head(conv)
    return system + users[:1]


def rows_of(conv: Conversation, turns: list[tuple]) -> list[tokens.TokenRow]:
    """A conversation's turns (row id, prompt ids, completion ids, finished) as stored rows: one
    sequence while each turn's prompt starts with the ids before it (the earlier turns exactly as
    the target wrote them); where re-rendering the history changes them, a new row begins."""
    rows: list[tokens.TokenRow] = []
    for k, (_, prompt, comp, fin) in enumerate(turns):
        cur = rows[-1] if rows else None
        if cur is not None and prompt[: len(cur.ids)] == cur.ids:
            cur.spans.append((len(prompt), len(prompt) + len(comp), fin))
            cur.ids = prompt + comp
        else:
            rows.append(tokens.TokenRow(conv.id, k, conv.kind, conv.split, prompt + comp,
                                        [(len(prompt), len(prompt) + len(comp), fin)]))
    return rows


def build(cfg: ScaleConfig, teacher: Teacher, engine, convs: list[Conversation], engine_name: str = "plain",
          progress: bool = True) -> dict:
    """Write the conversations not yet in cfg.out; counts for this run and the corpus."""
    from tqdm import tqdm

    dtype = tokens.token_dtype(int(teacher.info["vocab_size"]))
    identity = {"target": dict(teacher.info), "generation": cfg.identity(), "token_dtype": dtype}
    t0, clock = time.time(), GenClock()
    added = {"rows": 0, "conversations": 0, "positions": 0, "target_tokens": 0, "bytes": 0, "shards": 0}
    with shards.ShardWriter(cfg.out, tokens.KIND, tokens.SCHEMA_VERSION, identity, tokens.SUFFIX) as w:
        if not (w.folder / ".gitignore").exists():  # what a run leaves beside the shards stays local
            shards.write_text(w.folder / ".gitignore", ".lock\n.*.tmp-*\n")
        done = tokens.done_prompts(cfg.out, w.manifest)
        todo = [c for c in convs if c.id not in done]
        fits = [len(prompt_ids(teacher.tokenizer, _first(c))) <= cfg.max_context_tokens for c in todo]
        too_long, todo = fits.count(False), [c for c, ok in zip(todo, fits) if ok]
        bar = tqdm(total=cfg.max_tokens, unit="tok", unit_scale=True, disable=not progress,
                   dynamic_ncols=True, mininterval=1 if sys.stderr.isatty() else 30)

        def tick(n: int) -> None:
            bar.set_postfix(tok_s=f"{clock.tokens / max(time.time() - t0, 1e-9):.0f}", refresh=False)
            bar.update(n)

        generate = engine_generate(engine, cfg, tick)
        buf: list[tokens.TokenRow] = []

        def flush() -> None:
            if not buf:
                return
            n, tgt = sum(len(r.ids) for r in buf), sum(b - a for r in buf for a, b, _ in r.spans)
            w.add(lambda p: tokens.write_shard(p, buf, dtype), sized=True, rows=len(buf),
                  turns=sum(len(r.spans) for r in buf), prompts=len({r.id for r in buf}),
                  tokens=n, target_tokens=tgt, engine=engine_name)
            size = w.manifest["shards"][-1]["bytes"]
            for k, v in (("rows", len(buf)), ("positions", n), ("target_tokens", tgt), ("bytes", size),
                         ("shards", 1), ("conversations", len({r.id for r in buf}))):
                added[k] += v
            buf.clear()

        def over() -> bool:
            new = added["positions"] + sum(len(r.ids) for r in buf)
            return (cfg.max_minutes is not None and time.time() - t0 > 60 * cfg.max_minutes) or \
                (cfg.max_tokens is not None and new >= cfg.max_tokens)

        left = 0
        for i, chunk in enumerate(_chunks(todo, cfg.chunk)):
            out = regenerate(teacher, chunk, cfg.chat(), clock, None, generate)
            buf += [r for c in chunk for r in rows_of(c, out[c.id])]
            if sum(len(r.ids) for r in buf) >= cfg.shard_tokens:
                flush()
            if over():
                left = len(todo) - (i + 1) * cfg.chunk
                break
        flush()
        bar.close()
        total = {k: sum(s.get(k, 0) for s in w.manifest["shards"])
                 for k in ("rows", "tokens", "target_tokens", "bytes")}
    return {"added": added, **clock.stats(), "remaining": max(left, 0), "too_long": too_long, "corpus": total,
            "shards": len(w.manifest["shards"]), "token_dtype": dtype}
