"""How diverse a prompt source is: distinct n-grams and near-duplicates (MinHash-lite).

    python -m training.corpus.diversity --source templates=data/prompts/train.jsonl \
        --source magpie=data/prompts/magpie.jsonl --source chat=chats.jsonl \
        [--max-texts 2000] [--out reports/diversity]

A source is a prompt file ({"prompt": ...} lines) or chat data (training.corpus.chat_data: its
user turns). Per source, on the same number of texts (a fixed-seed sample of --max-texts, since
distinct-n ratios fall as a set grows): distinct-1/2/3 (unique word n-grams / all word
n-grams), the near-duplicate rate (share of texts whose character 5-gram shingles have a
Jaccard similarity >= --threshold with an earlier text; MinHash with banded LSH proposes the
pairs, the exact Jaccard decides), and mean words. Writes <out>/diversity.json and .md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
from pathlib import Path

import numpy as np

from decoding.options import add_option

PERMS, BANDS = 64, 16  # 16 bands of 4 rows: pairs at Jaccard 0.7 meet in a band ~99% of the time
_P = (1 << 31) - 1  # shingle hashes < 2^31 and a < 2^31: a x + b fits in uint64
_RNG = np.random.default_rng(0)
_A = _RNG.integers(1, _P, PERMS, dtype=np.uint64)
_B = _RNG.integers(0, _P, PERMS, dtype=np.uint64)


def words(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]", text.lower())


def normalized(text: str) -> str:
    return " ".join(text.lower().split())


def distinct_n(texts: list[str], n: int) -> float:
    grams = [tuple(w[i: i + n]) for w in map(words, texts) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def shingles(text: str, k: int = 5) -> set[int]:
    t = normalized(text)
    grams = {t[i: i + k] for i in range(max(1, len(t) - k + 1))}
    return {int.from_bytes(hashlib.blake2b(g.encode(), digest_size=4).digest(), "big") % _P
            for g in grams}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def minhash(sh: set[int]) -> np.ndarray:
    x = np.fromiter(sh, dtype=np.uint64, count=len(sh)) if sh else np.zeros(1, np.uint64)
    return ((np.outer(_A, x) + _B[:, None]) % np.uint64(_P)).min(1)


def near_duplicates(texts: list[str], threshold: float = 0.7) -> list[bool]:
    """True where a text is a near-duplicate (Jaccard >= threshold) of an EARLIER one."""
    sets = [shingles(t) for t in texts]
    buckets: dict[tuple, list[int]] = {}
    rows = PERMS // BANDS
    flags = []
    for i, s in enumerate(sets):
        sig = minhash(s)
        keys = [(b, sig[b * rows: (b + 1) * rows].tobytes()) for b in range(BANDS)]
        cands = {j for k in keys for j in buckets.get(k, [])}
        flags.append(any(jaccard(s, sets[j]) >= threshold for j in sorted(cands)))
        for k in keys:
            buckets.setdefault(k, []).append(i)
    return flags


def stats(texts: list[str], threshold: float = 0.7) -> dict:
    return {"texts": len(texts), **{f"distinct_{n}": round(distinct_n(texts, n), 4) for n in (1, 2, 3)},
            "near_duplicate_rate": round(float(np.mean(near_duplicates(texts, threshold))), 4)
            if texts else 0.0, "mean_words": round(float(np.mean([len(words(t)) for t in texts])), 1)
            if texts else 0.0}


def read_texts(path: str) -> list[str]:
    """Prompts of a prompt file, or the user turns of chat data."""
    p = Path(path)
    if p.suffix == ".jsonl" and p.is_file():
        first = next((line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()), "")
        if "prompt" in json.loads(first or "{}"):
            return [json.loads(line)["prompt"] for line in p.read_text(encoding="utf-8").splitlines()
                    if line.strip()]
    from training.corpus.chat_data import load_chats

    data = load_chats(path)
    return [m["content"] for c in data.conversations for m in c.messages if m["role"] == "user"]


def report(sources: dict[str, list[str]], max_texts: int = 2000, threshold: float = 0.7,
           seed: int = 0) -> dict:
    n = min([max_texts, *map(len, sources.values())])
    out = {}
    for name, texts in sources.items():
        sample = random.Random(seed).sample(texts, n) if len(texts) > n else list(texts)
        out[name] = stats(sample, threshold) | {"available": len(texts)}
    return {"texts_per_source": n, "threshold": threshold, "sources": out}


def markdown(rep: dict) -> str:
    lines = [f"# Prompt diversity ({rep['texts_per_source']} texts per source, near-duplicate: "
             f"char 5-gram Jaccard >= {rep['threshold']})", "",
             "| source | available | distinct-1 | distinct-2 | distinct-3 | near-dup rate | mean words |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in rep["sources"].items():
        lines.append(f"| {name} | {s['available']} | {s['distinct_1']:.3f} | {s['distinct_2']:.3f} | "
                     f"{s['distinct_3']:.3f} | {s['near_duplicate_rate']:.3f} | {s['mean_words']} |")
    return "\n".join(lines) + "\n"


def write_report(rep: dict, out: Path) -> None:
    from training import shards

    out.mkdir(parents=True, exist_ok=True)
    shards.write_json(out / "diversity.json", rep)
    shards.atomic_write(out / "diversity.md", lambda p: p.write_text(markdown(rep)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.corpus.diversity",
                                description=__doc__.split("\n")[0])
    p.add_argument("--source", action="append", required=True, metavar="NAME=PATH")
    p.add_argument("--max-texts", type=int, default=2000)
    p.add_argument("--threshold", type=float, default=0.7)
    add_option(p, "out", default="reports/diversity")
    a = p.parse_args(argv)
    sources = {}
    for s in a.source:
        name, sep, path = s.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: --source wants NAME=PATH (got {s!r})")
        try:
            sources[name] = read_texts(path)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: {path}: {e}") from None
        if not sources[name]:
            raise SystemExit(f"error: {path}: no texts")
    rep = report(sources, a.max_texts, a.threshold)
    write_report(rep, Path(a.out))
    print(markdown(rep), end="")


if __name__ == "__main__":
    main()
