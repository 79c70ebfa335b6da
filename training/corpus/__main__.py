"""python -m training.corpus: a target-written token corpus at scale (see training.corpus.scale).

    python -m training.corpus --config configs/corpus_scale.yaml [--data FILE ...] [--out DIR]
        [--engine plain|speculative] [--temperature T] [--max-minutes M] [--max-tokens N]

Prints one JSON line of counts; its last line says what this run added (positions, bytes) and
the corpus total. Bad input ends with one `error:` line and exit status 1.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from training.config_flags import parse_config as parse_config_file
from training.corpus.scale import ENGINES, ScaleConfig, build, load_prompts


def parse_config(argv: list[str] | None = None) -> ScaleConfig:
    cfg = parse_config_file(ScaleConfig, argv, "python -m training.corpus", __doc__.split("\n")[0])
    if min(cfg.batch_size, cfg.chunk, cfg.shard_tokens, cfg.max_new_tokens, cfg.max_turns) < 1:
        raise SystemExit("error: batch-size, chunk, shard-tokens, max-new-tokens and max-turns must be >= 1")
    if cfg.engine not in ENGINES:
        raise SystemExit(f"error: engine must be one of {', '.join(ENGINES)} (got {cfg.engine!r})")
    if not cfg.data:
        raise SystemExit("error: no prompt or chat data given (--data FILE ...)")
    return cfg


def load(cfg: ScaleConfig):
    """(teacher: the target's tokenizer, end-of-turn ids and identity; its BatchEngine; the
    engine's name as recorded per shard)."""
    from decoding.api import Decoder
    from decoding.serve.worker import batch_engine
    from training.corpus.chat_template import prompt_ids
    from training.corpus.teacher import Teacher, eos_ids, target_fingerprint

    plain = cfg.engine == "plain"
    dec = Decoder.load(cfg.target, None if plain else cfg.draft, dtype=cfg.dtype,
                       strategy="ar" if plain else None, forward=cfg.forward)
    target, tok = dec.session.target, dec.tokenizer
    eos = eos_ids(target, tok)
    # the identity as every corpus records it (a bf16 load: the head's trainers check against it)
    info = target_fingerprint(cfg.target)
    teacher = Teacher(target, lambda text: prompt_ids(tok, [{"role": "user", "content": text}]), eos,
                      tok.pad_token_id if tok.pad_token_id is not None else eos[0], info, tok)
    engine = batch_engine(dec, cfg.budget)
    name = "plain" if engine.draft is None else f"speculative:{dec.config.strategy}:{cfg.draft or 'shipped'}"
    return teacher, engine, f"{name}:{next(target.parameters()).dtype}".replace("torch.", "")


def main(argv: list[str] | None = None) -> None:
    import torch

    from training.corpus import tokens

    cfg = parse_config(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        tokens.read_manifest(cfg.out)  # a bad corpus directory fails before the model loads
        convs, counts = load_prompts(cfg)
        print(f"prompts: {json.dumps(counts)}", file=sys.stderr)
        if not convs:
            raise ValueError(f"no prompt left to answer in {', '.join(cfg.data)}")
        teacher, engine, name = load(cfg)
        print(f"corpus -> {cfg.out} with {name} ({json.dumps(asdict(cfg))})", file=sys.stderr)
        stats = build(cfg, teacher, engine, convs, name)
    except ValueError as e:  # includes decoding.models.ModelError
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit("interrupted: finished shards are kept; rerun to resume") from None
    print(json.dumps(stats))
    a, c = stats["added"], stats["corpus"]
    print(f"added {a['positions']} positions ({a['target_tokens']} target-written) in {a['shards']} shards, "
          f"{a['bytes']} bytes ({a['bytes'] / max(a['positions'], 1):.2f} B/position); corpus: "
          f"{c['tokens']} positions, {c['target_tokens']} target-written, {c['bytes']} bytes")


if __name__ == "__main__":
    main()
