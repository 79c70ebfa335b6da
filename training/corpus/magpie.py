"""Diverse prompts without a hub (Magpie, arXiv 2406.08464): the target writes user turns.

    python -m training.corpus.magpie --config configs/magpie.yaml [--n 4000] [--max-minutes M]

The instruct target reads only its chat template's user prefix (training.corpus.chat_template.
user_prefix, e.g. "<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n" for SmolLM2) and
continues it: what it writes up to its end-of-turn token is a user request drawn from what it
was tuned on. Generation reuses training.corpus.teacher (sharded, resumable: `raw` is a corpus
directory, row i has its own seed), so a rerun with a larger --n grows it. `engine: batch` writes
the turns with our batched engine (the target alone, in the device's defaults dtype: the GGUF
target's own kernels on a CPU, 8.3x transformers' generate in bf16 on an AVX2-only Zen 3), `hf` with
transformers' generate in `dtype`; a raw directory keeps the engine it started with, so a new
engine writes a new one and lists the earlier ones in `read_also`. Then the turns are
cleaned: unfinished (no end-of-turn within max_new_tokens), too short or long (words),
repetitive (share of repeated word 3-grams), exact duplicates (case and spacing folded) and
near-duplicates (training.corpus.diversity: char 5-gram Jaccard >= near_dup) are dropped, each
counted by reason. The rest are written as a prompt file ({id, source: magpie, kind, prompt};
id by the text's hash, kind code by keywords) that the corpus reads beside the templates
(configs/corpus.yaml prompt_files), held-out prompts (by hash) to <out stem>_heldout.jsonl, and
a diversity report of the kept prompts beside the template prompts to `report`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from training import shards
from training.config_flags import parse_config as parse_config_file
from training.corpus.chat_data import split_of
from training.corpus.chat_template import encode, user_prefix
from training.corpus.scale import SAMPLER, ScaleConfig, engine_generate
from training.corpus.teacher import (CorpusConfig, Prompt, Teacher, build_corpus, generate_rows, load_corpus,
                                     load_teacher, read_manifest)
from training.corpus.diversity import near_duplicates, normalized, report, words, write_report

CODE_WORDS = re.compile(r"\b(code|coding|function|python|javascript|java|c\+\+|sql|script|"
                        r"program|algorithm|regex|bug|compile|api|class|html|css)\b", re.I)
ENGINES = ("batch", "hf")
REASONS = ("unfinished", "too_short", "too_long", "repetitive", "duplicate", "near_duplicate")


@dataclass
class MagpieConfig:
    raw: str = "data/magpie-raw"
    """Corpus directory of the raw generated user turns (resumable)."""
    read_also: list[str] = field(default_factory=list)
    """Earlier raw directories (written by another engine or dtype): their turns are cleaned with
    `raw`'s, and `raw` numbers its turns (and seeds) after theirs."""
    out: str = "data/prompts/magpie.jsonl"
    """The cleaned prompt file."""
    target: str | None = None
    engine: str = "batch"
    """batch: decoding's BatchEngine, the target alone; hf: transformers' generate."""
    dtype: str | None = None
    """The target's dtype; None = the device's defaults entry (batch) or bfloat16 (hf)."""
    n: int = 4000
    """Generated user turns (before cleaning), all raw directories together."""
    system: str | None = None
    """A system prompt in the prefix; None = the template's own default (if any)."""
    batch_size: int = 32
    shard_size: int = 256
    max_new_tokens: int = 96
    temperature: float = 1.0
    """Magpie samples at 1.0: diversity is the point."""
    seed: int = 0
    min_words: int = 4
    max_words: int = 120
    max_repeat: float = 0.3
    """Refuse a turn whose repeated word 3-grams exceed this share of its 3-grams."""
    near_dup: float = 0.7
    """Char 5-gram Jaccard at or above which a later turn is a near-duplicate."""
    heldout_percent: float = 5.0
    report: str | None = "reports/diversity"
    """Directory of the diversity report (kept prompts beside `compare`); None = none."""
    compare: str | None = "data/prompts/train.jsonl"
    """The template prompt file the report compares with; None = the kept prompts alone."""
    max_minutes: float | None = None
    threads: int | None = None


def magpie_teacher(teacher: Teacher, prefix: str) -> Teacher:
    """The teacher reading the user prefix whatever the prompt; the prefix joins the corpus
    identity (so a raw corpus never mixes prefixes, and never passes as a target corpus)."""
    ids = encode(teacher.tokenizer, prefix)
    info = teacher.info | {"magpie_prefix_sha256": hashlib.sha256(prefix.encode()).hexdigest()}
    return replace(teacher, encode=lambda _text: list(ids), info=info)


def synthesise(cfg: MagpieConfig, teacher: Teacher, progress: bool = True, engine=None) -> dict:
    """Raw user turns up to cfg.n; `engine`: a BatchEngine on teacher.model writes them (else
    transformers' generate)."""
    prefix = user_prefix(teacher.tokenizer, cfg.system)
    start = sum(earlier_rows(d) for d in cfg.read_also)
    prompts = [Prompt(f"magpie-{i:06d}", "general", "raw", "") for i in range(start, cfg.n)]
    corpus_cfg = CorpusConfig(out=cfg.raw, target=cfg.target, dtype=cfg.dtype or "bfloat16",
                              batch_size=cfg.batch_size, shard_size=cfg.shard_size,
                              max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              seed=cfg.seed, max_minutes=cfg.max_minutes,
                              sampler="per-prompt-inverse-cdf-v2")
    generate = generate_rows
    if engine is not None:
        dtype = str(next(teacher.model.parameters()).dtype).removeprefix("torch.")
        corpus_cfg = replace(corpus_cfg, dtype=dtype, sampler=SAMPLER)
        generate = batch_generate(engine, cfg)
    return build_corpus(corpus_cfg, magpie_teacher(teacher, prefix), prompts, progress, generate)


def earlier_rows(path: str) -> int:
    manifest = read_manifest(Path(path))
    if manifest is None:
        raise ValueError(f"read_also: {path} holds no raw Magpie turns")
    return sum(s["rows"] for s in manifest["shards"])


def batch_generate(engine, cfg: MagpieConfig):
    """generate_rows' signature on a BatchEngine: up to batch_size turns at once, each from its
    own generator seeded by its row (training.corpus.scale.engine_generate)."""
    gen = engine_generate(engine, ScaleConfig(batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens,
                                              temperature=cfg.temperature, top_p=1.0))

    def generate(teacher: Teacher, encoded, seeds, _cfg, clock, bar=None):
        out = gen(teacher, encoded, seeds, None, clock)
        if bar is not None:
            bar.set_postfix(tok_s=f"{clock.tokens / max(clock.seconds, 1e-9):.0f}", tokens=clock.tokens,
                            refresh=False)
            bar.update(len(encoded))
        return out

    return generate


def repeat_share(text: str, n: int = 3) -> float:
    w = words(text)
    grams = [tuple(w[i: i + n]) for i in range(len(w) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def clean(texts: list[tuple[str, bool]], cfg: MagpieConfig) -> tuple[list[str], Counter]:
    """(kept texts in order, refusals by reason) of (text, finished) pairs."""
    bad: Counter = Counter()
    seen: set[str] = set()
    fit = []
    for text, finished in texts:
        text = text.strip()
        n = len(text.split())
        reason = ("unfinished" if not finished else "too_short" if n < cfg.min_words else
                  "too_long" if n > cfg.max_words else
                  "repetitive" if repeat_share(text) > cfg.max_repeat else
                  "duplicate" if normalized(text) in seen else None)
        if reason:
            bad[reason] += 1
            continue
        seen.add(normalized(text))
        fit.append(text)
    flags = near_duplicates(fit, cfg.near_dup)
    bad["near_duplicate"] += sum(flags)
    return [t for t, f in zip(fit, flags) if not f], bad


def prompt_rows(texts: list[str]) -> list[dict]:
    return [{"id": "m-" + hashlib.sha1(normalized(t).encode()).hexdigest()[:12], "source": "magpie",
             "kind": "code" if CODE_WORDS.search(t) else "general", "prompt": t} for t in texts]


def extract(cfg: MagpieConfig, tokenizer) -> dict:
    rows = sorted((r for d in [*cfg.read_also, cfg.raw] for r in load_corpus(d).to_list()),
                  key=lambda r: r["prompt_id"])
    texts = [(tokenizer.decode(r["completion_ids"], skip_special_tokens=True), r["finished"])
             for r in rows]
    kept, bad = clean(texts, cfg)
    out = prompt_rows(kept)
    held = [r for r in out if split_of(r["id"], 0.0, cfg.heldout_percent) == "heldout"]
    train = [r for r in out if r not in held]
    path = Path(cfg.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    for p, part in ((path, train), (path.with_name(f"{path.stem}_heldout.jsonl"), held)):
        shards.atomic_write(p, lambda f, part=part: f.write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part), encoding="utf-8"))
    stats = {"generated": len(rows), "kept": len(train), "heldout": len(held),
             "refused": {r: bad[r] for r in REASONS if bad[r]},
             "kinds": dict(Counter(r["kind"] for r in out))}
    if cfg.report:
        sources = {"magpie": [r["prompt"] for r in out]}
        if cfg.compare:
            from training.corpus.diversity import read_texts

            sources = {"templates": read_texts(cfg.compare)} | sources
        rep = report(sources) | {"magpie": stats}
        write_report(rep, Path(cfg.report))
    return stats


def main(argv: list[str] | None = None) -> None:
    import torch

    cfg = parse_config_file(MagpieConfig, argv, "python -m training.corpus.magpie",
                            __doc__.split("\n")[0])
    if min(cfg.n, cfg.batch_size, cfg.shard_size, cfg.max_new_tokens, cfg.min_words) < 1:
        raise SystemExit("error: n, batch-size, shard-size, max-new-tokens, min-words must be >= 1")
    if cfg.engine not in ENGINES:
        raise SystemExit(f"error: engine must be one of {', '.join(ENGINES)} (got {cfg.engine!r})")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        for d in cfg.read_also:  # a missing earlier directory fails before the model loads
            earlier_rows(d)
        if cfg.engine == "batch":
            from training.corpus.__main__ import load

            teacher, engine, _ = load(ScaleConfig(target=cfg.target, engine="plain", dtype=cfg.dtype,
                                                  batch_size=cfg.batch_size))
        else:
            teacher, engine = load_teacher(CorpusConfig(target=cfg.target, dtype=cfg.dtype or "bfloat16")), None
        gen = synthesise(cfg, teacher, engine=engine)
        print(f"magpie: generated {json.dumps(gen)}", file=sys.stderr)
        stats = extract(cfg, teacher.tokenizer)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit("interrupted: finished shards are kept; rerun to resume") from None
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
