"""A corpus of EXISTING text for a target: re-tokenized, never written by the target.

    python -m training.corpus.text --target gemma3-270m --out runs/corpus-gemma3-text
        [--from data/corpus data/corpus-onpolicy] [--prompts data/prompts/train.jsonl]
        [--max-rows N]

Generating a corpus with a slow target (Gemma 3 270M decodes ~10 tokens/s on 2 CPU cores) costs
far more than scoring text with it (one prefill), so this takes the text of existing corpora
(another model's token ids, decoded with that model's tokenizer), writes it as plain text for a
base model (`base_opening`: "Q: <instruction>\\nA:" then the answer) and re-tokenizes it with
the target's tokenizer. The target labels every position later (training.head.cache:
its own features, logits and argmax), so a head trained on it learns the target's distribution,
but on text the target did not write: a known handicap against EAGLE-3's regenerated data.

The manifest says so: `target` is the target that labels the corpus (what the feature cache
checks), `generation.source` is "existing-text" with the source corpora, their writer and the
formatting, and no sampling settings, so it never passes for a target-written corpus. Same
layout and resumability as training.corpus.teacher (a source row keeps its prompt id and split).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from decoding.options import add_option

from training import shards
from training.corpus.teacher import ARROW_SCHEMA, CORPUS_KIND, SCHEMA_VERSION, base_id, read_manifest, read_prompts

FORMAT = "qa-plain-v1"  # part of the identity: another formatting is another corpus


def base_opening(instruction: str) -> str:
    """An instruction as the opening of a plain text a base model continues."""
    return f"Q: {instruction.strip()}\nA:"


def _source_info(corpora: list[str]) -> list[dict]:
    out = []
    for c in corpora:
        m = read_manifest(Path(c))
        if m is None:
            raise ValueError(f"{c}: no manifest.json: not a corpus directory")
        body = json.dumps(m, sort_keys=True).encode()
        out.append({"corpus": Path(c).name, "writer": m["target"].get("name"),
                    "on_policy": bool(m.get("generation", {}).get("on_policy")),
                    "manifest_sha256": hashlib.sha256(body).hexdigest()})
    return out


def build_text_corpus(out: str, target_info: dict, target_tok, source_tok, corpora: list[str],
                      prompts: dict[str, str], max_rows: int | None = None,
                      shard_size: int = 128) -> dict:
    """Re-tokenize the source corpora's rows not yet in `out`; returns row counts."""
    identity = {"target": target_info,
                "generation": {"source": "existing-text", "format": FORMAT,
                               "from": _source_info(corpora), "chat": False}}
    bos = [target_tok.bos_token_id] if target_tok.bos_token_id is not None else []
    new = 0
    with shards.ShardWriter(out, CORPUS_KIND, SCHEMA_VERSION, identity) as writer:
        done, seen = writer.done(), 0
        buf: dict[str, list] = {k: [] for k in ARROW_SCHEMA.names}

        def flush() -> None:
            nonlocal new
            if buf["prompt_id"]:
                writer.write(pa.table(buf, schema=ARROW_SCHEMA), list(buf["prompt_id"]),
                             completion_tokens=sum(map(len, buf["completion_ids"])))
                new += len(buf["prompt_id"])
                for v in buf.values():
                    v.clear()

        for c in corpora:
            for s in read_manifest(Path(c))["shards"]:
                t = pq.read_table(Path(c) / s["file"]).to_pydict()
                for i, pid in enumerate(t["prompt_id"]):
                    if max_rows is not None and seen >= max_rows:
                        break
                    seen += 1
                    if pid in done:
                        continue
                    if base_id(pid) not in prompts:
                        raise ValueError(f"{c}: prompt {pid} is in none of the prompt files")
                    answer = source_tok.decode(t["completion_ids"][i], skip_special_tokens=True)
                    p = bos + target_tok.encode(base_opening(prompts[base_id(pid)]),
                                                add_special_tokens=False)
                    comp = target_tok.encode(" " + answer.strip(), add_special_tokens=False)
                    if t["finished"][i] and target_tok.eos_token_id is not None:
                        comp.append(target_tok.eos_token_id)
                    row = {"prompt_id": pid, "kind": t["kind"][i], "split": t["split"][i],
                           "seed": t["seed"][i], "prompt_ids": p, "completion_ids": comp,
                           "finished": t["finished"][i]}
                    for k, v in row.items():
                        buf[k].append(v)
                    if len(buf["prompt_id"]) >= shard_size:
                        flush()
        flush()
        total = sum(s["rows"] for s in writer.manifest["shards"])
    return {"new_rows": new, "total_rows": total}


def main(argv: list[str] | None = None) -> None:
    from decoding.models import load_tokenizer

    from training.corpus.teacher import target_fingerprint

    p = argparse.ArgumentParser(prog="python -m training.corpus.text",
                                description=__doc__.split("\n")[0])
    add_option(p, "target", required=True)
    add_option(p, "out", required=True)
    p.add_argument("--from", dest="corpora", nargs="+", default=["data/corpus"],
                   help="source corpora (token ids in --source-tokenizer's vocabulary)")
    p.add_argument("--source-tokenizer", default=None,
                   help="the source corpora's model dir (default: the embedded SmolLM2)")
    add_option(p, "prompts_file", several=True, default=["data/prompts/train.jsonl"])
    p.add_argument("--max-rows", type=int, default=None, help="the first N source rows")
    p.add_argument("--shard-size", type=int, default=128)
    a = p.parse_args(argv)
    try:
        prompts = {q.id: q.text for q in read_prompts(a.prompts_file)}
        stats = build_text_corpus(a.out, target_fingerprint(a.target), load_tokenizer(a.target),
                                  load_tokenizer(a.source_tokenizer), a.corpora, prompts,
                                  a.max_rows, a.shard_size)
    except ValueError as e:  # includes decoding.models.ModelError
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(stats), file=sys.stderr)


if __name__ == "__main__":
    main()
