"""CLI: generate text with a speculative strategy.

    python -m decoding.generate --prompt "..." [--chat] [--strategy ar|sd|mcsd|ti-mcsd] ...

Without --json the text streams to stdout and a stats line goes to stderr; with --json one
object {"text", "token_ids", "stats"} is printed. Batch size is 1. A thin layer over the
Python API (decoding.Decoder).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from decoding import defaults as dflt
from decoding.options import STRATEGY_FLAGS, SamplingConfig, StrategyOptions, add_option, add_options, check_threshold


def defaults_help() -> str:
    """Where the unset options come from (shown in --help)."""
    try:
        kind = dflt.device_kind("cpu")
        d, other = dflt.defaults_for("cpu", True), dflt.defaults_for("cpu", False)
    except ValueError as e:
        return f"defaults: {e}"
    return (f"Defaults of the options marked (*): the measured-best lossless configuration for the shipped pair,\n"
            f"recorded per device kind in decoding/defaults.yaml (rewritten by\n"
            f"python -m decoding.bench --write-defaults). On this machine's CPU ({kind}): {d.describe()}\n"
            f"  from {d.source}\n"
            f"Another target or draft (not measured): {other.describe()}.\n"
            f"The defaults apply only when you name neither --strategy nor a shape (--gamma, --k-config,\n"
            f"--width, --depth). A named strategy runs as named, with its own built-in values for what\n"
            f"you leave unset (stop: fixed depth unless --stop is given); --dtype still defaults as above.")


def add_strategy_args(ap: argparse.ArgumentParser) -> None:
    """One flag per StrategyOptions field (and the decider's), shared by generate and serve;
    `strategy_options` reads them back by the fields' names."""
    add_options(ap, *STRATEGY_FLAGS)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m decoding.generate", description=__doc__,
                                 epilog=defaults_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(ap, "prompt", required=True)
    ap.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    add_options(ap, "target", "draft")
    add_strategy_args(ap)
    add_options(ap, "temperature", "top_p", "seed")
    add_option(ap, "max_new_tokens", default=128)
    add_option(ap, "dtype", only=("float32", "bfloat16"))
    add_options(ap, "device", "forward", "kv_dtype", "threads")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    return ap


def strategy_options(args) -> dict:
    """The StrategyOptions the flags set (None: unset), by field name."""
    opts = {f.name: getattr(args, f.name) for f in fields(StrategyOptions) if f.name != "strategy"}
    return opts | {"replacement": args.replacement or None}  # a store_true flag: unset is None


def check_options(args) -> None:
    """Every option value, checked before torch and transformers are imported (those take
    seconds; a typo should not)."""
    SamplingConfig(args.temperature, args.top_p)
    if args.decider_threshold is not None:
        check_threshold("--decider-threshold", args.decider_threshold)
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    d = dflt.defaults_for(args.device, dflt.is_shipped_pair(args.target, args.draft))
    dflt.strategy_config(d, args.strategy, strategy_options(args))


def load_decoder(args):
    """The Decoder the parsed flags name (generate and serve): threads set, models loaded once."""
    import torch

    from decoding.api import Decoder

    if args.threads:
        torch.set_num_threads(args.threads)
    return Decoder.load(args.target, args.draft, args.decider, dtype=args.dtype, device=args.device,
                        forward=args.forward, kv_dtype=args.kv_dtype, strategy=args.strategy, decider_rule=args.decider_rule,
                        decider_threshold=args.decider_threshold, **strategy_options(args))


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        check_options(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from decoding.models import ModelError

    try:
        dec = load_decoder(args)
        on_text = None if args.json else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
        res = dec.generate(args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed,
                           chat=args.chat, on_text=on_text)
    except (ModelError, ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    d = res.stats
    if args.json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": d}))
    else:
        print()
        print(f"[{d['strategy']}] {d['new_tokens']} tokens in {d['wall_s']:.2f}s = {d['tokens_per_s']} tok/s; "
              f"block efficiency {d['block_efficiency']}, acceptance {d['acceptance_rate']}, "
              f"target calls {d['target_calls']}, lossless={d['lossless']}", file=sys.stderr)
    if d.get("past_trained_window"):
        print(f"note: the draft head was trained on rows of up to {d['trained_window']} tokens and this context "
              f"reached {d['context_tokens']}: past its window its acceptance may fall (the output does not "
              "change)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
