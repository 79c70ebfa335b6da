"""Teacher corpus for draft alignment: the target continues prompts; token ids go to parquet.

    python -m training.corpus.teacher --config configs/corpus.yaml [--max-prompts N] [--out DIR] ...
    python -m training.corpus.teacher --config configs/corpus_onpolicy.yaml --writer DRAFT_DIR

With `--writer DRAFT_DIR` the draft writes the continuations instead (on-policy data,
DistillSpec): the target still scores every token later (training.draft.teacher_cache, a prefill,
~3-4x cheaper per token here than the target generating), so the draft learns the target's
distribution on the text it will itself propose. Such a corpus is marked on-policy (it never
mixes with target-written rows); each shard records the draft that wrote it, so the corpus
can keep growing as better drafts take over (rounds of on-policy distillation).

Layout of the corpus directory (small enough to commit: token ids only, zstd parquet):
    manifest.json        schema version, target fingerprint, generation settings, shard list
    shard-00000.parquet  one row per prompt: prompt_id, kind, split, seed, prompt_ids,
    ...                  completion_ids (int32 lists), finished (ended with EOS)

Resumable: a shard is written to a temp file and renamed, then the manifest is rewritten the
same way, so a shard is either complete and listed or ignored. A restart skips the prompt ids
already listed and removes leftovers (temp files, unlisted shards) of an interrupted run.
Each prompt samples with its own seeded generator, so its continuation does not depend on
which prompts share its batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from training import shards
from training.config_flags import parse_config as parse_config_file

SCHEMA_VERSION = 1
CORPUS_KIND = "specstop-teacher-corpus"
# How a row draws its token from its own generator (part of the corpus identity: a corpus is
# resumed with the sampler it started with). v1: torch.multinomial; v2: inverse CDF, one
# uniform per row and step (same distribution; multinomial costs ~1.5 ms per 49k-token row
# on this CPU, which would dominate a draft writing at batch 64).
SAMPLERS = ("per-prompt-generator-v1", "per-prompt-inverse-cdf-v2")
SAMPLE_SEP = "#"  # "<prompt id>#<k>": the k-th extra continuation of a prompt
TURN_SEP = "@"  # "<conversation id>@<k>": the k-th assistant turn of a conversation
ARROW_SCHEMA = pa.schema([
    ("prompt_id", pa.string()), ("kind", pa.string()), ("split", pa.string()),
    ("seed", pa.int64()), ("prompt_ids", pa.list_(pa.int32())),
    ("completion_ids", pa.list_(pa.int32())), ("finished", pa.bool_()),
])


@dataclass
class CorpusConfig:
    prompt_files: list[str] = field(default_factory=lambda: ["data/prompts/train.jsonl"])
    """JSONL prompt files ({id, source, kind, prompt}); a row's split is its file's stem."""
    out: str = "data/corpus"
    """Corpus directory: parquet shards + manifest.json."""
    target: str | None = None
    """Target model directory; None = the embedded SmolLM2-135M-Instruct."""
    dtype: str = "bfloat16"
    """Target weights dtype: float32 | bfloat16 | float16."""
    batch_size: int = 32
    """Prompts per generate() call (left padded)."""
    shard_size: int = 128
    """Prompts per shard: the most work an interruption can lose."""
    max_new_tokens: int = 128
    """Completion length cap."""
    temperature: float = 0.7
    """Sampling temperature over the full vocabulary; 0 = greedy."""
    seed: int = 0
    """Base seed; each prompt's generator is seeded from (seed, prompt id)."""
    max_prompts: int | None = None
    """Use only the first N prompts of the (concatenated) files; None = all."""
    samples: int = 1
    """Continuations per prompt. Sample 0 keeps the prompt id; sample k > 0 is stored as
    "<id>#<k>" with its own seed, so raising this grows the SAME corpus (same identity) with
    new text for prompts already done: the corpus keeps growing after the prompts run out."""
    max_minutes: float | None = None
    """Stop cleanly after the shard that crosses this wall-clock budget."""
    threads: int | None = None
    """torch intra-op threads; None = torch's default."""
    sampler: str = SAMPLERS[0]
    """per-prompt-generator-v1 (multinomial) | per-prompt-inverse-cdf-v2 (same distribution,
    cheaper: what a fast writer such as a draft needs). Fixed for the life of a corpus."""
    writer: str | None = None
    """None = the target writes; a draft directory = the draft writes (on-policy corpus). It
    must share the target's tokenizer; the target scores its text in the teacher cache."""
    chat: bool = True
    """Wrap each prompt in the tokenizer's chat template; false: the plain text (a base model
    such as gemma3-270m, whose tokenizer has no chat template)."""


@dataclass
class Teacher:
    """What generation needs from the target; tests inject a tiny model and a fake encoder."""

    model: torch.nn.Module
    encode: Callable[[str], list[int]]
    """Prompt text -> input ids, chat template and generation prompt applied."""
    eos_token_ids: list[int]
    pad_token_id: int
    info: dict
    """Identity written to the manifest; a resume must match it exactly."""
    tokenizer: object = None
    """The target's tokenizer (the chat tools render conversations with its template)."""


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str
    split: str
    text: str
    raw: bool = False
    """The text is already what the model reads (a logged completion, or a chat rendered with
    its template): fed as is, never wrapped in the chat template again."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_teacher(cfg: CorpusConfig) -> Teacher:
    from decoding.models import DEFAULT_TARGET_NAME, load_model, load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(cfg.target)
    model, tok = load_model(cfg.target, dtype=cfg.dtype), load_tokenizer(cfg.target)

    def encode(text: str) -> list[int]:  # (scoring alone, e.g. the teacher cache, never encodes)
        if not cfg.chat:
            return tok.encode(text)
        if not tok.chat_template:
            raise ValueError("the target's tokenizer has no chat template (a base model?): "
                             "build its corpus from plain text with --chat false")
        enc = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    eos = eos_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    name = DEFAULT_TARGET_NAME if cfg.target is None else model_dir.name
    return Teacher(model, encode, eos, pad, target_info(model, tok, name), tok)


def eos_ids(model, tok) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [tok.eos_token_id])


def target_info(model, tok, name: str) -> dict:
    """A corpus's target identity: the weights' (decoding.models.fingerprint: weight-defining
    config fields + a weight sample, so a newer transformers keeps it) plus the tokenizer and
    chat template."""
    from decoding.models import fingerprint

    return fingerprint(model, name) | {
        "vocab_size": len(tok), "chat_template_sha256": _sha256((tok.chat_template or "").encode())}


def with_writer(teacher: Teacher, cfg: CorpusConfig) -> Teacher:
    """The teacher with a draft generating in its place (cfg.writer), and the writer recorded."""
    if cfg.writer is None:
        return teacher
    from decoding.models import check_pair, fingerprint, load_model, load_tokenizer

    draft = load_model(cfg.writer, dtype=cfg.dtype)
    check_pair(teacher.model, draft, load_tokenizer(cfg.target), load_tokenizer(cfg.writer))
    info = teacher.info | {"writer": fingerprint(draft, Path(cfg.writer).name)}
    return replace(teacher, model=draft, info=info)


def target_fingerprint(target: str | None) -> dict:
    """The target's identity as build_corpus writes it into a corpus manifest."""
    # bf16, as the corpus is generated (configs/corpus.yaml): the embedding sample is hashed
    return load_teacher(CorpusConfig(target=target, dtype="bfloat16")).info


def read_prompts(paths: list[str], max_prompts: int | None = None) -> list[Prompt]:
    """All prompts of the files in order; bad input ends the run with one clear line."""
    out: list[Prompt] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise SystemExit(f"error: prompt file not found: {path}")
        n0 = len(out)
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(Prompt(str(row["id"]), row.get("kind", "general"), path.stem,
                                  row["prompt"]))
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"error: {path}:{i}: not a prompt row ({e!r})") from None
        if len(out) == n0:
            raise SystemExit(f"error: prompt file is empty: {path}")
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise SystemExit(f"error: duplicate prompt id {dup!r} across {', '.join(paths)}")
    return out[:max_prompts] if max_prompts is not None else out


def sampled(p: Prompt, k: int) -> Prompt:
    """The k-th continuation's row identity (k = 0: the prompt itself)."""
    return p if k == 0 else Prompt(f"{p.id}{SAMPLE_SEP}{k}", p.kind, p.split, p.text, p.raw)


def base_id(row_id: str) -> str:
    """The prompt (or conversation) a corpus row continues: splits are decided per prompt,
    never per sample or turn (a later turn's context holds the earlier ones)."""
    return row_id.split(SAMPLE_SEP, 1)[0].split(TURN_SEP, 1)[0]


def prompt_seed(seed: int, prompt_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()[:8]) >> 1


class RowSampler(LogitsProcessor):
    """Samples every row from its own generator (HF's sampler shares one stream per batch).

    It returns a one-hot score row, so generate(do_sample=False) commits exactly that sample.
    """

    def __init__(self, seeds: list[int], temperature: float, sampler: str = SAMPLERS[0]):
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; choose from {', '.join(SAMPLERS)}")
        self.gens = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.inverse_cdf = temperature, sampler == SAMPLERS[1]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.temperature <= 0:
            return scores
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        if self.inverse_cdf:
            cdf = probs.double().cumsum(-1)
            u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in self.gens])
            picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
            picks = picks.clamp(max=probs.shape[1] - 1)
        else:
            picks = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.gens)])
        onehot = torch.full_like(scores, float("-inf"))
        return onehot.scatter_(1, picks[:, None], 0.0)


@torch.inference_mode()
def generate_batch(teacher: Teacher, batch: list[list[int]], seeds: list[int],
                   cfg: CorpusConfig) -> list[tuple[list[int], bool]]:
    """Left-padded batched generation -> per row (completion ids up to and incl. EOS, finished)."""
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), teacher.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(batch):  # left padding: the last prompt token sits at the edge
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    out = teacher.model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=cfg.max_new_tokens,
        logits_processor=LogitsProcessorList([RowSampler(seeds, cfg.temperature, cfg.sampler)]),
        eos_token_id=teacher.eos_token_ids, pad_token_id=teacher.pad_token_id)
    results = []
    for row in out[:, width:].tolist():
        end = next((j for j, t in enumerate(row) if t in teacher.eos_token_ids), None)
        results.append((row if end is None else row[: end + 1], end is not None))
    return results


def read_manifest(out: Path) -> dict | None:
    """The validated corpus manifest, or None if the directory holds no corpus yet."""
    return shards.read_manifest(Path(out), CORPUS_KIND, SCHEMA_VERSION)


def _chunks(items: list, n: int) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i: i + n]


@dataclass
class GenClock:
    """Tokens generated and seconds spent generating them, over one run."""

    tokens: int = 0
    seconds: float = 0.0

    def stats(self) -> dict:
        return {"new_tokens": self.tokens, "gen_seconds": round(self.seconds, 1),
                "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds else 0.0}


def generate_rows(teacher: Teacher, encoded: list[list[int]], seeds: list[int], cfg: CorpusConfig,
                  clock: GenClock, bar=None) -> list[tuple[list[int], bool]]:
    """(completion ids, finished) per prompt, generated in batches of similar length."""
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))  # less padding
    results: list = [None] * len(encoded)
    for idx in _chunks(order, cfg.batch_size):
        tb = time.time()
        res = generate_batch(teacher, [encoded[i] for i in idx], [seeds[i] for i in idx], cfg)
        clock.seconds += time.time() - tb
        for i, r in zip(idx, res):
            results[i] = r
        clock.tokens += sum(len(c) for c, _ in res)
        if bar is not None:
            bar.set_postfix(tok_s=f"{clock.tokens / clock.seconds:.0f}", tokens=clock.tokens,
                            refresh=False)
            bar.update(len(idx))
    return results


def build_corpus(cfg: CorpusConfig, teacher: Teacher, prompts: list[Prompt],
                 progress: bool = True, generate=generate_rows) -> dict:
    """Generate the prompts not yet in cfg.out; returns counts for this run. `generate`: how
    (generate_rows' signature; cfg.dtype and cfg.sampler record what it computes in and samples by)."""
    from tqdm import tqdm

    generation = {"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
                  "dtype": cfg.dtype, "seed": cfg.seed, "sampler": cfg.sampler}
    if not cfg.chat:  # recorded only when set: chat corpora keep their identity
        generation["chat"] = False
    target = dict(teacher.info)
    writer_info = target.pop("writer", None)  # the manifest's target is the one to align to
    per_shard = {}
    if writer_info is not None:
        generation["on_policy"] = True
        per_shard["writer"] = writer_info
    identity = {"target": target, "generation": generation}
    with shards.ShardWriter(cfg.out, CORPUS_KIND, SCHEMA_VERSION, identity) as writer:
        done = writer.done()
        todo = [p for k in range(cfg.samples) for p in map(lambda p, k=k: sampled(p, k), prompts)
                if p.id not in done]
        t0, new_rows, clock = time.time(), 0, GenClock()
        bar = tqdm(total=len(todo), unit="prompt", disable=not progress, dynamic_ncols=True,
                   mininterval=1 if sys.stderr.isatty() else 30)
        for chunk in _chunks(todo, cfg.shard_size):
            if cfg.max_minutes is not None and time.time() - t0 > 60 * cfg.max_minutes:
                break
            encoded = [teacher.tokenizer.encode(p.text) if p.raw and teacher.tokenizer is not None
                       else teacher.encode(p.text) for p in chunk]
            seeds = [prompt_seed(cfg.seed, p.id) for p in chunk]
            results = generate(teacher, encoded, seeds, cfg, clock, bar)
            table = pa.table({
                "prompt_id": [p.id for p in chunk], "kind": [p.kind for p in chunk],
                "split": [p.split for p in chunk], "seed": seeds, "prompt_ids": encoded,
                "completion_ids": [c for c, _ in results], "finished": [f for _, f in results],
            }, schema=ARROW_SCHEMA)
            writer.write(table, [p.id for p in chunk],
                         completion_tokens=sum(len(c) for c, _ in results), **per_shard)
            new_rows += len(chunk)
        bar.close()
        total = sum(s["rows"] for s in writer.manifest["shards"])
    return {"new_rows": new_rows, **clock.stats(), "total_rows": total,
            "remaining": len(todo) - new_rows}


def load_corpus(path: str | os.PathLike):
    """The whole corpus as a datasets.Dataset; ValueError on a wrong schema or missing shard."""
    import datasets
    from datasets.table import InMemoryTable

    _, table = shards.read_shards(Path(path), CORPUS_KIND, SCHEMA_VERSION, ARROW_SCHEMA)
    return datasets.Dataset(InMemoryTable(table))


def parse_config(argv: list[str] | None = None) -> CorpusConfig:
    cfg = parse_config_file(CorpusConfig, argv, "python -m training.corpus.teacher",
                            __doc__.split("\n")[0], aliases={"prompt_files": ["--prompts"]})
    if cfg.batch_size < 1 or cfg.shard_size < 1 or cfg.max_new_tokens < 1:
        raise SystemExit("error: batch-size, shard-size and max-new-tokens must be >= 1")
    return cfg


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    prompts = read_prompts(cfg.prompt_files, cfg.max_prompts)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        read_manifest(Path(cfg.out))  # fail on a bad corpus before loading the model
        teacher = with_writer(load_teacher(cfg), cfg)
        print(f"corpus: {len(prompts)} prompts -> {cfg.out} ({json.dumps(asdict(cfg))})",
              file=sys.stderr)
        stats = build_corpus(cfg, teacher, prompts)
    except ValueError as e:  # includes decoding.models.ModelError
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit("interrupted: finished shards are kept; rerun to resume") from None
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
